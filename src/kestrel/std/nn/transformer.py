"""``std.nn.transformer``: the parts every ViT-like encoder shares, written once.

Model files inherit them under their own names (``class Attention(SelfAttention)`` in ``vit``
prints as ``vit::Attention``), so each family's listing stays its own while the code lives here.
"""

from ...blocks import Block, Dim, Float, Param
from .. import ops
from .linear import Linear


class MultiHead(Block, abstract=True):
    """The width ``D`` split into ``Heads`` heads: the generics every multi-head block opens with."""

    D: Dim
    Heads: Dim
    where = "Heads > 0, D % Heads == 0"


def split_heads(t, heads):
    """``[B, N, D]`` -> ``[B, heads, N, D / heads]``: each head's slice of the width, as attention takes it."""
    B, N, D = t.shape
    return t.reshape(B, N, heads, D // heads).transpose(1, 2)


class LayerNorm(Block, module="std.nn.transformer"):
    """Layer norm over the last axis; ``eps`` is a setting (the config's ``layer_norm_eps``)."""

    D: Dim
    T: Float
    eps: float = 1e-6

    weight: Param["D; T"]
    bias: Param["D; T"]

    def forward(self, x: "Tensor[*S, D; T]") -> "Tensor[*S, D; T]":
        return ops.layer_norm(x, self.weight, self.bias, self.eps)


class SelfAttention(MultiHead, module="std.nn.transformer"):
    """Multi-head self-attention with separate query, key and value projections."""

    T: Float

    query: Linear["D, D, T"]
    key: Linear["D, D, T"]
    value: Linear["D, D, T"]
    out: Linear["D, D, T"]

    def forward(self, x: "Tensor[B, N, D; T]") -> "Tensor[B, N, D; T]":
        return attend(self, x)


def attend(attn: SelfAttention, x, token: int | None = None):
    """Self-attention over ``x``; with ``token``, that token's output alone (``[B, 1, D]``, every token still a
    key and a value): what a head that reads one token needs of the last layer. That one query is a
    ``projected_attention``, which eager inference may fold into the query's side (no key or value projection
    of every token)."""
    B = x.shape[0]
    qkv = (attn.query, attn.key, attn.value)
    if token is not None:
        projections = [(p.weight, p.bias) for p in (*qkv, attn.out)]
        return ops.projected_attention(x[:, token].unsqueeze(1), x, x, attn.Heads, projections)
    q, k, v = ops.fused_linear(x, [p.weight for p in qkv], [p.bias for p in qkv])  # one GEMM: one shared buffer
    y = ops.attention(split_heads(q, attn.Heads), split_heads(k, attn.Heads), split_heads(v, attn.Heads))
    return attn.out(y.transpose(1, 2).reshape(B, q.shape[1], attn.D))


class ClassTokenEncoder(Block, abstract=True):
    """A ViT's image side as ViT and DINOv2 declare it: ``Patch x Patch`` patches embedded by a
    strided convolution, a class token in front, learnt positions. A subclass adds its ``layers``
    and final ``norm``, and binds :func:`class_token_features` and :func:`embed_patches` as its
    functions (its entry and ``_embed``), so each keeps its own order of functions in its listing."""

    Height: Dim
    Width: Dim
    Channels: Dim
    Patch: Dim
    D: Dim
    Heads: Dim
    where = "Patch > 0, Heads > 0, D % Heads == 0, Height >= Patch, Width >= Patch, D > 0, Channels > 0"
    imports = ("std.nn.linear", "std.nn.norm")

    patch_weight: Param["D, Channels, Patch, Patch; T"]
    patch_bias: Param["D; T"]
    class_token: Param["1, 1, D; T"]
    positions: Param["1, 1 + (Height / Patch) * (Width / Patch), D; T"]


def class_token_features(
    self, image: "Tensor[B, Channels, Height, Width; T]"
) -> "Tensor[B, 1 + (Height / Patch) * (Width / Patch), D; T]":
    """The final normed tokens: the class token, then one per patch."""
    x = self._tokens(image)
    for layer in self.layers:
        x = layer(x)
    return self.norm(x)


def class_token_output(self, image: "Tensor[B, Channels, Height, Width; T]") -> "Tensor[B, D; T]":
    """The final normed class token alone, ``features(image)[:, 0]``: the last layer runs its queries,
    projections and MLP for the class token only (every token is still its keys and values)."""
    x = self._tokens(image)
    for layer in self.layers[:-1]:
        x = layer(x)
    return self.norm(self.layers[-1].first_token(x))


def class_and_patch_tokens(
    self, image: "Tensor[B, Channels, Height, Width; T]"
) -> "Tensor[B, 1 + (Height / Patch) * (Width / Patch), D; T]":
    """The tokens the first layer reads: the class token, then the embedded patches, positions added."""
    x = self._embed(image)
    cls = self.class_token.expand(x.shape[0], -1, -1)
    return ops.cat([cls, x], dim=1) + self.positions


def embed_patches(
    self, image: "Tensor[B, Channels, Height, Width; T]"
) -> "Tensor[B, (Height / Patch) * (Width / Patch), D; T]":
    x = ops.conv2d(image, self.patch_weight, self.patch_bias, stride=self.Patch)
    return x.flatten(2).transpose(1, 2)
