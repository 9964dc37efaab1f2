"""ViT image classifier (Dosovitskiy et al., 2020), as ``google/vit-base-patch16-224`` ships it.

Patches are embedded by a stride-``Patch`` convolution, a class token is prepended, learnt
positions added, then ``Layers`` pre-norm encoder layers; the head reads the class token.
"""

from ..blocks import Array, Block, Dim, Float, Param, entry, f32
from ..std import ops
from ..std.nn import Linear, transformer


class LayerNorm(transformer.LayerNorm):
    eps: float = 1e-12


class Attention(transformer.SelfAttention):
    """Multi-head self-attention with separate query, key and value projections."""


class EncoderLayer(Block):
    """Pre-norm transformer layer: attention then a GELU MLP, each with a residual."""

    D: Dim
    Heads: Dim
    Inner: Dim
    T: Float
    where = "Heads > 0, D % Heads == 0"

    norm_before: LayerNorm["D, T"]
    attention: Attention["D, Heads, T"]
    norm_after: LayerNorm["D, T"]
    up: Linear["D, Inner, T"]
    down: Linear["Inner, D, T"]

    def forward(self, x: "Tensor[B, N, D; T]") -> "Tensor[B, N, D; T]":
        x = x + self.attention(self.norm_before(x))
        return x + self.down(ops.gelu_(self.up(self.norm_after(x))))


class Model(Block):
    """The classifier: image to class logits (``forward``), or to token features (``features``)."""

    Height: Dim
    Width: Dim
    Channels: Dim
    Patch: Dim
    D: Dim
    Heads: Dim
    Inner: Dim
    Layers: Dim
    Classes: Dim
    T: Float = f32
    where = "Patch > 0, Heads > 0, D % Heads == 0, Height >= Patch, Width >= Patch, D > 0, Channels > 0"
    imports = ("std.nn.linear", "std.nn.norm")

    patch_weight: Param["D, Channels, Patch, Patch; T"]
    patch_bias: Param["D; T"]
    class_token: Param["1, 1, D; T"]
    positions: Param["1, 1 + (Height / Patch) * (Width / Patch), D; T"]
    layers: Array[EncoderLayer["D, Heads, Inner, T"], "Layers"]
    norm: LayerNorm["D, T"]
    head: Linear["D, Classes, T"]

    @entry
    def forward(self, image: "Tensor[B, Channels, Height, Width; T]") -> "Tensor[B, Classes; T]":
        return self.head(self.features(image)[:, 0])

    @entry
    def features(
        self, image: "Tensor[B, Channels, Height, Width; T]"
    ) -> "Tensor[B, 1 + (Height / Patch) * (Width / Patch), D; T]":
        """The final normed tokens: the class token, then one per patch."""
        x = self._embed(image)
        cls = self.class_token.expand(x.shape[0], -1, -1)
        x = ops.cat([cls, x], dim=1) + self.positions
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)

    def _embed(
        self, image: "Tensor[B, Channels, Height, Width; T]"
    ) -> "Tensor[B, (Height / Patch) * (Width / Patch), D; T]":
        x = ops.conv2d(image, self.patch_weight, self.patch_bias, stride=self.Patch)
        return x.flatten(2).transpose(1, 2)
