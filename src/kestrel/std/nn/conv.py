"""``std.nn.conv``: convolutions with square and rectangular kernels."""

from ...blocks import Block, Dim, Float, Param, f32, optional
from .. import ops


class _SquareConv(Block, abstract=True):
    """The generics, weight and optional bias of a convolution with one kernel size, stride and
    padding for every spatial axis; each subclass adds its kernel's axes and its forward."""

    Cin: Dim
    Cout: Dim
    K: Dim
    Stride: Dim
    Pad: Dim
    T: Float = f32
    where = "Stride > 0, K > 0, Cin > 0, Cout > 0"

    weight: Param["Cout, Cin, K; T"]
    bias: Param["Cout; T", optional]


class Conv1d(_SquareConv, module="std.nn.conv"):
    where = "L + 2 * Pad >= K"

    def forward(self, x: "Tensor[B, Cin, L; T]") -> "Tensor[B, Cout, (L + 2 * Pad - K) / Stride + 1; T]":
        return ops.conv1d(x, self.weight, self.bias, stride=self.Stride, padding=self.Pad)


class Conv2d(_SquareConv, module="std.nn.conv"):
    where = "H + 2 * Pad >= K, W + 2 * Pad >= K"

    weight: Param["Cout, Cin, K, K; T"]

    def forward(
        self, x: "Tensor[B, Cin, H, W; T]"
    ) -> "Tensor[B, Cout, (H + 2 * Pad - K) / Stride + 1, (W + 2 * Pad - K) / Stride + 1; T]":
        return ops.conv2d(x, self.weight, self.bias, stride=self.Stride, padding=self.Pad)


class Conv2dRect(Block, module="std.nn.conv"):
    Cin: Dim
    Cout: Dim
    KH: Dim
    KW: Dim
    StrideH: Dim
    StrideW: Dim
    PadH: Dim
    PadW: Dim
    T: Float = f32
    where = "StrideH > 0, StrideW > 0, KH > 0, KW > 0, Cin > 0, Cout > 0, H + 2 * PadH >= KH, W + 2 * PadW >= KW"

    weight: Param["Cout, Cin, KH, KW; T"]
    bias: Param["Cout; T", optional]

    def forward(
        self, x: "Tensor[B, Cin, H, W; T]"
    ) -> "Tensor[B, Cout, (H + 2 * PadH - KH) / StrideH + 1, (W + 2 * PadW - KW) / StrideW + 1; T]":
        return ops.conv2d(x, self.weight, self.bias, stride=(self.StrideH, self.StrideW),
                          padding=(self.PadH, self.PadW))
