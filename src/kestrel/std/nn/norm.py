"""``std.nn.norm``: RMS norm."""

from ...blocks import Block, Dim, Float, Param, bf16
from .. import ops


class RmsNorm(Block, module="std.nn.norm"):
    H: Dim
    T: Float = bf16
    eps = 1e-6

    weight: Param["H; T"]

    def forward(self, x: "Tensor[*S, H; T]") -> "Tensor[*S, H; T]":
        return ops.rms_norm(x, self.weight, self.eps)
