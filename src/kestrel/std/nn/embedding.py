"""``std.nn.embedding``: a lookup table."""

from ...blocks import Block, Dim, Float, Param, bf16
from .. import ops


class Embedding(Block, module="std.nn.embedding"):
    Vocab: Dim
    H: Dim
    T: Float = bf16

    weight: Param["Vocab, H; T"]

    def forward(self, ids: "Tensor[*S; i32]") -> "Tensor[*S, H; T]":
        return ops.embedding(ids, self.weight)
