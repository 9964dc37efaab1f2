"""DINOv2 (Oquab et al., 2023): a ViT trained self-supervised, with LayerScale on each residual.

``forward`` gives the normed class token followed by one token per patch. The model is bound at
one image size (``Height`` x ``Width``); the checkpoint's position table is resampled to that grid
once, at load time, exactly as the reference resamples it on every call.
"""

from ..blocks import Array, Block, Dim, Float, Param, entry, f32
from ..std import ops
from ..std.nn import Linear, transformer


class LayerNorm(transformer.LayerNorm):
    pass


class LayerScale(Block):
    """A learnt per-channel gain on a residual branch. The layers apply it and the residual's add in one pass,
    ``ops.addcmul(x, branch, lambda1)``; ``forward`` is the gain alone."""

    D: Dim
    T: Float

    lambda1: Param["D; T"]

    def forward(self, x: "Tensor[*S, D; T]") -> "Tensor[*S, D; T]":
        return x * self.lambda1


class Attention(transformer.SelfAttention):
    pass


class _ScaledLayer(transformer.MultiHead, abstract=True):
    """What both DINOv2 layers share: the attention branch with its LayerScale, and the MLP's norm;
    each layer adds its MLP width, its MLP, the second LayerScale and ``T``."""


    norm1: LayerNorm["D, T"]
    attention: Attention["D, Heads, T"]
    layer_scale1: LayerScale["D, T"]
    norm2: LayerNorm["D, T"]


class EncoderLayer(_ScaledLayer):
    Inner: Dim
    T: Float

    up: Linear["D, Inner, T"]
    down: Linear["Inner, D, T"]
    layer_scale2: LayerScale["D, T"]

    def forward(self, x: "Tensor[B, N, D; T]") -> "Tensor[B, N, D; T]":
        x = ops.addcmul(x, self.attention(self.norm1(x)), self.layer_scale1.lambda1)
        return ops.addcmul(x, self.down(ops.gelu_(self.up(self.norm2(x)))), self.layer_scale2.lambda1)


class _Root(transformer.ClassTokenEncoder, abstract=True):
    """What both DINOv2 roots share: ViT's image side and its tokens as the forward; each root adds
    its MLP width, its layers and ``T``."""

    forward = entry(transformer.class_token_features)
    _tokens = transformer.class_and_patch_tokens
    _embed = transformer.embed_patches


class Model(_Root):
    Inner: Dim
    Layers: Dim
    T: Float = f32

    layers: Array[EncoderLayer["D, Heads, Inner, T"], "Layers"]
    norm: LayerNorm["D, T"]


# DINOv2-giant replaces the GELU MLP with SwiGLU. Its blocks live in their own kestrel module so
# the listing of the other sizes stays the seed's.


class SwiGluMlp(Block, module="dinov2.swiglu"):
    """``down(silu(gate(x)) * up(x))``, gate and up fused in one projection (gate first)."""

    D: Dim
    Hidden: Dim
    T: Float

    weights_in: Linear["D, 2 * Hidden, T"]
    weights_out: Linear["Hidden, D, T"]

    def forward(self, x: "Tensor[*S, D; T]") -> "Tensor[*S, D; T]":
        gate, up = ops.split(self.weights_in(x), [self.Hidden, self.Hidden], dim=-1)
        return self.weights_out(ops.silu(gate) * up)


class SwiGluEncoderLayer(_ScaledLayer, module="dinov2.swiglu"):
    Hidden: Dim
    T: Float

    mlp: SwiGluMlp["D, Hidden, T"]
    layer_scale2: LayerScale["D, T"]

    def forward(self, x: "Tensor[B, N, D; T]") -> "Tensor[B, N, D; T]":
        x = ops.addcmul(x, self.attention(self.norm1(x)), self.layer_scale1.lambda1)
        return ops.addcmul(x, self.mlp(self.norm2(x)), self.layer_scale2.lambda1)


class SwiGluModel(_Root, module="dinov2.swiglu"):
    """DINOv2 with SwiGLU layers (giant); otherwise as :class:`Model`."""

    Hidden: Dim
    Layers: Dim
    T: Float = f32

    layers: Array[SwiGluEncoderLayer["D, Heads, Hidden, T"], "Layers"]
    norm: LayerNorm["D, T"]
