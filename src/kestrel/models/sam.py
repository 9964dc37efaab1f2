"""Segment Anything (Kirillov et al., 2023), as ``facebook/sam-vit-base`` ships it.

The image encoder is a ViT on a 64 x 64 grid of 16 px patches of a 1024 px image: windowed layers
(14 x 14 windows, the grid padded to 70) with a global layer every third, each attention adding
decomposed relative-position terms, then a convolutional neck down to ``Hd`` channels. The prompt
encoder (random Fourier features of the prompt coordinates plus learnt per-kind embeddings) lives in
the root block; the mask decoder is a two-way transformer between prompt tokens and image tokens,
an upscaling path to 256 x 256, and one hypernetwork MLP per mask token. Every entry returns all
four masks (the single-mask one first, then the three multimask ones) with their predicted IoUs.
"""

from typing import Any, ClassVar

from ..blocks import Block, Dim, Float, Layers, Param, each, entry, f32, variant
from ..std import ops
from ..std.nn import Conv2d, Linear, transformer
from ..std.ops_attention import decomposed_attention
from . import sam_parts

IMAGE = 1024  # the encoder's input side, in pixels
GRID = 64  # the patch grid: IMAGE / 16
WINDOW = 14  # the windowed layers' window side
MASK_TOKENS = 4  # one single-mask token, then three multimask tokens


class LayerNorm(transformer.LayerNorm):
    pass


class LayerNormCHW(sam_parts.LayerNormCHW):
    """Layer norm over the channels of a channels-first map (SAM's neck and mask upscaling)."""


class GeluMlp(Block):
    D: Dim
    Inner: Dim
    T: Float

    lin1: Linear["D, Inner, T"]
    lin2: Linear["Inner, D, T"]

    def forward(self, x: "Tensor[*S, D; T]") -> "Tensor[*S, D; T]":
        return self.lin2(ops.gelu_(self.lin1(x)))


class ReluMlp(GeluMlp):
    def forward(self, x: "Tensor[*S, D; T]") -> "Tensor[*S, D; T]":
        return self.lin2(ops.relu(self.lin1(x)))


class FeedForward3(sam_parts.FeedForward3):
    """Three linear layers with ReLU between them (the hypernetworks and the IoU head)."""


class Deconv2x2(sam_parts.Deconv2x2):
    pass


# ---------------------------------------------------------------------------------- image encoder


class VisionAttention(transformer.MultiHead):
    """Self-attention over a ``Wh x Wh`` window with decomposed relative positions (MViTv2).

    The score of query ``(h, w)`` against key ``(h', w')`` gains ``q . Rh[h - h'] + q . Rw[w - w']``.
    """

    Wh: Dim
    T: Float
    where = "Wh > 0"

    qkv: Linear["D, 3 * D, T"]
    proj: Linear["D, D, T"]
    rel_pos_h: Param["2 * Wh - 1, D / Heads; T"]
    rel_pos_w: Param["2 * Wh - 1, D / Heads; T"]

    def forward(self, x: "Tensor[Bw, Wh, Wh, D; T]") -> "Tensor[Bw, Wh, Wh, D; T]":
        Bw = x.shape[0]
        heads, dh, wh = self.Heads, self.D // self.Heads, self.Wh
        qkv = self.qkv(x).reshape(Bw, wh * wh, 3, heads, dh).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]  # [Bw, Heads, Wh * Wh, D / Heads]
        rel_h, rel_w = self._relative_terms(q)
        y = decomposed_attention(q, k, v, rel_h, rel_w)  # never the whole [Bw, Heads, Wh^2, Wh^2] bias
        y = y.reshape(Bw, heads, wh, wh, dh).permute(0, 2, 3, 1, 4).reshape(Bw, wh, wh, self.D)
        return self.proj(y)

    def _relative_terms(self, q):
        """``q . Rh[h - h']`` and ``q . Rw[w - w']``: ``[Bw, Heads, Wh * Wh, Wh]`` each."""
        Bw, heads, _, dh = q.shape
        wh = self.Wh
        rh = ops.relative_positions(self.rel_pos_h, wh).transpose(1, 2)  # [Wh(q), D / Heads, Wh(k)]
        rw = ops.relative_positions(self.rel_pos_w, wh).transpose(1, 2)
        q = q.reshape(Bw, heads, wh, wh, dh)
        rel_h = ops.matmul(q, rh)  # [Bw, Heads, h, w, h']
        rel_w = ops.matmul(q.transpose(2, 3), rw).transpose(2, 3)  # [Bw, Heads, h, w, w']
        return rel_h.reshape(Bw, heads, wh * wh, wh), rel_w.reshape(Bw, heads, wh * wh, wh)


class VisionLayerWindowed(transformer.MultiHead):
    """A pre-norm layer whose attention runs in 14 x 14 windows of the zero-padded 70 x 70 grid."""

    Inner: Dim
    T: Float

    layer_norm1: LayerNorm["D, T"]
    attn: VisionAttention["D, Heads, 14, T"]
    layer_norm2: LayerNorm["D, T"]
    mlp: GeluMlp["D, Inner, T"]

    def forward(self, x: "Tensor[B, 64, 64, D; T]") -> "Tensor[B, 64, 64, D; T]":
        n = -(-GRID // WINDOW)  # windows per side
        x = x + sam_parts.window_attention(self.attn, self.layer_norm1(x), WINDOW, n, n * WINDOW - GRID, GRID)
        return x + self.mlp(self.layer_norm2(x))


class VisionLayerGlobal(VisionLayerWindowed):
    """A pre-norm layer whose attention spans the whole 64 x 64 grid."""

    attn: VisionAttention["D, Heads, 64, T"]

    def forward(self, x: "Tensor[B, 64, 64, D; T]") -> "Tensor[B, 64, 64, D; T]":
        x = x + self.attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class VisionNeck(Block):
    """1 x 1 then 3 x 3 convolutions (no biases) down to ``Hd`` channels, each channel-normed."""

    D: Dim
    Hd: Dim
    T: Float
    where = "D > 0, Hd > 0"

    conv1: Conv2d["D, Hd, 1, 1, 0, T"]
    ln1: LayerNormCHW["Hd, T"]
    conv2: Conv2d["Hd, Hd, 3, 1, 1, T"]
    ln2: LayerNormCHW["Hd, T"]

    def forward(self, x: "Tensor[B, 64, 64, D; T]") -> "Tensor[B, Hd, 64, 64; T]":
        x = self.ln1(self.conv1(x.permute(0, 3, 1, 2)))
        return self.ln2(self.conv2(x))


class VisionEncoder(transformer.MultiHead):
    """Patch embedding, the layers (windowed or global, as the checkpoint's layout says), the neck."""

    Inner: Dim
    Hd: Dim
    T: Float
    where = "D > 0, Hd > 0"
    layout: ClassVar[dict[str, Any]] = {"layer": ("windowed", "windowed", "global") * 4}  # ViT-B's, the seed's

    patch_embed: Conv2d["3, D, 16, 16, 0, T"]
    pos_embed: Param["1, 64, 64, D; T"]
    layer: Layers[{"windowed": VisionLayerWindowed["D, Heads, Inner, T"],
                   "global": VisionLayerGlobal["D, Heads, Inner, T"]}]
    neck: VisionNeck["D, Hd, T"]

    def forward(self, pixel_values: "Tensor[B, 3, 1024, 1024; T]") -> "Tensor[B, Hd, 64, 64; T]":
        x = ops.contiguous(self.patch_embed(pixel_values).permute(0, 2, 3, 1)) + self.pos_embed
        for layer in each(self, "layer"):
            x = layer(x)
        return self.neck(x)


def encoder_layout(depth: int, global_layers: tuple[int, ...] | list[int]) -> tuple[str, ...]:
    """The kind of each of ``depth`` encoder layers, global at ``global_layers`` (the config's
    ``num_hidden_layers`` and ``global_attn_indexes``)."""
    if depth <= 0 or any(not 0 <= i < depth for i in global_layers):
        raise ValueError(f"SAM encoder layout: {depth} layers with global attention at {list(global_layers)}")
    return tuple("global" if i in set(global_layers) else "windowed" for i in range(depth))


# ----------------------------------------------------------------------------------- mask decoder


class MaskAttention(sam_parts.MaskAttentionHeads):
    """Multi-head attention whose projections may narrow the width to ``Internal``."""

    out_proj: Linear["Internal, Hd, T"]

    def forward(
        self, query: "Tensor[B, Pts, Q, Hd; T]", key: "Tensor[B, Pts, K, Hd; T]", value: "Tensor[B, Pts, K, Hd; T]"
    ) -> "Tensor[B, Pts, Q, Hd; T]":
        return self._attend(query, key, value, self.out_proj)


class TwoWayAttentionBlock(sam_parts.TwoWaySizes):
    """Tokens attend to themselves, then to the image; the image then attends to the tokens."""

    T: Float

    self_attn: MaskAttention["Hd, Hd, Heads, T"]
    layer_norm1: LayerNorm["Hd, T"]
    cross_attn_token_to_image: MaskAttention["Hd, Hd / 2, Heads, T"]
    layer_norm2: LayerNorm["Hd, T"]
    mlp: ReluMlp["Hd, Inner, T"]
    layer_norm3: LayerNorm["Hd, T"]
    cross_attn_image_to_token: MaskAttention["Hd, Hd / 2, Heads, T"]
    layer_norm4: LayerNorm["Hd, T"]

    def forward_first(
        self, queries: "Tensor[B, Pts, Nq, Hd; T]", keys: "Tensor[B, Pts, Nk, Hd; T]",
        qpe: "Tensor[B, Pts, Nq, Hd; T]", kpe: "Tensor[B, Pts, Nk, Hd; T]",
    ) -> "(Tensor[B, Pts, Nq, Hd; T], Tensor[B, Pts, Nk, Hd; T])":
        """The first layer: self-attention without positions and without a residual."""
        queries = self.layer_norm1(self.self_attn(queries, queries, queries))
        return self._tail(queries, keys, qpe, kpe)

    def forward_rest(
        self, queries: "Tensor[B, Pts, Nq, Hd; T]", keys: "Tensor[B, Pts, Nk, Hd; T]",
        qpe: "Tensor[B, Pts, Nq, Hd; T]", kpe: "Tensor[B, Pts, Nk, Hd; T]",
    ) -> "(Tensor[B, Pts, Nq, Hd; T], Tensor[B, Pts, Nk, Hd; T])":
        q = queries + qpe
        queries = self.layer_norm1(queries + self.self_attn(q, q, queries))
        return self._tail(queries, keys, qpe, kpe)

    def _tail(
        self, queries: "Tensor[B, Pts, Nq, Hd; T]", keys: "Tensor[B, Pts, Nk, Hd; T]",
        qpe: "Tensor[B, Pts, Nq, Hd; T]", kpe: "Tensor[B, Pts, Nk, Hd; T]",
    ) -> "(Tensor[B, Pts, Nq, Hd; T], Tensor[B, Pts, Nk, Hd; T])":
        return sam_parts.two_way_tail(self, queries, keys, qpe, kpe, self.cross_attn_image_to_token)


class TwoWayTransformer(sam_parts.TwoWaySizes):
    T: Float
    final_eps = 1e-5  # upstream's last norm keeps torch's default eps

    layer_0: TwoWayAttentionBlock["Hd, Heads, Inner, T"]
    layer_1: TwoWayAttentionBlock["Hd, Heads, Inner, T"]
    final_attn_token_to_image: MaskAttention["Hd, Hd / 2, Heads, T"]
    layer_norm_final_attn: LayerNorm["Hd, T"]

    def forward(
        self, point_embeddings: "Tensor[B, Pts, Nq, Hd; T]", image_embeddings: "Tensor[B, Pts, Nk, Hd; T]",
        image_pe: "Tensor[B, Pts, Nk, Hd; T]",
    ) -> "(Tensor[B, Pts, Nq, Hd; T], Tensor[B, Pts, Nk, Hd; T])":
        queries, keys = self.layer_0.forward_first(point_embeddings, image_embeddings, point_embeddings, image_pe)
        queries, keys = self.layer_1.forward_rest(queries, keys, point_embeddings, image_pe)
        attn = self.final_attn_token_to_image(queries + point_embeddings, keys + image_pe, keys)
        norm = self.layer_norm_final_attn
        return ops.layer_norm(queries + attn, norm.weight, norm.bias, self.final_eps), keys


class MaskDecoder(sam_parts.TwoWaySizes):
    T: Float
    where = "Hd % 8 == 0, Hd >= 8"

    iou_token: Param["1, Hd; T"]
    mask_tokens: Param["4, Hd; T"]
    transformer: TwoWayTransformer["Hd, Heads, Inner, T"]
    upscale_conv1: Deconv2x2["Hd, Hd / 4, T"]
    upscale_layer_norm: LayerNormCHW["Hd / 4, T"]
    upscale_conv2: Deconv2x2["Hd / 4, Hd / 8, T"]
    hyper_mlp_0: FeedForward3["Hd, Hd, Hd / 8, T"]
    hyper_mlp_1: FeedForward3["Hd, Hd, Hd / 8, T"]
    hyper_mlp_2: FeedForward3["Hd, Hd, Hd / 8, T"]
    hyper_mlp_3: FeedForward3["Hd, Hd, Hd / 8, T"]
    iou_prediction_head: FeedForward3["Hd, Hd, 4, T"]

    def forward(
        self, image_embeddings: "Tensor[B, Hd, 64, 64; T]", image_pe: "Tensor[B, Hd, 64, 64; T]",
        sparse_prompt_embeddings: "Tensor[B, Pts, Ns, Hd; T]", dense_prompt_embeddings: "Tensor[B, Hd, 64, 64; T]",
    ) -> "(Tensor[B, Pts, 4, 256, 256; T], Tensor[B, Pts, 4; T])":
        B, Pts, _, _ = sparse_prompt_embeddings.shape
        hd, side = self.Hd, 4 * GRID
        tokens = ops.cat([self.iou_token, self.mask_tokens], dim=0).expand(B, Pts, 1 + MASK_TOKENS, hd)
        tokens = ops.cat([tokens, sparse_prompt_embeddings], dim=2)

        def per_prompt(t):  # [B, Hd, 64, 64] -> [B, Pts, 64 * 64, Hd], shared by the prompts of an image
            tokens = ops.contiguous(t.flatten(2).transpose(1, 2))  # row-major: adds and linears run with the grain
            return tokens.unsqueeze(1).expand(B, Pts, GRID * GRID, hd)

        image = per_prompt(image_embeddings + dense_prompt_embeddings)
        queries, keys = self.transformer(tokens, image, per_prompt(image_pe))

        image = keys.transpose(2, 3).reshape(B * Pts, hd, GRID, GRID)
        up = ops.gelu_(self.upscale_layer_norm(self.upscale_conv1(image)))
        up = ops.gelu_(self.upscale_conv2(up)).reshape(B, Pts, hd // 8, side * side)
        mlps = (self.hyper_mlp_0, self.hyper_mlp_1, self.hyper_mlp_2, self.hyper_mlp_3)
        hyper = ops.stack([mlp(queries[:, :, 1 + i, :]) for i, mlp in enumerate(mlps)], dim=2)
        masks = ops.matmul(hyper, up).reshape(B, Pts, MASK_TOKENS, side, side)
        return masks, self.iou_prediction_head(queries[:, :, 0, :])


# ------------------------------------------------------------------------------------------ model


class Model(Block):
    """SAM: ``encode_image`` once per image, then a decode per prompt.

    Points and boxes are in pixels of the 1024 x 1024 model input. Point labels: 1 foreground,
    0 background, -1 not a point, -10 padding (ignored). ``decode_points`` and ``decode_boxes`` are
    the seed's entries; a prompt of any other mix (points with a box, a previous low-resolution mask)
    is ``embed_points`` / ``embed_boxes`` concatenated along the token axis, ``embed_masks`` or
    ``no_mask_embeddings`` for the dense part, then ``decode``.
    """

    D: Dim
    VisionHeads: Dim
    VisionInner: Dim
    Hd: Dim
    MaskHeads: Dim
    MaskInner: Dim
    T: Float = f32
    where = ("VisionHeads > 0, D % VisionHeads == 0, MaskHeads > 0, Hd % MaskHeads == 0, "
             "(Hd / 2) % MaskHeads == 0, Hd % 8 == 0, Hd % 2 == 0, D > 0, Hd >= 8")
    imports = ("std.nn.conv", "std.nn.linear", "std.nn.norm")

    vision_encoder: VisionEncoder["D, VisionHeads, VisionInner, Hd, T"]
    positional_embedding: Param["2, Hd / 2; T"]
    not_a_point_embed: Param["1, Hd; T"]
    point_embed_0: Param["1, Hd; T"]
    point_embed_1: Param["1, Hd; T"]
    point_embed_2: Param["1, Hd; T"]
    point_embed_3: Param["1, Hd; T"]
    no_mask_embed: Param["1, Hd; T"]
    mask_decoder: MaskDecoder["Hd, MaskHeads, MaskInner, T"]
    # the mask prompt's encoder: 256 x 256 logits down to the 64 x 64 grid (added beyond the seed)
    mask_conv1: Conv2d["1, 4, 2, 2, 0, T"]
    mask_norm1: LayerNormCHW["4, T"]
    mask_conv2: Conv2d["4, 16, 2, 2, 0, T"]
    mask_norm2: LayerNormCHW["16, T"]
    mask_conv3: Conv2d["16, Hd, 1, 1, 0, T"]

    @entry
    def encode_image(self, pixel_values: "Tensor[B, 3, 1024, 1024; T]") -> "Tensor[B, Hd, 64, 64; T]":
        """The image embedding: normalised pixels (the processor's resize, pad and scaling) in."""
        return self.vision_encoder(pixel_values)

    @entry
    def decode_points(
        self, image_embeddings: "Tensor[B, Hd, 64, 64; T]", input_points: "Tensor[B, Pts, N, 2; T]",
        input_labels: "Tensor[B, Pts, N; i32]",
    ) -> "(Tensor[B, Pts, 4, 256, 256; T], Tensor[B, Pts, 4; T])":
        """Mask logits and IoU predictions for ``Pts`` prompts of ``N`` labelled points each."""
        # as upstream, one "not a point" is appended to every prompt (at the origin, labelled -1)
        points = ops.pad(input_points, [0, 0, 0, 1])
        labels = ops.pad(input_labels, [0, 1], value=-1)
        return self._decode(image_embeddings, self._points(points, labels), self._no_mask(image_embeddings))

    @entry
    def decode_boxes(
        self, image_embeddings: "Tensor[B, Hd, 64, 64; T]", input_boxes: "Tensor[B, Nb, 4; T]"
    ) -> "(Tensor[B, Nb, 4, 256, 256; T], Tensor[B, Nb, 4; T])":
        """Mask logits and IoU predictions for ``Nb`` boxes ``(x1, y1, x2, y2)``."""
        return self._decode(image_embeddings, self._boxes(input_boxes), self._no_mask(image_embeddings))

    @entry
    def embed_points(
        self, input_points: "Tensor[B, Pts, N, 2; T]", input_labels: "Tensor[B, Pts, N; i32]"
    ) -> "Tensor[B, Pts, N, Hd; T]":
        """Sparse tokens of labelled points, as given (no "not a point" appended)."""
        return self._points(input_points, input_labels)

    @entry
    def embed_boxes(self, input_boxes: "Tensor[B, Nb, 4; T]") -> "Tensor[B, Nb, 2, Hd; T]":
        """Sparse tokens of boxes: one per corner."""
        return self._boxes(input_boxes)

    @entry
    def embed_masks(self, input_masks: "Tensor[B, 1, 256, 256; T]") -> "Tensor[B, Hd, 64, 64; T]":
        """The dense prompt of a low-resolution mask (logits, as a previous decode returned them)."""
        x = ops.gelu(self.mask_norm1(self.mask_conv1(input_masks)))
        x = ops.gelu(self.mask_norm2(self.mask_conv2(x)))
        return self.mask_conv3(x)

    @entry
    def no_mask_embeddings(self, image_embeddings: "Tensor[B, Hd, 64, 64; T]") -> "Tensor[B, Hd, 64, 64; T]":
        """The dense prompt when there is no mask prompt (one per image of ``image_embeddings``)."""
        return self._no_mask(image_embeddings)

    @entry
    def decode(
        self, image_embeddings: "Tensor[B, Hd, 64, 64; T]", sparse_embeddings: "Tensor[B, Pts, Ns, Hd; T]",
        dense_embeddings: "Tensor[B, Hd, 64, 64; T]",
    ) -> "(Tensor[B, Pts, 4, 256, 256; T], Tensor[B, Pts, 4; T])":
        """Mask logits and IoU predictions for ``Pts`` prompts of ``Ns`` sparse tokens and a dense prompt."""
        return self._decode(image_embeddings, sparse_embeddings, dense_embeddings)

    def _points(self, points, labels):
        emb = sam_parts.fourier((points + 0.5) / IMAGE, self.positional_embedding)
        labels = labels.unsqueeze(-1)
        emb = ops.where(ops.eq(labels, -1), self.not_a_point_embed, emb)
        emb = ops.where(ops.eq(labels, -10), 0.0, emb)
        emb = ops.where(ops.eq(labels, 0), emb + self.point_embed_0, emb)
        return ops.where(ops.eq(labels, 1), emb + self.point_embed_1, emb)

    def _boxes(self, boxes):
        B, Nb, _ = boxes.shape
        corners = ((boxes + 0.5) / IMAGE).reshape(B, Nb, 2, 2)
        corner_kind = ops.cat([self.point_embed_2, self.point_embed_3], dim=0)
        return sam_parts.fourier(corners, self.positional_embedding) + corner_kind

    def _no_mask(self, image_embeddings):
        B = image_embeddings.shape[0]
        return self.no_mask_embed.reshape(1, self.Hd, 1, 1).expand(B, self.Hd, GRID, GRID)

    def _decode(self, image_embeddings, sparse, dense):
        B = image_embeddings.shape[0]
        return self.mask_decoder(image_embeddings, self._image_pe(B), sparse, dense)

    def _image_pe(self, B):
        """The Fourier features of every grid cell's centre, ``[B, Hd, 64, 64]``."""
        return ops.grid_fourier(self.positional_embedding, GRID).expand(B, self.Hd, GRID, GRID)


def model_for(depth: int, global_layers: tuple[int, ...] | list[int]) -> type[Block]:
    """The ``Model`` block whose encoder has ``depth`` layers, global at ``global_layers`` (ViT-B/L/H)."""
    encoder = variant(VisionEncoder, layout={"layer": encoder_layout(depth, global_layers)})
    return variant(Model, subs={"vision_encoder": encoder})
