"""``std.nn.linear``: the affine map over the last axis."""

from ...blocks import Block, Dim, Float, Param, bf16, optional
from .. import ops


class Linear(Block, module="std.nn.linear"):
    """``y = x W^T + b`` over the last axis of any leading shape."""

    In: Dim
    Out: Dim
    T: Float = bf16

    weight: Param["Out, In; T"]
    bias: Param["Out; T", optional]

    def forward(self, x: "Tensor[*S, In; T]") -> "Tensor[*S, Out; T]":
        return ops.linear(x, self.weight, self.bias)
