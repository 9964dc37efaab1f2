"""Machine-facing speed, at the bottom of Kestrel: it imports torch and :mod:`kestrel.errors` only.

    settings     every environment variable Kestrel reads
    library      the GEMM paths installed here (torch, oneDNN, oneDNN and MKL packed) and weight packing
    gemm         the per-shape GEMM choice, fused projections, a linear with its GELU, the 2 x 2 transposed
                 convolution, int8
    attention    plain attention by measured choice (fused or two GEMMs); decomposed relative positions in
                 calibrated slices
    folded_attention  multi-head attention with its projections folded into the side with few tokens (SAM's
                 mask decoders), by measured choice
    activations  GELU in place on any dense layout; the tanh GELU in cache-sized steps
    norms        the channel layer norm of a channels-last map, fused
    layout       a transposed token map copied row-major in cache-sized slabs
    positions    positional encodings that are constants of a weight (a grid's Fourier features), kept
    calibration  the per-machine tables of measured choices, and the recorder that observes them
    weights      the one cache of what kernels derive from weights, with one invalidation rule
    allocator    glibc's allocator thresholds: freed activations stay in the process
    pages        handing back the file pages of checkpoint data nothing reads

``std`` ops call the functions re-exported here; the runtime applies the memory settings.
"""

from __future__ import annotations

from .activations import gelu_, gelu_tanh_
from .attention import sdpa
from .gemm import conv_transpose2x2, fused_linear, linear, linear_gelu
from .layout import contiguous
from .library import eager_ok, plain_inference
from .norms import layer_norm_chw
from .positions import grid_fourier
from .reuse import kept_for_input

__all__ = ["contiguous", "conv_transpose2x2", "eager_ok", "fused_linear", "gelu_", "gelu_tanh_", "grid_fourier",
           "kept_for_input", "layer_norm_chw", "linear", "linear_gelu", "plain_inference", "sdpa"]
