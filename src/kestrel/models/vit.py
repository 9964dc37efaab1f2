"""ViT image classifier (Dosovitskiy et al., 2020), as ``google/vit-base-patch16-224`` ships it.

Patches are embedded by a stride-``Patch`` convolution, a class token is prepended, learnt
positions added, then ``Layers`` pre-norm encoder layers; the head reads the class token.
"""

from ..blocks import Array, Dim, Float, entry, f32
from ..std import ops
from ..std.nn import Linear, transformer


class LayerNorm(transformer.LayerNorm):
    eps: float = 1e-12


class Attention(transformer.SelfAttention):
    """Multi-head self-attention with separate query, key and value projections."""

    def first_query(self, x: "Tensor[B, N, D; T]") -> "Tensor[B, 1, D; T]":
        """``forward(x)[:, :1]``: the class token's output alone, every token still a key and a value."""
        return transformer.attend(self, x, 0)


class EncoderLayer(transformer.MultiHead):
    """Pre-norm transformer layer: attention then a GELU MLP, each with a residual."""

    Inner: Dim
    T: Float

    norm_before: LayerNorm["D, T"]
    attention: Attention["D, Heads, T"]
    norm_after: LayerNorm["D, T"]
    up: Linear["D, Inner, T"]
    down: Linear["Inner, D, T"]

    def forward(self, x: "Tensor[B, N, D; T]") -> "Tensor[B, N, D; T]":
        x = x + self.attention(self.norm_before(x))
        return x + self.down(ops.gelu_(self.up(self.norm_after(x))))

    def first_token(self, x: "Tensor[B, N, D; T]") -> "Tensor[B, D; T]":
        """``forward(x)[:, 0]``, the rest of the tokens left out after the attention."""
        x = x[:, :1] + self.attention.first_query(self.norm_before(x))
        return (x + self.down(ops.gelu_(self.up(self.norm_after(x)))))[:, 0]


class Model(transformer.ClassTokenEncoder):
    """The classifier: image to class logits (``forward``), or to token features (``features``)."""

    Inner: Dim
    Layers: Dim
    Classes: Dim
    T: Float = f32
    where = "Layers > 0"  # forward runs the last layer for the class token alone

    layers: Array[EncoderLayer["D, Heads, Inner, T"], "Layers"]
    norm: LayerNorm["D, T"]
    head: Linear["D, Classes, T"]

    @entry
    def forward(self, image: "Tensor[B, Channels, Height, Width; T]") -> "Tensor[B, Classes; T]":
        return self.head(self._class_token(image))

    features = entry(transformer.class_token_features)
    _class_token = transformer.class_token_output
    _tokens = transformer.class_and_patch_tokens
    _embed = transformer.embed_patches
