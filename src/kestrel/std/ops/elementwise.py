"""Elementwise ops: arithmetic with broadcasting, activations, comparisons, selection, casts."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ... import kernels
from ...checker.rules import (
    broadcast_dims,
    float_dtype,
    like,
    numeric_dtype,
    same_dtype,
    scalar_fits,
    show_dims,
)
from ...checker.symbolic import ShapeError, SymDim, SymTensor, op
from ...types.dtypes import DType, DTypeVar, bool_


def _binary(name: str, torch_fn: Any, dtype_rule: Any = numeric_dtype) -> Any:
    """An arithmetic op of two tensors, or of a tensor and a scalar, broadcasting; ``dtype_rule``
    says which operand dtypes it takes."""

    @op(name, layout="preserve")
    def kernel(x: Any, y: Any) -> Any:
        return torch_fn(x, y)

    @kernel.rule
    def _(x: Any, y: Any) -> SymTensor:
        if isinstance(x, SymTensor) and isinstance(y, SymTensor):
            same_dtype(x, y, name)
            dtype_rule(x, name)
            dims = broadcast_dims(x.dims, y.dims, name, x.show(), y.show())
            return like(x, dims)
        t = x if isinstance(x, SymTensor) else y
        other = y if t is x else x
        if isinstance(other, SymDim):
            raise ShapeError(f"{name} of a tensor and the dimension {other}: convert it with a std op")
        dtype_rule(t, name)
        scalar_fits(t, other, name)
        return like(t, t.dims)

    return kernel


add = _binary("add", torch.add)
sub = _binary("sub", torch.sub)
mul = _binary("mul", torch.mul)
div = _binary("div", torch.div, float_dtype)  # int / int is a float in torch: refused, not guessed


@op("addcmul", layout="preserve")
def addcmul(x: torch.Tensor, y: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x + y * scale``, broadcasting, in one pass (``torch.addcmul``): a residual branch scaled per channel
    (DINOv2's LayerScale) added without a pass that writes the scaled branch first. Within a rounding of
    ``x + y * scale``: torch's vectorised kernel may fuse the product into the add (one rounding, not two).
    DINOv2-B at 518 px, batch 1, one process, interleaved: 1.5% of a call on an Intel Xeon with AMX."""
    return torch.addcmul(x, y, scale)


@addcmul.rule
def _(x: SymTensor, y: SymTensor, scale: SymTensor) -> SymTensor:
    for t in (x, y, scale):
        if not isinstance(t, SymTensor):
            raise ShapeError(f"addcmul takes three tensors, got {type(t).__name__}")
    same_dtype(x, y, "addcmul")
    same_dtype(x, scale, "addcmul")
    float_dtype(x, "addcmul")
    product = broadcast_dims(y.dims, scale.dims, "addcmul (y * scale)", y.show(), scale.show())
    return like(x, broadcast_dims(x.dims, product, "addcmul (x + y * scale)", x.show(), f"[{show_dims(product)}]"))


def _unary(name: str, torch_fn: Any, needs_float: bool = True) -> Any:
    @op(name, layout="preserve")
    def kernel(x: torch.Tensor) -> torch.Tensor:
        return torch_fn(x)

    @kernel.rule
    def _(x: SymTensor) -> SymTensor:
        if needs_float:
            float_dtype(x, name)
        return like(x, x.dims)

    return kernel


relu = _unary("relu", F.relu)
sigmoid = _unary("sigmoid", torch.sigmoid)
silu = _unary("silu", F.silu)
tanh = _unary("tanh", torch.tanh)
exp = _unary("exp", torch.exp)
sin = _unary("sin", torch.sin)
cos = _unary("cos", torch.cos)


@op("gelu", layout="preserve")
def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GELU, exact (erf) by default or ``approximate="tanh"``."""
    return F.gelu(x, approximate=approximate)


def _gelu_rule(name: str) -> Any:
    """The type rule of ``gelu`` and of its in-place twin: same shape, a float, a known approximation."""
    def rule(x: SymTensor, approximate: str = "none") -> SymTensor:
        if approximate not in ("none", "tanh"):
            raise ShapeError(f"{name}: approximate must be 'none' or 'tanh', got {approximate!r}")
        float_dtype(x, name)
        return like(x, x.dims)
    return rule


gelu.rule(_gelu_rule("gelu"))


@op("gelu_", layout="preserve")
def gelu_(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GELU that consumes its argument: ``x`` may be overwritten with the result.

    The contract: pass a temporary nothing else reads, written inline (``gelu_(self.up(x))``, never a
    name the caller uses again); ``tests/test_layers.py`` checks every call in Kestrel's sources is
    such an expression. It then runs in place in eager inference on a plain tensor, and out of place
    everywhere else: a parameter, a tensor autograd records, compiled, traced and exported graphs.
    An MLP's hidden activation is the largest tensor of a ViT layer; a second one for GELU's output
    costs an allocation, fresh pages and a pass of memory (figures in the README's Speed section).
    """
    if type(x) is torch.Tensor and kernels.plain_inference(x):
        return kernels.gelu_(x, approximate)
    return F.gelu(x, approximate=approximate)


gelu_.rule(_gelu_rule("gelu_"))


abs_ = _unary("abs", torch.abs)


def _compare(name: str, torch_fn: Any) -> Any:
    @op(name, layout="preserve")
    def kernel(x: torch.Tensor, value: int | float) -> torch.Tensor:
        return torch_fn(x, value)

    @kernel.rule
    def _(x: SymTensor, value: int | float) -> SymTensor:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ShapeError(f"{name} compares with a Python number, got {type(value).__name__}")
        return like(x, x.dims, bool_)

    return kernel


gt = _compare("gt", torch.gt)  # ``x > value``, a bool tensor of x's shape
ge = _compare("ge", torch.ge)  # ``x >= value``


@op("eq", layout="preserve")
def eq(x: torch.Tensor, value: int | float) -> torch.Tensor:
    """``x == value`` elementwise, a bool tensor of ``x``'s shape."""
    return x == value


@eq.rule
def _(x: SymTensor, value: int | float) -> SymTensor:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ShapeError(f"eq compares with a Python number, got {type(value).__name__}")
    return like(x, x.dims, bool_)


@op("where", layout="preserve")
def where(cond: torch.Tensor, x: Any, y: Any) -> torch.Tensor:
    """``x`` where ``cond`` holds, else ``y``; tensors broadcast, either side may be a number."""
    return torch.where(cond, x, y)


@where.rule
def _(cond: SymTensor, x: Any, y: Any) -> SymTensor:
    if not isinstance(cond, SymTensor) or cond.dtype != bool_:
        shown = cond.show() if isinstance(cond, SymTensor) else type(cond).__name__
        raise ShapeError(f"where: the condition must be a bool tensor, got {shown}")
    tensors = [v for v in (x, y) if isinstance(v, SymTensor)]
    for v in (x, y):
        if not isinstance(v, SymTensor) and (isinstance(v, bool) or not isinstance(v, int | float)):
            raise ShapeError(f"where: values must be tensors or Python numbers, got {type(v).__name__}")
    if not tensors:
        raise ShapeError("where: at least one of the values must be a tensor")
    if len(tensors) == 2:
        same_dtype(tensors[0], tensors[1], "where")
    else:
        scalar_fits(tensors[0], y if tensors[0] is x else x, "where")
    dims = list(cond.dims)
    shown = cond.show()
    for v in tensors:
        dims = broadcast_dims(dims, v.dims, "where", shown, v.show())
        shown = f"[{show_dims(dims)}]"
    return like(tensors[0], dims)


@op("cast", layout="preserve")
def cast(x: torch.Tensor, dtype: DType) -> torch.Tensor:
    return x.to(dtype.torch)


@cast.rule
def _(x: SymTensor, dtype: DType | DTypeVar) -> SymTensor:
    if not isinstance(dtype, DType | DTypeVar):
        raise ShapeError(f"cast to {dtype!r}: give a kestrel dtype (f32, i32...) or a dtype generic (self.T)")
    return like(x, x.dims, dtype)  # exactly the named dtype
