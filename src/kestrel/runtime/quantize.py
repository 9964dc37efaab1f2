"""Opt-in int8 dynamic quantisation of a loaded model's GEMMs on weights (``load(..., quantize="int8")``).

The weight of each ``std.nn.Linear`` and of each transposed 2 x 2 convolution (SAM's and SAM 2.1's mask
upscaling, a GEMM over pixels) is marked for :func:`kestrel.kernels.gemm.mark_int8`: quantised per
output channel at its first call, activations quantised per call. Parameters are not replaced (the
state_dict stays f32 and exact); only eager CPU calls take the int8 path. Not exact: see the README's
accuracy table (``bench/accuracy.py``).
"""

from __future__ import annotations

from ..blocks import Block
from ..errors import UsageError
from ..kernels import gemm
from ..models.sam_parts import Deconv2x2
from ..std.nn.linear import Linear

# the blocks whose product with their ``weight`` is one GEMM on the eager path
INT8_BLOCKS = (Linear, Deconv2x2)


class QuantizeError(UsageError):
    """int8 asked for where this torch build cannot run it."""


def quantize_int8(model: Block) -> int:
    """Mark the weight of every block in INT8_BLOCKS for int8; returns how many."""
    if not gemm.int8_available():
        raise QuantizeError("this torch build has no quantized CPU engine: int8 is unavailable here")
    n = 0
    for module in model.modules():
        if isinstance(module, INT8_BLOCKS):
            gemm.mark_int8(module.weight)
            n += 1
    model.quantized = "int8"  # type: ignore[assignment]
    return n
