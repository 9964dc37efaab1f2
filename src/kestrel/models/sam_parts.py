"""The parts SAM and SAM 2 share, written once; each model inherits them under its own name.

``sam.FeedForward3`` and ``sam2.FeedForward3`` are both ``class FeedForward3(sam_parts.FeedForward3)``:
the listing of each program names its own module, the declarations and bodies live here.
"""

from ..blocks import Block, Dim, Float, Param
from ..std import ops
from ..std.nn import Linear


class LayerNormCHW(Block):
    """Layer norm over the channels of a channels-first map (the neck and the mask upscaling path)."""

    C: Dim
    T: Float
    eps = 1e-6  # fixed upstream, whatever the config says

    weight: Param["C; T"]
    bias: Param["C; T"]

    def forward(self, x: "Tensor[B, C, H, W; T]") -> "Tensor[B, C, H, W; T]":
        return ops.layer_norm_chw(x, self.weight, self.bias, self.eps)


class FeedForward3(Block):
    """Three linear layers with ReLU between them (hypernetworks, IoU and object-score heads)."""

    In: Dim
    Hidden: Dim
    Out: Dim
    T: Float

    proj_in: Linear["In, Hidden, T"]
    hidden: Linear["Hidden, Hidden, T"]
    proj_out: Linear["Hidden, Out, T"]

    def forward(self, x: "Tensor[*S, In; T]") -> "Tensor[*S, Out; T]":
        return self.proj_out(ops.relu(self.hidden(ops.relu(self.proj_in(x)))))


class Deconv2x2(Block):
    """A stride-2 transposed 2 x 2 convolution: each pixel becomes a 2 x 2 block."""

    Cin: Dim
    Cout: Dim
    T: Float
    where = "Cin > 0, Cout > 0"

    weight: Param["Cin, Cout, 2, 2; T"]
    bias: Param["Cout; T"]

    def forward(self, x: "Tensor[B, Cin, H, W; T]") -> "Tensor[B, Cout, 2 * H, 2 * W; T]":
        return ops.conv_transpose2x2(x, self.weight, self.bias)
