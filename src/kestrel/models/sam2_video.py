"""SAM 2.1 in video (Ravi et al., 2024): the memory that carries an object from frame to frame.

``VideoModel`` is SAM 2.1's image model (``sam2.Model``: its members and entries unchanged) with the
parts of ``Sam2VideoModel`` that track:

- the **memory encoder**: the frame's mask (sigmoid probabilities while tracking, the thresholded
  mask on a prompted frame), scaled to logits' range, down-sampled 16 x by four stride-2
  convolutions (the mask down-sampler), added to the projected 1/16 image features and fused by two
  ConvNeXt layers (the fuser), then projected to ``Mem`` channels. A frame whose object score says
  "no object" gets the learnt occlusion embedding added. Upstream keeps memories in bfloat16; so
  does ``encode_memory``'s answer (rounded, returned in ``T``).
- **memory attention**: ``MemLayers`` pre-norm layers of self-attention over the frame's features
  and cross-attention into the memory bank, both with 2-D axial rotary position encodings (RoPE) on
  the ``E x E`` grid; the object pointers at the end of the bank carry no RoPE.
- **object pointers**: the chosen mask token through a three-layer MLP, replaced by the learnt
  no-object pointer when the object score is not positive; in the bank each pointer is split into
  ``Hd / Mem`` tokens and tagged by a sine encoding of its normalised temporal distance, projected
  to ``Mem`` channels.
- **temporal encodings**: memory frame ``t`` frames back wears the ``MaskMem - t``-th learnt
  encoding; conditioning frames (those with prompts) wear the last.

Which frames enter the bank (the conditioning frames plus the last ``MaskMem - 1`` tracked ones)
and which pointers (up to ``max_object_pointers``) is the tracking engine's business:
:mod:`kestrel.pipelines.video_tracker`.
"""

import math
from typing import Any

from ..blocks import Array, Block, Dim, Float, Param, entry, variant
from ..std import ops
from ..std.nn import Conv2d, Linear
from ..types.dtypes import bf16
from . import sam2
from .sam2 import FeedForward3, LayerNormCHW, TokenNorm

NO_OBJECT_SCORE = -1024.0  # the logit upstream gives every pixel of a frame without the object


def sine_positions(like, channels: int, side: int):
    """The normalised 2-D sine encoding ``[1, channels, side, side]`` of a ``side x side`` grid
    (y features then x features, each ``sin, cos`` interleaved), as upstream's position encodings."""
    quarter = channels // 4
    grid = (ops.arange_like(like, side) + 1.0) / (ops.dim_like(like, side) + 1e-6) * (2 * math.pi)
    freq = (ops.arange_like(like, quarter) * 2.0) / ops.dim_like(like, 2 * quarter)
    inv = ops.exp(freq * (-math.log(10000.0)))  # 1 / 10000 ** (2 floor(i / 2) / (channels / 2)), one per pair
    angles = grid.unsqueeze(1) * inv.unsqueeze(0)  # [side, channels / 4]
    waves = ops.stack([ops.sin(angles), ops.cos(angles)], dim=-1).reshape(side, 2 * quarter)
    y = waves.unsqueeze(1).expand(side, side, 2 * quarter)
    x = waves.unsqueeze(0).expand(side, side, 2 * quarter)
    return ops.cat([y, x], dim=-1).permute(2, 0, 1).unsqueeze(0)


# ----------------------------------------------------------------------------------- memory encoder


class DepthwiseConv(Block):
    """A ``(2 Pad + 1)``-square filter per channel, stride 1, padded to keep the size."""

    C: Dim
    Pad: Dim
    T: Float
    where = "C > 0"

    weight: Param["C, 1, 2 * Pad + 1, 2 * Pad + 1; T"]
    bias: Param["C; T"]

    def forward(self, x: "Tensor[B, C, H, W; T]") -> "Tensor[B, C, H, W; T]":
        return ops.depthwise_conv2d(x, self.weight, self.bias, padding=self.Pad)


class MaskDownLayer(Block):
    """One step of the mask down-sampler: a stride-2 3 x 3 convolution, channel norm, GELU."""

    Cin: Dim
    Cout: Dim
    S: Dim
    T: Float
    where = "Cin > 0, Cout > 0, S > 0"

    conv: Conv2d["Cin, Cout, 3, 2, 1, T"]
    layer_norm: LayerNormCHW["Cout, T"]

    def forward(self, x: "Tensor[B, Cin, 2 * S, 2 * S; T]") -> "Tensor[B, Cout, S, S; T]":
        return ops.gelu(self.layer_norm(self.conv(x)))


class MaskDownSampler(Block):
    """The mask at ``16 E`` down to the ``E x E`` grid: four steps (1 -> 4 -> 16 -> 64 -> 256
    channels), then a 1 x 1 convolution to ``Hd``."""

    Hd: Dim
    E: Dim
    T: Float
    where = "Hd > 0, E > 0"

    layer_0: MaskDownLayer["1, 4, 8 * E, T"]
    layer_1: MaskDownLayer["4, 16, 4 * E, T"]
    layer_2: MaskDownLayer["16, 64, 2 * E, T"]
    layer_3: MaskDownLayer["64, 256, E, T"]
    final_conv: Conv2d["256, Hd, 1, 1, 0, T"]

    def forward(self, masks: "Tensor[B, 1, 16 * E, 16 * E; T]") -> "Tensor[B, Hd, E, E; T]":
        return self.final_conv(self.layer_3(self.layer_2(self.layer_1(self.layer_0(masks)))))


class FuserLayer(Block):
    """The fuser's ConvNeXt layer: depthwise 7 x 7, channel norm, a GELU MLP per pixel, layer scale."""

    C: Dim
    Inner: Dim
    T: Float
    where = "C > 0, Inner > 0"

    depthwise_conv: DepthwiseConv["C, 3, T"]
    layer_norm: LayerNormCHW["C, T"]
    pointwise_conv1: Linear["C, Inner, T"]
    pointwise_conv2: Linear["Inner, C, T"]
    scale: Param["C; T"]

    def forward(self, x: "Tensor[B, C, H, W; T]") -> "Tensor[B, C, H, W; T]":
        h = self.layer_norm(self.depthwise_conv(x)).permute(0, 2, 3, 1)
        h = self.pointwise_conv2(ops.gelu(self.pointwise_conv1(h))) * self.scale
        return x + h.permute(0, 3, 1, 2)


class MemoryEncoder(Block):
    """A frame's features and its mask (as probabilities) to ``Mem`` memory channels."""

    Hd: Dim
    Mem: Dim
    E: Dim
    FuserInner: Dim
    FuserLayers: Dim
    T: Float
    where = "Hd > 0, Mem > 0, E > 0, FuserInner > 0"

    mask_downsampler: MaskDownSampler["Hd, E, T"]
    feature_projection: Conv2d["Hd, Hd, 1, 1, 0, T"]
    memory_fuser: Array[FuserLayer["Hd, FuserInner, T"], "FuserLayers"]
    projection: Conv2d["Hd, Mem, 1, 1, 0, T"]

    def forward(self, features: "Tensor[B, Hd, E, E; T]", masks: "Tensor[B, 1, 16 * E, 16 * E; T]"
                ) -> "Tensor[B, Mem, E, E; T]":
        x = self.feature_projection(features) + self.mask_downsampler(masks)
        for layer in self.memory_fuser:
            x = layer(x)
        return self.projection(x)


# --------------------------------------------------------------------------------- memory attention


def _rotate_pairs(x):
    """RoPE's pairwise rotation of the last axis: ``(a, b) -> (-b, a)`` for each pair."""
    B, N, D = x.shape
    pairs = x.reshape(B, N, D // 2, 2)
    return ops.stack([pairs[:, :, :, 1] * -1.0, pairs[:, :, :, 0]], dim=-1).reshape(B, N, D)


def _rope(t, cos, sin):
    """Rotary position encoding of ``[B, L, D]`` by the tables ``[L, D]``."""
    return t * cos + _rotate_pairs(t) * sin


def _single_head(q, k, v):
    """One full-width head of attention, ``[B, N, D]`` in and out, given to the attention kernel as
    ``[B, 1, N, D]`` (as upstream lays it out): torch's fused CPU kernel takes only 4-D inputs and
    never holds the ``N x Nk`` scores, where 3-D ones fall to its explicit path (scores, a guarded
    soft-max, a second GEMM: ~1.4-2x the time at 64 x 64 tokens, and the whole score matrix in memory)."""
    return ops.attention(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1)).squeeze(1)


class RopeAttention(Block):
    """Single-head self-attention with 2-D axial RoPE on queries and keys."""

    Hd: Dim
    T: Float
    where = "Hd % 2 == 0, Hd > 0"

    q_proj: Linear["Hd, Hd, T"]
    k_proj: Linear["Hd, Hd, T"]
    v_proj: Linear["Hd, Hd, T"]
    o_proj: Linear["Hd, Hd, T"]

    def forward(self, x: "Tensor[B, N, Hd; T]", cos: "Tensor[N, Hd; T]", sin: "Tensor[N, Hd; T]"
                ) -> "Tensor[B, N, Hd; T]":
        q = _rope(self.q_proj(x), cos, sin)
        k = _rope(self.k_proj(x), cos, sin)
        return self.o_proj(_single_head(q, k, self.v_proj(x)))


class RopeCrossAttention(Block):
    """Single-head cross-attention from the grid's queries into ``F`` memory frames laid out as the
    grid (RoPE on both, each frame rotated like the queries) and ``P`` pointer tokens (no RoPE);
    keys and values come in ``Kv`` wide."""

    Hd: Dim
    Kv: Dim
    T: Float
    where = "Hd % 2 == 0, Hd > 0, Kv > 0"

    q_proj: Linear["Hd, Hd, T"]
    k_proj: Linear["Kv, Hd, T"]
    v_proj: Linear["Kv, Hd, T"]
    o_proj: Linear["Hd, Hd, T"]

    def forward(
        self, x: "Tensor[B, N, Hd; T]", keys: "Tensor[B, F, N, Kv; T]", values: "Tensor[B, F, N, Kv; T]",
        pointer_keys: "Tensor[B, P, Kv; T]", pointer_values: "Tensor[B, P, Kv; T]",
        cos: "Tensor[N, Hd; T]", sin: "Tensor[N, Hd; T]",
    ) -> "Tensor[B, N, Hd; T]":
        B, F, N, _ = keys.shape
        hd = self.Hd
        q = _rope(self.q_proj(x), cos, sin)
        # each memory frame rotated by the grid's tables, broadcast over the frames (not copied F times)
        k = _rope(self.k_proj(keys).reshape(B * F, N, hd), cos, sin).reshape(B, F * N, hd)
        k = ops.cat([k, self.k_proj(pointer_keys)], dim=1)
        v = ops.cat([self.v_proj(values).reshape(B, F * N, hd), self.v_proj(pointer_values)], dim=1)
        return self.o_proj(_single_head(q, k, v))


class MemoryAttentionLayer(Block):
    """Pre-norm self-attention, cross-attention into the memory bank, ReLU MLP."""

    Hd: Dim
    Mem: Dim
    Inner: Dim
    T: Float
    where = "Hd % 2 == 0, Hd > 0, Mem > 0, Inner > 0"

    self_attn: RopeAttention["Hd, T"]
    cross_attn_image: RopeCrossAttention["Hd, Mem, T"]
    linear1: Linear["Hd, Inner, T"]
    linear2: Linear["Inner, Hd, T"]
    layer_norm1: TokenNorm["Hd, T"]
    layer_norm2: TokenNorm["Hd, T"]
    layer_norm3: TokenNorm["Hd, T"]

    def forward(
        self, x: "Tensor[B, N, Hd; T]", memory: "Tensor[B, F, N, Mem; T]", memory_pos: "Tensor[B, F, N, Mem; T]",
        pointers: "Tensor[B, P, Mem; T]", pointer_pos: "Tensor[B, P, Mem; T]",
        cos: "Tensor[N, Hd; T]", sin: "Tensor[N, Hd; T]",
    ) -> "Tensor[B, N, Hd; T]":
        x = x + self.self_attn(self.layer_norm1(x), cos, sin)
        x = x + self.cross_attn_image(self.layer_norm2(x), memory + memory_pos, memory,
                                      pointers + pointer_pos, pointers, cos, sin)
        return x + self.linear2(ops.relu(self.linear1(self.layer_norm3(x))))


class MemoryAttention(Block):
    """The frame's features conditioned on the memory bank: ``Layers`` layers, then a layer norm.

    Every published checkpoint has one head of the full width (``memory_attention_num_attention_heads
    = 1``, downsample rate 1); the card refuses others.
    """

    Hd: Dim
    Mem: Dim
    Inner: Dim
    Layers: Dim
    E: Dim
    T: Float
    where = "Hd % 4 == 0, Hd % 2 == 0, Hd > 0, Mem > 0, Inner > 0, E > 0"
    rope_theta: float = 10000.0

    layers: Array[MemoryAttentionLayer["Hd, Mem, Inner, T"], "Layers"]
    layer_norm: TokenNorm["Hd, T"]

    def forward(
        self, x: "Tensor[B, E * E, Hd; T]", memory: "Tensor[B, F, E * E, Mem; T]",
        memory_pos: "Tensor[B, F, E * E, Mem; T]", pointers: "Tensor[B, P, Mem; T]",
        pointer_pos: "Tensor[B, P, Mem; T]",
    ) -> "Tensor[B, E * E, Hd; T]":
        cos, sin = self.rope(x)
        for layer in self.layers:
            x = layer(x, memory, memory_pos, pointers, pointer_pos, cos, sin)
        return self.layer_norm(x)

    def rope(self, like: "Tensor[B, N, Hd; T]") -> "(Tensor[E * E, Hd; T], Tensor[E * E, Hd; T])":
        """RoPE's cosines and sines on the ``E x E`` grid: the first half of the pairs turn with the
        column, the second half with the row, at ``theta ** (-4 i / Hd)``."""
        e, q = self.E, self.Hd // 4
        inv = ops.exp(ops.arange_like(like, q) * (-4.0 * math.log(self.rope_theta)) / ops.dim_like(like, 4 * q))
        steps = ops.arange_like(like, e)
        col = steps.unsqueeze(0).expand(e, e).reshape(e * e)
        row = steps.unsqueeze(1).expand(e, e).reshape(e * e)
        angles = ops.cat([col.unsqueeze(1) * inv.unsqueeze(0), row.unsqueeze(1) * inv.unsqueeze(0)], dim=-1)
        angles = angles.unsqueeze(2).expand(e * e, 2 * q, 2).reshape(e * e, 4 * q)  # each angle twice: one pair
        return ops.cos(angles), ops.sin(angles)


# -------------------------------------------------------------------------------------------- model


class VideoModel(sam2.Model):
    """SAM 2.1 with memory: the image model's entries, and per frame ``encode_frame``, then
    ``attend_memory`` (or ``without_memory`` on a prompted frame), ``track_step``, ``encode_memory``.

    ``Mem`` memory channels, ``MaskMem`` temporal encodings (upstream's ``num_maskmem``),
    ``MemLayers`` single-head memory-attention layers of MLP width ``MemInner``, ``FuserLayers``
    fuser layers of width ``FuserInner``.
    """

    Mem: Dim
    MaskMem: Dim
    MemLayers: Dim
    MemInner: Dim
    FuserInner: Dim
    FuserLayers: Dim
    where = ("Mem > 0, Mem % 4 == 0, Mem % 2 == 0, Hd % 4 == 0, Hd % Mem == 0, Hd >= Mem, MaskMem > 0, "
             "MemInner > 0, FuserInner > 0")
    sigmoid_scale: float = 20.0
    sigmoid_bias: float = -10.0

    memory_encoder: MemoryEncoder["Hd, Mem, E, FuserInner, FuserLayers, T"]
    memory_attention: MemoryAttention["Hd, Mem, MemInner, MemLayers, E, T"]
    memory_temporal_positional_encoding: Param["MaskMem, 1, 1, Mem; T"]
    no_object_pointer: Param["1, Hd; T"]
    object_pointer_proj: FeedForward3["Hd, Hd, Hd, T"]
    temporal_positional_encoding_projection_layer: Linear["Hd, Mem, T"]
    occlusion_spatial_embedding_parameter: Param["1, Mem; T"]

    @entry
    def encode_frame(self, pixel_values: "Tensor[B, 3, 16 * E, 16 * E; T]") -> (
        "(Tensor[B, Hd, E, E; T], Tensor[B, Hd, 4 * E, 4 * E; T], Tensor[B, Hd, 2 * E, 2 * E; T])"
    ):
        """A frame's 1/16 features (before any memory or the no-memory embedding) and the 1/4 and 1/8
        features before ``conv_s0`` / ``conv_s1``, from normalised pixels."""
        x0, x1, x2, x3 = self.backbone(pixel_values)
        return self.neck(x0, x1, x2, x3)

    def without_memory(self, features: "Tensor[B, Hd, E, E; T]") -> "Tensor[B, Hd, E, E; T]":
        """A prompted frame's features: the learnt no-memory embedding added (``encode_image``'s embedding)."""
        return features + self.no_memory_embedding.reshape(1, self.Hd, 1, 1)

    @entry
    def attend_memory(
        self, features: "Tensor[B, Hd, E, E; T]", memory: "Tensor[B, F, Mem, E, E; T]", slots: "Tensor[F; i64]",
        pointers: "Tensor[B, P, Hd; T]", offsets: "Tensor[P; T]",
    ) -> "Tensor[B, Hd, E, E; T]":
        """The frame's features conditioned on ``F`` memory frames and ``P`` object pointers.

        ``slots`` picks each memory frame's temporal encoding (``MaskMem - t`` for a frame ``t`` back,
        ``MaskMem - 1`` for a conditioning frame: 0-based rows); ``offsets`` are the pointers' temporal
        distances over the pointer window (``t / (max_object_pointers - 1)``).
        """
        B, F = memory.shape[0], memory.shape[1]
        P = pointers.shape[1]
        hd, mem, n = self.Hd, self.Mem, self.E * self.E
        x = features.flatten(2).transpose(1, 2) + self.positions().flatten(2).transpose(1, 2) * 0.1
        spatial = memory.flatten(3).transpose(2, 3)  # [B, F, E * E, Mem]
        temporal = ops.gather(self.memory_temporal_positional_encoding.reshape(self.MaskMem, mem), slots)
        spatial_pos = (sine_positions(memory, mem, self.E).flatten(2).transpose(1, 2)
                       + temporal.unsqueeze(1)).unsqueeze(0).expand(B, F, n, mem)
        splits = hd // mem
        tokens = pointers.reshape(B, P * splits, mem)
        tpos = self.temporal_positional_encoding_projection_layer(self._pointer_encoding(offsets))  # [P, Mem]
        tpos = tpos.unsqueeze(1).expand(P, splits, mem).reshape(P * splits, mem).unsqueeze(0).expand(
            B, P * splits, mem)
        y = self.memory_attention(x, spatial, spatial_pos, tokens, tpos)
        return y.transpose(1, 2).reshape(B, hd, self.E, self.E)

    @entry
    def track_step(
        self, features: "Tensor[B, Hd, E, E; T]", hr0: "Tensor[B, Hd, 4 * E, 4 * E; T]",
        hr1: "Tensor[B, Hd, 2 * E, 2 * E; T]", input_points: "Tensor[B, Pts, N, 2; T]",
        input_labels: "Tensor[B, Pts, N; i32]", multimask: "Tensor[B, Pts, 1; T]",
    ) -> "(Tensor[B, Pts, 1, 4 * E, 4 * E; T], Tensor[B, Pts, 1; T], Tensor[B, Pts, Hd; T])":
        """One frame's mask logits, object-score logit and object pointer for each object.

        ``features`` come from ``attend_memory`` or ``without_memory``. Labels as ``decode_points``
        (a box is the corners labelled 2 and 3; no prompt is one point labelled -1). Where
        ``multimask`` is positive the answer is the multimask output of best predicted IoU, else
        upstream's single-mask choice by stability; the pointer comes from the chosen multimask
        token, or from the single-mask token. A non-positive object score sets every logit to -1024
        and the pointer to the learnt no-object pointer.
        """
        B, Pts = input_points.shape[0], input_points.shape[1]
        side = 4 * self.E
        sparse = self._point_tokens(input_points, input_labels)
        masks, iou, obj, tokens = self._decode_with_tokens(features, hr0, hr1, sparse)
        best = ops.argmax(iou[:, :, 1:], -1).reshape(B, Pts, 1)  # the first best on ties
        multi_mask = ops.take_along(masks[:, :, 1:], best.reshape(B, Pts, 1, 1, 1).expand(B, Pts, 1, side, side), 2)
        multi_token = ops.take_along(tokens[:, :, 1:], best.reshape(B, Pts, 1, 1).expand(B, Pts, 1, self.Hd), 2)
        single_mask, _ = self.mask_decoder.select_single(masks, iou)
        use_multi = ops.gt(multimask, 0.0)
        chosen = ops.where(use_multi.reshape(B, Pts, 1, 1, 1), multi_mask, single_mask)
        token = ops.where(use_multi, multi_token.reshape(B, Pts, self.Hd), tokens[:, :, 0, :])
        appearing = ops.gt(obj, 0.0)
        chosen = ops.where(appearing.reshape(B, Pts, 1, 1, 1), chosen, NO_OBJECT_SCORE)
        seen = ops.cast(appearing, self.T)
        pointer = seen * self.object_pointer_proj(token)
        pointer = pointer + (1.0 - seen) * self.no_object_pointer
        return chosen, obj, pointer

    @entry
    def encode_memory(
        self, features: "Tensor[B, Hd, E, E; T]", mask_logits: "Tensor[B, 1, 4 * E, 4 * E; T]",
        object_score: "Tensor[B, 1; T]", binarize: "Tensor[B, 1; T]",
    ) -> "Tensor[B, Mem, E, E; T]":
        """A frame's memory from its raw features (``encode_frame``) and one object's mask logits.

        The mask is resized to the image (bilinear), then taken as probabilities: thresholded at 0
        where ``binarize`` is positive (a mask from prompts), else through a sigmoid; scaled to
        ``sigmoid_scale * p + sigmoid_bias``. A frame without the object (score <= 0) gets the
        occlusion embedding. Rounded to bfloat16 as upstream stores it.
        """
        B = features.shape[0]
        image = 16 * self.E
        high = ops.interpolate(mask_logits, size=(image, image), mode="bilinear", align_corners=False)
        hard = ops.cast(ops.gt(high, 0.0), self.T)
        probs = ops.where(ops.gt(binarize, 0.0).reshape(B, 1, 1, 1), hard, ops.sigmoid(high))
        memory = self.memory_encoder(features, probs * self.sigmoid_scale + self.sigmoid_bias)
        absent = 1.0 - ops.cast(ops.gt(object_score, 0.0), self.T)  # [B, 1]
        memory = memory + absent.reshape(B, 1, 1, 1) * self.occlusion_spatial_embedding_parameter.reshape(
            1, self.Mem, 1, 1)
        return ops.cast(ops.cast(memory, bf16), self.T)

    def positions(self) -> "Tensor[1, Hd, E, E; T]":
        """The frame features' sine position encoding (the neck's, at 1/16)."""
        return sine_positions(self.no_object_pointer, self.Hd, self.E)

    def _pointer_encoding(self, offsets):
        """Upstream's 1-D sine encoding of the pointers' offsets: ``[sin, cos]`` over ``Hd / 2``
        frequencies ``10000 ** (2 floor(i / 2) / (Hd / 2))``."""
        q = self.Hd // 4
        i = ops.arange_like(offsets, q)  # each frequency twice
        i = i.unsqueeze(1).expand(q, 2).reshape(2 * q)
        inv = ops.exp((i * 2.0) / ops.dim_like(offsets, 2 * q) * (-math.log(10000.0)))
        angles = offsets.unsqueeze(1) * inv.unsqueeze(0)
        return ops.cat([ops.sin(angles), ops.cos(angles)], dim=-1)


def model_for(layout: dict[str, Any]) -> type[Block]:
    """The ``VideoModel`` whose backbone is laid out as ``layout`` (see :func:`kestrel.models.sam2.hiera_layout`)."""
    return variant(VideoModel, subs={"backbone": variant(sam2.Hiera, layout=layout)})
