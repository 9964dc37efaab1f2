"""The standard ops: each a torch kernel (what runs) and a shape rule (what the checker proves).

Kernels are thin calls of torch, so eager speed is torch's and ``torch.compile``/``torch.export``
see plain aten ops. Rules compute the result type from the argument types and raise
:class:`~kestrel.checker.symbolic.ShapeError` naming both shapes when they do not fit; the words
they prove with live in :mod:`kestrel.checker.rules`. The ops live by kind in this package's
modules (elementwise, linalg, conv, norm, attention, layout, index, reduce), each rule beside its
kernel; this module re-exports them all, so model code writes ``ops.linear``.
"""

from __future__ import annotations

from ...checker.rules import (
    axis,
    broadcast_dims,
    float_dtype,
    kind_of,
    last_dim,
    like,
    nonneg,
    numeric_dtype,
    positive,
    same,
    same_dtype,
    scalar_fits,
)
from . import methods as _methods  # noqa: F401  (registers the tensor methods)
from .attention import FEW_KEY_COLUMNS, attention, multihead_attention, projected_attention, qkv_dims
from .conv import conv1d, conv2d, conv_transpose2x2, depthwise_conv2d, interpolate, max_pool2d
from .elementwise import (
    abs_,
    add,
    addcmul,
    cast,
    cos,
    div,
    eq,
    exp,
    ge,
    gelu,
    gelu_,
    gt,
    mul,
    relu,
    sigmoid,
    silu,
    sin,
    sub,
    tanh,
    where,
)
from .index import arange_like, dim_like, embedding, gather, getitem, grid_fourier, relative_positions, take_along
from .layout import (
    cat,
    contiguous,
    expand,
    flatten,
    pad,
    permute,
    repeat,
    reshape,
    split,
    squeeze,
    stack,
    transpose,
    unsqueeze,
    view,
)
from .linalg import bmm, fused_linear, linear, linear_gelu, matmul
from .norm import l2_normalize, layer_norm, layer_norm_chw, rms_norm, softmax
from .reduce import amax, argmax, mean, sum_
from .reuse import kept

_t = like  # the name std/ops_attention.py imports

__all__ = [
    "FEW_KEY_COLUMNS", "abs_", "add", "addcmul", "amax", "arange_like", "argmax", "attention", "axis", "bmm",
    "broadcast_dims", "cast", "cat", "contiguous", "conv1d", "conv2d", "conv_transpose2x2", "cos",
    "depthwise_conv2d", "dim_like",
    "div", "embedding", "eq", "exp", "expand", "flatten", "float_dtype", "fused_linear", "gather", "ge", "gelu",
    "gelu_", "getitem", "grid_fourier", "gt", "interpolate", "kept", "kind_of", "l2_normalize", "last_dim",
    "layer_norm",
    "layer_norm_chw", "like", "linear", "linear_gelu", "matmul", "max_pool2d", "mean", "mul", "multihead_attention",
    "nonneg", "numeric_dtype", "pad", "permute", "positive", "projected_attention",
    "qkv_dims", "relative_positions", "relu", "repeat",
    "reshape", "rms_norm", "same", "same_dtype", "scalar_fits", "sigmoid", "silu", "sin", "softmax", "split", "squeeze",
    "stack", "sub", "sum_", "take_along", "tanh", "transpose", "unsqueeze", "view", "where",
]
