"""Tensor methods under the checker (``x.reshape``, ``x + y``, ``x[:, 0]``): each dispatches to its std op."""

from __future__ import annotations

from ...checker.symbolic import METHODS, SymTensor
from ...types.dtypes import f32
from .elementwise import add, cast, cos, div, exp, mul, relu, sigmoid, sin, sub, tanh
from .index import getitem
from .layout import expand, flatten, permute, repeat, reshape, squeeze, transpose, unsqueeze, view
from .linalg import matmul
from .norm import softmax
from .reduce import amax, mean, sum_


def _float(x: SymTensor) -> SymTensor:
    return cast(x, f32)


def _contiguous(x: SymTensor) -> SymTensor:
    """``x.contiguous()``: the same value in the graph, now known row-major."""
    return SymTensor(x.type, x.vid, row_major=True)


METHODS.update({
    "add": add, "sub": sub, "mul": mul, "div": div, "matmul": matmul, "getitem": getitem,
    "reshape": reshape, "view": view, "permute": permute, "transpose": transpose, "flatten": flatten,
    "unsqueeze": unsqueeze, "squeeze": squeeze, "expand": expand, "softmax": softmax, "sum": sum_,
    "mean": mean, "amax": amax, "sigmoid": sigmoid, "relu": relu, "exp": exp, "sin": sin, "cos": cos,
    "tanh": tanh, "repeat": repeat, "float": _float,
    "contiguous": _contiguous,
})
