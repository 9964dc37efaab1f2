"""Reductions along axes: sum, mean, max, argmax."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ...checker.rules import (
    axis,
    float_dtype,
    kind_of,
    like,
    positive,
)
from ...checker.symbolic import ShapeError, SymTensor, op
from ...shapes.poly import ONE
from ...types.dtypes import i64


def _reduce(name: str, torch_fn: Any) -> Any:
    @op(name)
    def kernel(x: torch.Tensor, dim: int | Sequence[int], keepdim: bool = False) -> torch.Tensor:
        return torch_fn(x, dim=dim, keepdim=keepdim)

    @kernel.rule
    def _(x: SymTensor, dim: int | Sequence[int], keepdim: bool = False) -> SymTensor:
        d = x.fixed_dims(name)
        listed = [axis(x, a) for a in (dim if isinstance(dim, list | tuple) else [dim])]
        axes = set(listed)
        if len(axes) != len(listed):
            raise ShapeError(f"{name}: an axis appears twice in {dim} for {x.show()}")
        out = [ONE if i in axes else s for i, s in enumerate(d)] if keepdim else [
            s for i, s in enumerate(d) if i not in axes]
        if name == "amax":
            for i in axes:  # torch refuses the max of nothing
                positive(d[i], "amax: the reduced axis", x)
        if name == "mean":
            float_dtype(x, name)
        elif name == "sum" and kind_of(x) != "Float":
            if kind_of(x) == "DType":
                raise ShapeError(f"sum of {x.show()}: a float stays, an integer or bool becomes i64; "
                                 "declare the dtype's kind")
            return like(x, out, i64)  # torch sums integers and bools in int64
        return like(x, out)

    return kernel


sum_ = _reduce("sum", torch.sum)
mean = _reduce("mean", torch.mean)
amax = _reduce("amax", torch.amax)


@op("argmax")
def argmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The index of the first largest value along ``dim`` (which is dropped), as i64."""
    return torch.argmax(x, dim=dim)


@argmax.rule
def _(x: SymTensor, dim: int = -1) -> SymTensor:
    d = x.fixed_dims("argmax")
    a = axis(x, dim)
    positive(d[a], "argmax: the reduced axis", x)  # torch refuses an empty one
    return like(x, [s for i, s in enumerate(d) if i != a], i64)
