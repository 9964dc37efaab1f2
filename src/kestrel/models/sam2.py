"""SAM 2.1 (Ravi et al., 2024), the image path of ``Sam2Model``: Hiera, an FPN neck, prompts, masks.

The image encoder is Hiera: a 7 x 7 stride-4 patch embedding, then four stages at 1/4, 1/8, 1/16
and 1/32 of the image, each a run of pre-norm layers that attend inside square windows (the map
zero-padded up to a whole number of windows). The first layer of stages 1-3 halves the map by
max-pooling its queries inside each window and widens the channels. Which layers attend globally
(a window that is the whole map) is the checkpoint's layout, data rather than code: Hiera-tiny's
three global layers sit in stage 2, and any other placement loads as well. The position embedding is a
small background table resized bicubically to the stage-0 map plus a window-sized table tiled over
it. The FPN neck takes 1 x 1 convolutions of the four stage outputs down to ``Hd`` channels and
adds the upsampled 1/32 map to the 1/16 one: the 1/16 map plus the learnt no-memory embedding is the
image embedding; the 1/4 and 1/8 maps are the high-resolution features the mask decoder adds to its
upscaling path (through ``conv_s0`` and ``conv_s1``).

Sizes are generics: ``E`` is the image-embedding side (64 at 1024 px, 32 at 512 px; the image is
``16 * E``), ``Win*`` the stages' windows, ``Pad*`` how far each stage's map is padded to whole
windows. The layer counts are the layout's (:func:`model_for`).
"""

from typing import Any, ClassVar

from ..blocks import Array, Block, Dim, Float, Param, Runs, entry, f32, runs, variant
from ..std import ops
from ..std.nn import Conv2d, Linear, transformer
from . import sam_parts

MASK_TOKENS = 4  # one single-mask token, then three multimask tokens
NOT_A_POINT_BIAS = -1e9  # the key bias of a padding token in decode_tokens


class LayerNorm(transformer.LayerNorm):
    """Hiera's layer norm (the config's ``layer_norm_eps``)."""


class TokenNorm(Block):
    """The two-way transformer's layer norm (torch's default eps upstream, whatever the config says)."""

    D: Dim
    T: Float

    weight: Param["D; T"]
    bias: Param["D; T"]

    def forward(self, x: "Tensor[*S, D; T]") -> "Tensor[*S, D; T]":
        return ops.layer_norm(x, self.weight, self.bias, 1e-5)


class LayerNormCHW(sam_parts.LayerNormCHW):
    """Layer norm over the channels of a channels-first map (the mask upscaling path)."""


class GeluMlp(Block):
    D: Dim
    Inner: Dim
    T: Float

    proj_in: Linear["D, Inner, T"]
    proj_out: Linear["Inner, D, T"]

    def forward(self, x: "Tensor[*S, D; T]") -> "Tensor[*S, D; T]":
        return self.proj_out(ops.gelu_(self.proj_in(x)))


class ReluMlp(GeluMlp):
    def forward(self, x: "Tensor[*S, D; T]") -> "Tensor[*S, D; T]":
        return self.proj_out(ops.relu(self.proj_in(x)))


class FeedForward3(sam_parts.FeedForward3):
    """Three linear layers with ReLU between them (hypernetworks, IoU and object-score heads)."""


class Deconv2x2(sam_parts.Deconv2x2):
    """A stride-2 transposed 2 x 2 convolution: each pixel becomes a 2 x 2 block."""


# ------------------------------------------------------------------------------------------ Hiera


class WindowAttention(transformer.MultiHead):
    """Multi-head self-attention inside each window (one fused qkv projection)."""

    T: Float

    qkv: Linear["D, 3 * D, T"]
    proj: Linear["D, D, T"]

    def forward(self, x: "Tensor[Bw, Wh, Ww, D; T]") -> "Tensor[Bw, Wh, Ww, D; T]":
        Bw, wh, ww, _ = x.shape
        qkv = self.qkv(x).reshape(Bw, wh * ww, 3, self.Heads, self.D // self.Heads).permute(2, 0, 3, 1, 4)
        y = ops.attention(qkv[0], qkv[1], qkv[2])  # [Bw, Heads, Wh * Ww, D / Heads]
        return self.proj(y.transpose(1, 2).reshape(Bw, wh, ww, self.D))


class StageChange(Block, abstract=True):
    """The generics a stage change opens with: ``Din -> Dout`` channels in ``Heads`` heads, the
    queries max-pooled inside ``2Q x 2Q`` windows; declared once for the layer and its attention."""

    Din: Dim
    Dout: Dim
    Heads: Dim
    Q: Dim
    where = "Heads > 0, Dout > 0, Dout % Heads == 0, Q > 0"


class PoolAttention(StageChange):
    """Attention whose queries are 2 x 2 max-pooled inside each ``2Q x 2Q`` window (stage changes)."""

    T: Float

    qkv: Linear["Din, 3 * Dout, T"]
    proj: Linear["Dout, Dout, T"]

    def forward(self, x: "Tensor[Bw, 2 * Q, 2 * Q, Din; T]") -> "Tensor[Bw, Q, Q, Dout; T]":
        Bw = x.shape[0]
        q2, heads, dh = 2 * self.Q, self.Heads, self.Dout // self.Heads
        qkv = self.qkv(x).reshape(Bw, q2 * q2, 3, heads, dh)
        q = qkv[:, :, 0].reshape(Bw, q2, q2, self.Dout).permute(0, 3, 1, 2)
        q = ops.max_pool2d(q, 2).permute(0, 2, 3, 1).reshape(Bw, self.Q * self.Q, heads, dh)
        y = ops.attention(q.transpose(1, 2), qkv[:, :, 1].transpose(1, 2), qkv[:, :, 2].transpose(1, 2))
        return self.proj(y.transpose(1, 2).reshape(Bw, self.Q, self.Q, self.Dout))


class HieraLayer(transformer.MultiHead):
    """A pre-norm layer attending in ``Win x Win`` windows of the ``Side`` map padded by ``Pad``.

    With ``Win = Side`` and ``Pad = 0`` it is a global layer: one window, the whole map.
    """

    Win: Dim
    Side: Dim
    Pad: Dim
    T: Float
    where = "Win > 0, (Side + Pad) % Win == 0, Side + Pad >= Win"

    layer_norm1: LayerNorm["D, T"]
    attn: WindowAttention["D, Heads, T"]
    layer_norm2: LayerNorm["D, T"]
    mlp: GeluMlp["D, 4 * D, T"]

    def forward(self, x: "Tensor[B, Side, Side, D; T]") -> "Tensor[B, Side, Side, D; T]":
        side, pad = self.Side, self.Pad
        n = (side + pad) // self.Win
        x = x + sam_parts.window_attention(self.attn, self.layer_norm1(x), self.Win, n, pad, side)
        return x + self.mlp(self.layer_norm2(x))


class HieraPoolLayer(StageChange):
    """A stage change: ``2 Side -> Side`` by query pooling in ``2Q`` windows, ``Din -> Dout`` channels.

    ``Pad`` pads the pooled map to whole ``Q`` windows (the input is padded by ``2 * Pad``); the
    residual is the pooled projection of the normed input.
    """

    Side: Dim
    Pad: Dim
    T: Float
    where = "(Side + Pad) % Q == 0, Side > 0, Side + Pad >= Q"

    layer_norm1: LayerNorm["Din, T"]
    attn: PoolAttention["Din, Dout, Heads, Q, T"]
    layer_norm2: LayerNorm["Dout, T"]
    mlp: GeluMlp["Dout, 4 * Dout, T"]
    proj: Linear["Din, Dout, T"]

    def forward(self, x: "Tensor[B, 2 * Side, 2 * Side, Din; T]") -> "Tensor[B, Side, Side, Dout; T]":
        side, pad = self.Side, self.Pad
        n = (side + pad) // self.Q
        h = self.layer_norm1(x)
        residual = ops.max_pool2d(self.proj(h).permute(0, 3, 1, 2), 2).permute(0, 2, 3, 1)
        x = residual + sam_parts.window_attention(self.attn, h, 2 * self.Q, n, 2 * pad, side)
        return x + self.mlp(self.layer_norm2(x))


def _through(block, name, x):
    """``x`` through the runs of layers that ``block``'s layout lays out as ``name``, in order."""
    for run in runs(block, name):
        for layer in run:
            x = layer(x)
    return x


class HieraSizes(Block, abstract=True):
    """Hiera's sizes, declared once for the backbone and the model that binds it: ``E`` the image
    embedding's side, ``Bg`` the background position table's, per stage the width, heads, window
    and how far the stage's map is padded to whole windows."""

    E: Dim
    Bg: Dim
    D0: Dim
    D1: Dim
    D2: Dim
    D3: Dim
    Heads0: Dim
    Heads1: Dim
    Heads2: Dim
    Heads3: Dim
    Win0: Dim
    Win1: Dim
    Win2: Dim
    Win3: Dim
    Pad0: Dim
    Pad1: Dim
    Pad2: Dim
    Pad3: Dim
    where = ("E % 2 == 0, E > 0, Bg > 0, Heads0 > 0, Heads1 > 0, Heads2 > 0, Heads3 > 0, D0 % Heads0 == 0, "
             "D1 % Heads1 == 0, D2 % Heads2 == 0, D3 % Heads3 == 0, Win0 > 1, Win1 > 1, Win2 > 1, Win3 > 0, "
             "Win0 % 2 == 0, Win1 % 2 == 0, Win2 % 2 == 0, Pad0 % 2 == 0, Pad1 % 2 == 0, Pad2 % 2 == 0, "
             "(4 * E) % Win0 == 0, (4 * E + Pad0) % Win0 == 0, (2 * E + Pad1) % Win1 == 0, "
             "(E + Pad2) % Win2 == 0, (E / 2 + Pad3) % Win3 == 0, (2 * E + Pad0 / 2) % (Win0 / 2) == 0, "
             "(E + Pad1 / 2) % (Win1 / 2) == 0, (E / 2 + Pad2 / 2) % (Win2 / 2) == 0, "
             "E >= 2, D0 > 0, D1 > 0, D2 > 0, D3 > 0, 4 * E + Pad0 >= Win0, 2 * E + Pad1 >= Win1, "
             "E + Pad2 >= Win2, E / 2 + Pad3 >= Win3, 2 * E + Pad0 / 2 >= Win0 / 2, E + Pad1 / 2 >= Win1 / 2, "
             "E / 2 + Pad2 / 2 >= Win2 / 2")


class Hiera(HieraSizes):
    """The backbone: patch embedding, positions, four stages; returns every stage's output.

    Which layers attend in windows and which globally is the checkpoint's data (``layout``): stages
    1-3 open with ``pool_s`` (the layer that halves the map, in the previous stage's windows), then
    each stage is runs of windowed or global layers, ``stage_s_0``, ``stage_s_1``, ... A global
    layer is a windowed one whose window is the whole map.
    """

    T: Float
    layout: ClassVar[dict[str, Any]] = {  # Hiera-tiny's: blocks per stage 1, 2, 7, 2; global blocks 5, 7, 9
        "stage_0": ("windowed",),
        "stage_1": ("windowed",),
        "stage_2": ("windowed", "global") * 3,
        "stage_3": ("windowed",),
    }

    patch_embed: Conv2d["3, D0, 7, 4, 3, T"]
    pos_embed: Param["1, D0, Bg, Bg; T"]
    pos_embed_window: Param["1, D0, Win0, Win0; T"]
    stage_0: Runs[{"windowed": HieraLayer["D0, Heads0, Win0, 4 * E, Pad0, T"],
                   "global": HieraLayer["D0, Heads0, 4 * E, 4 * E, 0, T"]}]
    pool_1: HieraPoolLayer["D0, D1, Heads1, Win0 / 2, 2 * E, Pad0 / 2, T"]
    stage_1: Runs[{"windowed": HieraLayer["D1, Heads1, Win1, 2 * E, Pad1, T"],
                   "global": HieraLayer["D1, Heads1, 2 * E, 2 * E, 0, T"]}]
    pool_2: HieraPoolLayer["D1, D2, Heads2, Win1 / 2, E, Pad1 / 2, T"]
    stage_2: Runs[{"windowed": HieraLayer["D2, Heads2, Win2, E, Pad2, T"],
                   "global": HieraLayer["D2, Heads2, E, E, 0, T"]}]
    pool_3: HieraPoolLayer["D2, D3, Heads3, Win2 / 2, E / 2, Pad2 / 2, T"]
    stage_3: Runs[{"windowed": HieraLayer["D3, Heads3, Win3, E / 2, Pad3, T"],
                   "global": HieraLayer["D3, Heads3, E / 2, E / 2, 0, T"]}]

    def forward(self, pixel_values: "Tensor[B, 3, 16 * E, 16 * E; T]") -> (
        "(Tensor[B, 4 * E, 4 * E, D0; T], Tensor[B, 2 * E, 2 * E, D1; T], Tensor[B, E, E, D2; T], "
        "Tensor[B, E / 2, E / 2, D3; T])"
    ):
        x0 = ops.contiguous(self.patch_embed(pixel_values).permute(0, 2, 3, 1)) + self.positions()
        x0 = _through(self, "stage_0", x0)
        x1 = _through(self, "stage_1", self.pool_1(x0))
        x2 = _through(self, "stage_2", self.pool_2(x1))
        return x0, x1, x2, _through(self, "stage_3", self.pool_3(x2))

    def positions(self) -> "Tensor[1, 4 * E, 4 * E, D0; T]":
        """The background table resized bicubically to the stage-0 map plus the tiled window table.

        It depends on the weights only: an export computes it once and stores it as a constant.
        """
        side, win = 4 * self.E, self.Win0
        background = ops.interpolate(self.pos_embed, size=(side, side), mode="bicubic")
        return (background + self.pos_embed_window.repeat(1, 1, side // win, side // win)).permute(0, 2, 3, 1)


class FpnNeck(Block):
    """1 x 1 lateral convolutions to ``Hd`` channels; the 1/32 map upsampled into the 1/16 one."""

    D0: Dim
    D1: Dim
    D2: Dim
    D3: Dim
    Hd: Dim
    E: Dim
    T: Float
    where = "E % 2 == 0, E >= 2, Hd > 0, D0 > 0, D1 > 0, D2 > 0, D3 > 0"

    lateral_3: Conv2d["D3, Hd, 1, 1, 0, T"]
    lateral_2: Conv2d["D2, Hd, 1, 1, 0, T"]
    lateral_1: Conv2d["D1, Hd, 1, 1, 0, T"]
    lateral_0: Conv2d["D0, Hd, 1, 1, 0, T"]

    def forward(
        self, x0: "Tensor[B, 4 * E, 4 * E, D0; T]", x1: "Tensor[B, 2 * E, 2 * E, D1; T]",
        x2: "Tensor[B, E, E, D2; T]", x3: "Tensor[B, E / 2, E / 2, D3; T]",
    ) -> "(Tensor[B, Hd, E, E; T], Tensor[B, Hd, 4 * E, 4 * E; T], Tensor[B, Hd, 2 * E, 2 * E; T])":
        """The 1/16 map, then the 1/4 and 1/8 high-resolution features."""
        top = self.lateral_3(x3.permute(0, 3, 1, 2))
        s2 = self.lateral_2(x2.permute(0, 3, 1, 2)) + ops.interpolate(top, scale_factor=2, mode="nearest")
        return s2, self.lateral_0(x0.permute(0, 3, 1, 2)), self.lateral_1(x1.permute(0, 3, 1, 2))


# ----------------------------------------------------------------------------------- mask decoder


class MaskAttention(sam_parts.MaskAttentionHeads):
    """Multi-head attention whose projections may narrow the width to ``Internal``; ``key_bias`` is
    added to every query's scores (0, or -1e9 for a key that is a padding token)."""

    o_proj: Linear["Internal, Hd, T"]

    def forward(
        self, query: "Tensor[B, Pts, Q, Hd; T]", key: "Tensor[B, Pts, K, Hd; T]", value: "Tensor[B, Pts, K, Hd; T]"
    ) -> "Tensor[B, Pts, Q, Hd; T]":
        return self._attend(query, key, value, self.o_proj)

    def masked(
        self, query: "Tensor[B, Pts, Q, Hd; T]", key: "Tensor[B, Pts, K, Hd; T]", value: "Tensor[B, Pts, K, Hd; T]",
        key_bias: "Tensor[B, Pts, 1, 1, K; T]",
    ) -> "Tensor[B, Pts, Q, Hd; T]":
        B, Pts, K, _ = key.shape
        return self._attend(query, key, value, self.o_proj, key_bias.reshape(B, Pts, 1, K))


class TwoWayAttentionBlock(sam_parts.TwoWaySizes):
    """Tokens attend to themselves, then to the image; the image then attends to the tokens."""

    T: Float

    self_attn: MaskAttention["Hd, Hd, Heads, T"]
    layer_norm1: TokenNorm["Hd, T"]
    cross_attn_token_to_image: MaskAttention["Hd, Hd / 2, Heads, T"]
    layer_norm2: TokenNorm["Hd, T"]
    mlp: ReluMlp["Hd, Inner, T"]
    layer_norm3: TokenNorm["Hd, T"]
    cross_attn_image_to_token: MaskAttention["Hd, Hd / 2, Heads, T"]
    layer_norm4: TokenNorm["Hd, T"]

    def forward_first(
        self, queries: "Tensor[B, Pts, Nq, Hd; T]", keys: "Tensor[B, Pts, Nk, Hd; T]",
        qpe: "Tensor[B, Pts, Nq, Hd; T]", kpe: "Tensor[B, Pts, Nk, Hd; T]", bias: "Tensor[B, Pts, 1, 1, Nq; T]",
    ) -> "(Tensor[B, Pts, Nq, Hd; T], Tensor[B, Pts, Nk, Hd; T])":
        """The first layer: self-attention without positions and without a residual."""
        queries = self.layer_norm1(self.self_attn.masked(queries, queries, queries, bias))
        return self._tail(queries, keys, qpe, kpe, bias)

    def forward_rest(
        self, queries: "Tensor[B, Pts, Nq, Hd; T]", keys: "Tensor[B, Pts, Nk, Hd; T]",
        qpe: "Tensor[B, Pts, Nq, Hd; T]", kpe: "Tensor[B, Pts, Nk, Hd; T]", bias: "Tensor[B, Pts, 1, 1, Nq; T]",
    ) -> "(Tensor[B, Pts, Nq, Hd; T], Tensor[B, Pts, Nk, Hd; T])":
        q = queries + qpe
        queries = self.layer_norm1(queries + self.self_attn.masked(q, q, queries, bias))
        return self._tail(queries, keys, qpe, kpe, bias)

    def _tail(
        self, queries: "Tensor[B, Pts, Nq, Hd; T]", keys: "Tensor[B, Pts, Nk, Hd; T]",
        qpe: "Tensor[B, Pts, Nq, Hd; T]", kpe: "Tensor[B, Pts, Nk, Hd; T]", bias: "Tensor[B, Pts, 1, 1, Nq; T]",
    ) -> "(Tensor[B, Pts, Nq, Hd; T], Tensor[B, Pts, Nk, Hd; T])":
        def image_to_token(q, k, v):  # a padding token is no key of the image's attention either
            return self.cross_attn_image_to_token.masked(q, k, v, bias)

        return sam_parts.two_way_tail(self, queries, keys, qpe, kpe, image_to_token)


class TwoWayTransformer(sam_parts.TwoWaySizes):
    T: Float

    layer_0: TwoWayAttentionBlock["Hd, Heads, Inner, T"]
    layer_1: TwoWayAttentionBlock["Hd, Heads, Inner, T"]
    final_attn_token_to_image: MaskAttention["Hd, Hd / 2, Heads, T"]
    layer_norm_final_attn: TokenNorm["Hd, T"]

    def forward(
        self, point_embeddings: "Tensor[B, Pts, Nq, Hd; T]", image_embeddings: "Tensor[B, Pts, Nk, Hd; T]",
        image_pe: "Tensor[B, Pts, Nk, Hd; T]", bias: "Tensor[B, Pts, 1, 1, Nq; T]",
    ) -> "(Tensor[B, Pts, Nq, Hd; T], Tensor[B, Pts, Nk, Hd; T])":
        tokens = point_embeddings
        queries, keys = self.layer_0.forward_first(tokens, image_embeddings, tokens, image_pe, bias)
        queries, keys = self.layer_1.forward_rest(queries, keys, tokens, image_pe, bias)
        attn = self.final_attn_token_to_image(queries + tokens, keys + image_pe, keys)
        return self.layer_norm_final_attn(queries + attn), keys


class MaskDecoder(sam_parts.TwoWaySizes):
    """Object-score, IoU and four mask tokens before the prompt tokens; masks at ``4E x 4E``.

    Returns all four masks with their IoU predictions (sigmoid) and the object-score logit.
    """

    E: Dim
    T: Float
    where = "Hd % 8 == 0, Hd >= 8, E > 0"
    stability_delta: float = 0.05
    stability_thresh: float = 0.98

    obj_score_token: Param["1, Hd; T"]
    iou_token: Param["1, Hd; T"]
    mask_tokens: Param["4, Hd; T"]
    transformer: TwoWayTransformer["Hd, Heads, Inner, T"]
    upscale_conv1: Deconv2x2["Hd, Hd / 4, T"]
    upscale_layer_norm: LayerNormCHW["Hd / 4, T"]
    upscale_conv2: Deconv2x2["Hd / 4, Hd / 8, T"]
    output_hypernetworks_mlps: Array[FeedForward3["Hd, Hd, Hd / 8, T"], "4"]
    iou_prediction_head: FeedForward3["Hd, Hd, 4, T"]
    conv_s0: Conv2d["Hd, Hd / 8, 1, 1, 0, T"]
    conv_s1: Conv2d["Hd, Hd / 4, 1, 1, 0, T"]
    pred_obj_score_head: FeedForward3["Hd, Hd, 1, T"]

    def forward(
        self, image_embeddings: "Tensor[B, Hd, E, E; T]", image_pe: "Tensor[B, Hd, E, E; T]",
        sparse: "Tensor[B, Pts, N, Hd; T]", dense: "Tensor[B, Hd, E, E; T]",
        hr0: "Tensor[B, Hd, 4 * E, 4 * E; T]", hr1: "Tensor[B, Hd, 2 * E, 2 * E; T]",
        bias: "Tensor[B, Pts, 1, 1, 6 + N; T]",
    ) -> "(Tensor[B, Pts, 4, 4 * E, 4 * E; T], Tensor[B, Pts, 4; T], Tensor[B, Pts, 1; T])":
        masks, iou, obj, _ = self.with_tokens(image_embeddings, image_pe, sparse, dense, hr0, hr1, bias)
        return masks, iou, obj

    def with_tokens(
        self, image_embeddings: "Tensor[B, Hd, E, E; T]", image_pe: "Tensor[B, Hd, E, E; T]",
        sparse: "Tensor[B, Pts, N, Hd; T]", dense: "Tensor[B, Hd, E, E; T]",
        hr0: "Tensor[B, Hd, 4 * E, 4 * E; T]", hr1: "Tensor[B, Hd, 2 * E, 2 * E; T]",
        bias: "Tensor[B, Pts, 1, 1, 6 + N; T]",
    ) -> "(Tensor[B, Pts, 4, 4 * E, 4 * E; T], Tensor[B, Pts, 4; T], Tensor[B, Pts, 1; T], Tensor[B, Pts, 4, Hd; T])":
        """``forward``'s answer and the four mask tokens' outputs (the video model's object pointers)."""
        B, Pts, _, _ = sparse.shape
        hd, e = self.Hd, self.E
        out = ops.cat([self.obj_score_token, self.iou_token, self.mask_tokens], dim=0)
        tokens = ops.cat([out.expand(B, Pts, 2 + MASK_TOKENS, hd), sparse], dim=2)

        def per_prompt(t):  # [B, C, H, W] -> [B * Pts, C, H, W]: one copy per prompt of the image
            b, c, h, w = t.shape
            return t.unsqueeze(1).expand(b, Pts, c, h, w).reshape(b * Pts, c, h, w)

        def as_keys(t):  # [B, Hd, E, E] -> [B, Pts, E * E, Hd], row-major: adds and linears run with the grain
            return ops.contiguous(t.flatten(2).transpose(1, 2)).unsqueeze(1).expand(B, Pts, e * e, hd)

        queries, keys = self.transformer(tokens, as_keys(image_embeddings + dense), as_keys(image_pe), bias)

        image = keys.transpose(2, 3).reshape(B * Pts, hd, e, e)
        # the features' projections depend on the image alone: kept while the same features come back
        up = self.upscale_conv1(image) + per_prompt(ops.kept(self.conv_s1, hr1))
        up = ops.gelu_(self.upscale_layer_norm(up))
        up = ops.gelu_(self.upscale_conv2(up) + per_prompt(ops.kept(self.conv_s0, hr0)))
        up = up.reshape(B, Pts, hd // 8, 16 * e * e)
        mlps = self.output_hypernetworks_mlps
        hyper = ops.stack([mlps[i](queries[:, :, 2 + i, :]) for i in range(MASK_TOKENS)], dim=2)
        masks = ops.matmul(hyper, up).reshape(B, Pts, MASK_TOKENS, 4 * e, 4 * e)
        iou = ops.sigmoid(self.iou_prediction_head(queries[:, :, 1, :]))
        return masks, iou, self.pred_obj_score_head(queries[:, :, 0, :]), queries[:, :, 2:2 + MASK_TOKENS, :]

    def select_single(
        self, masks: "Tensor[B, Pts, 4, 4 * E, 4 * E; T]", iou: "Tensor[B, Pts, 4; T]"
    ) -> "(Tensor[B, Pts, 1, 4 * E, 4 * E; T], Tensor[B, Pts, 1; T])":
        """The single-mask answer: mask 0 where it is stable, else the multimask of best predicted IoU.

        Stability is the IoU of the mask thresholded at ``+delta`` and at ``-delta`` (1 when empty).
        """
        B, Pts = masks.shape[0], masks.shape[1]
        side = 4 * self.E
        best = ops.argmax(iou[:, :, 1:], -1)  # [B, Pts], the first best on ties
        best_masks = ops.take_along(masks[:, :, 1:], best.reshape(B, Pts, 1, 1, 1).expand(B, Pts, 1, side, side), 2)
        best_iou = ops.take_along(iou[:, :, 1:], best.reshape(B, Pts, 1), 2)
        single = masks[:, :, 0:1]
        area_i = ops.sum_(ops.cast(ops.gt(single, self.stability_delta), self.T), [3, 4])
        area_u = ops.sum_(ops.cast(ops.gt(single, -self.stability_delta), self.T), [3, 4])
        stability = ops.where(ops.gt(area_u, 0), area_i / area_u, 1.0)  # [B, Pts, 1]
        stable = ops.ge(stability, self.stability_thresh)
        chosen = ops.where(stable.reshape(B, Pts, 1, 1, 1), single, best_masks)
        return chosen, ops.where(stable, iou[:, :, 0:1], best_iou)


# ------------------------------------------------------------------------------------------ model


class Model(HieraSizes):
    """SAM 2.1's image path: ``encode_image`` once per image, then a decode per prompt.

    Points and boxes are in pixels of the ``16 E x 16 E`` model input. Point labels: 1 foreground,
    0 background, 2 and 3 box corners, -1 not a point, -10 padding (ignored).
    """

    Hd: Dim
    MaskHeads: Dim
    MaskInner: Dim
    T: Float = f32
    where = "MaskHeads > 0, Hd % MaskHeads == 0, (Hd / 2) % MaskHeads == 0, Hd % 8 == 0, Hd % 2 == 0, Hd >= 8"
    imports = ("std.nn.conv", "std.nn.linear")

    backbone: Hiera["E, Bg, D0, D1, D2, D3, Heads0, Heads1, Heads2, Heads3, Win0, Win1, Win2, Win3, "
                    "Pad0, Pad1, Pad2, Pad3, T"]
    neck: FpnNeck["D0, D1, D2, D3, Hd, E, T"]
    no_memory_embedding: Param["1, 1, Hd; T"]
    positional_embedding: Param["2, Hd / 2; T"]
    prompt_positional_embedding: Param["2, Hd / 2; T"]
    point_embed: Param["4, Hd; T"]
    not_a_point_embed: Param["1, Hd; T"]
    no_mask_embed: Param["1, Hd; T"]
    mask_decoder: MaskDecoder["Hd, MaskHeads, MaskInner, E, T"]

    @entry
    def encode_image(self, pixel_values: "Tensor[B, 3, 16 * E, 16 * E; T]") -> (
        "(Tensor[B, Hd, E, E; T], Tensor[B, Hd, 4 * E, 4 * E; T], Tensor[B, Hd, 2 * E, 2 * E; T])"
    ):
        """The image embedding (no-memory embedding added) and the 1/4 and 1/8 features before
        ``conv_s0`` / ``conv_s1``, from normalised pixels."""
        x0, x1, x2, x3 = self.backbone(pixel_values)
        embedding, hr0, hr1 = self.neck(x0, x1, x2, x3)
        return embedding + self.no_memory_embedding.reshape(1, self.Hd, 1, 1), hr0, hr1

    @entry
    def decode_tokens(
        self, image_embeddings: "Tensor[B, Hd, E, E; T]", image_pe: "Tensor[B, Hd, E, E; T]",
        sparse: "Tensor[B, Pts, N, Hd; T]", dense: "Tensor[B, Hd, E, E; T]",
        hr0: "Tensor[B, Hd, 4 * E, 4 * E; T]", hr1: "Tensor[B, Hd, 2 * E, 2 * E; T]",
    ) -> "(Tensor[B, Pts, 3, 4 * E, 4 * E; T], Tensor[B, Pts, 3; T], Tensor[B, Pts, 1; T])":
        """The edge decoder: composed prompt tokens in, the three multimask logits, their IoU
        predictions and the object-score logit out.

        A not-a-point token directly after another one is padding: its key gets a -1e9 bias in every
        attention, so padding a prompt up to ``N`` tokens never changes the result.
        """
        B, Pts, N, _ = sparse.shape
        nap = ops.cast(ops.eq(ops.sum_(ops.abs_(sparse - self.not_a_point_embed), -1), 0.0), self.T)
        padding = nap * ops.pad(nap, [1, 0])[:, :, :N]  # [B, Pts, N]: 1 where it and the one before are
        bias = ops.pad(padding * NOT_A_POINT_BIAS, [2 + MASK_TOKENS, 0]).reshape(B, Pts, 1, 1, 2 + MASK_TOKENS + N)
        masks, iou, obj = self.mask_decoder(image_embeddings, image_pe, sparse, dense, hr0, hr1, bias)
        return masks[:, :, 1:], iou[:, :, 1:], obj

    @entry
    def decode_points(
        self, image_embeddings: "Tensor[B, Hd, E, E; T]", hr0: "Tensor[B, Hd, 4 * E, 4 * E; T]",
        hr1: "Tensor[B, Hd, 2 * E, 2 * E; T]", input_points: "Tensor[B, Pts, N, 2; T]",
        input_labels: "Tensor[B, Pts, N; i32]",
    ) -> "(Tensor[B, Pts, 4, 4 * E, 4 * E; T], Tensor[B, Pts, 4; T], Tensor[B, Pts, 1; T])":
        """All four masks (single-mask first), their IoU predictions and the object-score logit for
        ``Pts`` prompts of ``N`` labelled points each."""
        return self._decode(image_embeddings, hr0, hr1, self._point_tokens(input_points, input_labels))

    @entry
    def decode_boxes(
        self, image_embeddings: "Tensor[B, Hd, E, E; T]", hr0: "Tensor[B, Hd, 4 * E, 4 * E; T]",
        hr1: "Tensor[B, Hd, 2 * E, 2 * E; T]", input_boxes: "Tensor[B, Nb, 4; T]",
    ) -> "(Tensor[B, Nb, 4, 4 * E, 4 * E; T], Tensor[B, Nb, 4; T], Tensor[B, Nb, 1; T])":
        """All four masks, IoU predictions and object-score logits for ``Nb`` boxes ``(x1, y1, x2, y2)``."""
        B, Nb, _ = input_boxes.shape
        corners = ((input_boxes + 0.5) / ops.dim_like(input_boxes, 16 * self.E)).reshape(B, Nb, 2, 2)
        emb = sam_parts.fourier(corners, self.prompt_positional_embedding) + self.point_embed[2:4]
        nap = self.not_a_point_embed.reshape(1, 1, 1, self.Hd).expand(B, Nb, 1, self.Hd)
        return self._decode(image_embeddings, hr0, hr1, ops.cat([emb, nap], dim=2))

    def select_single(
        self, masks: "Tensor[B, Pts, 4, 4 * E, 4 * E; T]", iou: "Tensor[B, Pts, 4; T]"
    ) -> "(Tensor[B, Pts, 1, 4 * E, 4 * E; T], Tensor[B, Pts, 1; T])":
        """Upstream's ``multimask_output=False``: the dynamic choice by stability (see MaskDecoder)."""
        return self.mask_decoder.select_single(masks, iou)

    def image_positions(self) -> "Tensor[1, Hd, E, E; T]":
        """The Fourier features of every embedding cell's centre (``decode_tokens``' ``image_pe``), a copy of the
        caller's own (the decoders read the one kept for the weights, ``ops.grid_fourier``)."""
        return ops.contiguous(ops.grid_fourier(self.positional_embedding, self.E))

    def dense_prompt(self) -> "Tensor[1, Hd, E, E; T]":
        """The dense prompt without a mask prompt: ``no_mask_embed`` at every cell (``decode_tokens``' ``dense``)."""
        return self.no_mask_embed.reshape(1, self.Hd, 1, 1).expand(1, self.Hd, self.E, self.E)

    def decode_sparse(
        self, image_embeddings: "Tensor[B, Hd, E, E; T]", hr0: "Tensor[B, Hd, 4 * E, 4 * E; T]",
        hr1: "Tensor[B, Hd, 2 * E, 2 * E; T]", sparse: "Tensor[B, Pts, N, Hd; T]",
    ) -> "(Tensor[B, Pts, 4, 4 * E, 4 * E; T], Tensor[B, Pts, 4; T], Tensor[B, Pts, 1; T])":
        """All four masks, IoU predictions and object-score logits for unpadded sparse prompt tokens
        (as upstream's prompt encoder gives them; ``sam2_processing.compose`` with no spare count)."""
        return self._decode(image_embeddings, hr0, hr1, sparse)

    def _decode(self, image_embeddings, hr0, hr1, sparse):
        masks, iou, obj, _ = self._decode_with_tokens(image_embeddings, hr0, hr1, sparse)
        return masks, iou, obj

    def _decode_with_tokens(self, image_embeddings, hr0, hr1, sparse):
        B, Pts, N, hd = sparse.shape
        e = self.E
        dense = self.dense_prompt().expand(B, hd, e, e)
        image_pe = ops.grid_fourier(self.positional_embedding, e).expand(B, hd, e, e)
        n = 2 + MASK_TOKENS + N
        bias = (ops.arange_like(sparse, n) * 0.0).reshape(1, 1, 1, 1, n).expand(B, Pts, 1, 1, n)  # no padding
        return self.mask_decoder.with_tokens(image_embeddings, image_pe, sparse, dense, hr0, hr1, bias)

    def _point_tokens(self, input_points, input_labels):
        """Upstream's prompt-encoder tokens of labelled points (one not-a-point appended)."""
        # as upstream, one "not a point" is appended to every prompt (at the origin, labelled -1)
        points = ops.pad(input_points + 0.5, [0, 0, 0, 1])
        labels = ops.pad(input_labels, [0, 1], value=-1).unsqueeze(-1)
        emb = sam_parts.fourier(points / ops.dim_like(points, 16 * self.E), self.prompt_positional_embedding)
        emb = ops.where(ops.eq(labels, -1), self.not_a_point_embed, emb)
        emb = ops.where(ops.eq(labels, -10), 0.0, emb)
        for k in range(4):
            emb = ops.where(ops.eq(labels, k), emb + self.point_embed[k], emb)
        return emb



def hiera_layout(blocks_per_stage: list[int] | tuple[int, ...], global_blocks: list[int] | tuple[int, ...],
                 ) -> dict[str, Any]:
    """Hiera's ``layout`` from the config's ``blocks_per_stage`` and ``global_attention_blocks``: the
    kind of every block after the pooling layer that opens stages 1-3."""
    depths = [int(d) for d in blocks_per_stage]
    if len(depths) != 4 or min(depths) < 1:
        raise ValueError(f"SAM 2 needs four Hiera stages of at least one block, blocks_per_stage={depths}")
    glob = {int(g) for g in global_blocks}
    if any(not 0 <= g < sum(depths) for g in glob):
        raise ValueError(f"SAM 2 global_attention_blocks={sorted(glob)} names blocks outside the "
                         f"{sum(depths)} of blocks_per_stage={depths}")
    pools = {sum(depths[:s]) for s in (1, 2, 3)}
    if glob & pools:
        raise ValueError(f"SAM 2 global_attention_blocks={sorted(glob)} makes pooling block(s) "
                         f"{sorted(glob & pools)} global (the first block of stages 1-3), which upstream cannot run")
    kinds = ["global" if i in glob else "windowed" for i in range(sum(depths))]
    out: dict[str, Any] = {}
    for s, n in enumerate(depths):
        stage, kinds = kinds[:n], kinds[n:]
        out[f"stage_{s}"] = tuple(stage[1:] if s else stage)
    return out


def model_for(layout: dict[str, Any]) -> type[Block]:
    """The ``Model`` whose backbone is laid out as ``layout`` (see :func:`hiera_layout`)."""
    return variant(Model, subs={"backbone": variant(Hiera, layout=layout)})
