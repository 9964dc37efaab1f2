"""``std.nn.transformer``: the parts every ViT-like encoder shares, written once.

Model files inherit them under their own names (``class Attention(SelfAttention)`` in ``vit``
prints as ``vit::Attention``), so each family's listing stays its own while the code lives here.
"""

from ...blocks import Block, Dim, Float, Param
from .. import ops
from .linear import Linear


class LayerNorm(Block, module="std.nn.transformer"):
    """Layer norm over the last axis; ``eps`` is a setting (the config's ``layer_norm_eps``)."""

    D: Dim
    T: Float
    eps: float = 1e-6

    weight: Param["D; T"]
    bias: Param["D; T"]

    def forward(self, x: "Tensor[*S, D; T]") -> "Tensor[*S, D; T]":
        return ops.layer_norm(x, self.weight, self.bias, self.eps)


class SelfAttention(Block, module="std.nn.transformer"):
    """Multi-head self-attention with separate query, key and value projections."""

    D: Dim
    Heads: Dim
    T: Float
    where = "Heads > 0, D % Heads == 0"

    query: Linear["D, D, T"]
    key: Linear["D, D, T"]
    value: Linear["D, D, T"]
    out: Linear["D, D, T"]

    def forward(self, x: "Tensor[B, N, D; T]") -> "Tensor[B, N, D; T]":
        B, N, _ = x.shape

        def heads(t):
            return t.reshape(B, N, self.Heads, self.D // self.Heads).transpose(1, 2)

        qkv = (self.query, self.key, self.value)  # one GEMM: the three weights share one buffer
        q, k, v = ops.fused_linear(x, [p.weight for p in qkv], [p.bias for p in qkv])
        y = ops.attention(heads(q), heads(k), heads(v))
        return self.out(y.transpose(1, 2).reshape(B, N, self.D))
