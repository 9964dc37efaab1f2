"""Indexing: ``x[...]``, gathers, embeddings, relative-position tables, grid positions, index ranges."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ... import kernels
from ...checker.rules import (
    axis,
    float_dtype,
    ge_hint,
    like,
    nonneg,
    numeric_dtype,
    same,
)
from ...checker.symbolic import ShapeError, SymDim, SymTensor, as_poly, current, fmt, op, record, require_positive
from ...shapes.poly import ONE, Poly, floordiv
from ...types.dtypes import DType, DTypeVar


def _slice_len(size: Poly, s: slice, where: str = "") -> Poly:
    """The length of ``s`` on an axis of length ``size``; ``where`` names the tensor in errors."""
    facts = current().facts
    if s.step not in (None, 1):
        step = as_poly(s.step)
        require_positive(step)
    else:
        step = ONE
    start = as_poly(0 if s.start is None else s.start)
    stop = size if s.stop is None else as_poly(s.stop)
    if start.is_const and start.value < 0:
        start = size + start
    if stop.is_const and stop.value < 0:
        stop = size + stop
    for bound, name in ((start, "start"), (stop, "stop")):
        if not (facts.nonneg(bound) and facts.nonneg(size - bound)):
            bad = bound if not facts.nonneg(bound) else size - bound
            raise ShapeError(f"slice {name} {fmt(bound)} may be outside an axis of length {fmt(size)}{where}",
                             hint=ge_hint(bad))
    if not facts.nonneg(stop - start):
        raise ShapeError(f"slice {fmt(start)}:{fmt(stop)} may be empty or reversed{where}",
                         hint=ge_hint(stop - start))
    return floordiv(stop - start + step - 1, step)


def getitem(x: SymTensor, index: Any) -> SymTensor:
    """``x[...]`` with ints, slices, ``None`` and ``...`` under the checker."""
    idx = index if isinstance(index, tuple) else (index,)
    d = x.fixed_dims("indexing")
    n_real = sum(1 for i in idx if i is not None and i is not Ellipsis)
    if n_real > len(d):
        raise ShapeError(f"too many indices ({n_real}) for {x.show()}")
    dots = [k for k, i in enumerate(idx) if i is Ellipsis]  # by identity: ``in`` would compare dimensions
    if len(dots) > 1:
        raise ShapeError(f"an index of {x.show()} may hold one ellipsis, got {len(dots)}")
    if dots:
        k = dots[0]
        idx = idx[:k] + (slice(None),) * (len(d) - n_real) + idx[k + 1:]
    out: list[Poly] = []
    facts = current().facts
    pos = 0
    for i in idx:
        if i is None:
            out.append(ONE)
            continue
        size = d[pos]
        pos += 1
        if isinstance(i, slice):
            out.append(_slice_len(size, i, f" in {x.show()}"))
        elif isinstance(i, int | SymDim):
            p = as_poly(i)
            if p.is_const and p.value < 0:  # x[-k] needs size >= k
                ok, hint = facts.nonneg(size + p), ge_hint(size + p)
            else:
                ok, hint = facts.positive(size - p), ge_hint(size - p, strict=True)
            if not ok:
                raise ShapeError(f"index {fmt(p)} may be out of range for an axis of length {fmt(size)} "
                                 f"in {x.show()}", hint=hint)
        else:
            raise ShapeError(f"indexing with a {type(i).__name__}: use the gather op")
    out.extend(d[pos:])
    result = like(x, out)
    record("getitem", [x], [result], detail=str(index))
    return result


@op("gather")
def gather(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows of ``table`` at integer ``index``: ``[V, *R]`` at ``[*S] -> [*S, *R]``."""
    return table[index]


@gather.rule
def _(table: SymTensor, index: SymTensor) -> SymTensor:
    if not (isinstance(index.dtype, DType | DTypeVar) and index.dtype.kind == "Int"):
        raise ShapeError(f"gather: the index must be an integer tensor, got {index.show()}")
    d = table.fixed_dims("gather")
    return like(table, [*index.dims, *d[1:]])


@op("embedding")
def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Rows of an embedding table: ``[*S] (int) -> [*S, H]``."""
    return F.embedding(ids, weight)


@embedding.rule
def _(ids: SymTensor, weight: SymTensor) -> SymTensor:
    if not (isinstance(ids.dtype, DType | DTypeVar) and ids.dtype.kind == "Int"):
        raise ShapeError(f"embedding: ids must be integers, got {ids.show()}")
    w = weight.fixed_dims("embedding")
    if len(w) != 2:
        raise ShapeError(f"embedding: the table must be [V, H], got {weight.show()}")
    return like(weight, [*ids.dims, w[1]])


@op("relative_positions")
def relative_positions(table: torch.Tensor, n: int) -> torch.Tensor:
    """Rows ``table[i - j + n - 1]`` for ``i, j < n``: ``[2n - 1, C] -> [n, n, C]``.

    The relative-position lookup of SAM's (and MViTv2's) decomposed attention bias.
    """
    idx = torch.arange(n, device=table.device)
    return table[idx[:, None] - idx[None, :] + (n - 1)]


@relative_positions.rule
def _(table: SymTensor, n: Any) -> SymTensor:
    d = table.fixed_dims("relative_positions")
    if len(d) != 2:
        raise ShapeError(f"relative_positions takes a [2n - 1, C] table, got {table.show()}")
    size = as_poly(n)  # the table's length 2n - 1, a size, makes n >= 1
    same(d[0], 2 * size - 1, "relative_positions: the table length is not 2n - 1", table)
    return like(table, [size, size, d[1]])


@op("grid_fourier")
def grid_fourier(table: torch.Tensor, side: int) -> torch.Tensor:
    """Random Fourier features of every cell centre of a ``side x side`` grid: ``[2, C] -> [1, 2C, side, side]``.

    Cell ``(i, j)`` is centred at ``c = ((j + 0.5) / side, (i + 0.5) / side)`` (x the column); its features are
    ``[sin, cos](2 pi (2c - 1) table)``: SAM's and SAM 2.1's dense positional encoding.

    Kernel: a constant of the table. On a parameter, in eager inference, it is computed once and kept
    (:func:`kestrel.kernels.grid_fourier`): every call returns that one tensor, to be read, never written to.
    """
    return kernels.grid_fourier(table, side)


@grid_fourier.rule
def _(table: SymTensor, side: Any) -> SymTensor:
    d = table.fixed_dims("grid_fourier")
    if len(d) != 2:
        raise ShapeError(f"grid_fourier takes a [2, C] table, got {table.show()}")
    same(d[0], as_poly(2), "grid_fourier: the table's first axis is not 2 (x and y)", table)
    float_dtype(table, "grid_fourier")
    size = as_poly(side)
    require_positive(size)
    return like(table, [ONE, 2 * d[1], size, size])


@op("take_along")
def take_along(x: torch.Tensor, index: torch.Tensor, dim: int) -> torch.Tensor:
    """``torch.gather``: ``out[..., i, ...] = x[..., index[..., i, ...], ...]`` along ``dim``.

    ``index`` has ``x``'s rank and its shape on every axis but ``dim``; the result has ``index``'s shape.
    """
    return torch.gather(x, dim, index)


@take_along.rule
def _(x: SymTensor, index: SymTensor, dim: int) -> SymTensor:
    if not (isinstance(index.dtype, DType | DTypeVar) and index.dtype.kind == "Int"):
        raise ShapeError(f"take_along: the index must be an integer tensor, got {index.show()}")
    d, di = x.fixed_dims("take_along"), index.fixed_dims("take_along")
    if len(d) != len(di):
        raise ShapeError(f"take_along: index {index.show()} and {x.show()} differ in rank")
    a = axis(x, dim)
    for i, (s, t) in enumerate(zip(d, di)):
        if i != a:
            same(s, t, f"take_along: axis {i} of the index differs", x, index)
    return like(x, di)


@op("arange_like")
def arange_like(x: torch.Tensor, n: int) -> torch.Tensor:
    """``[0, 1, ..., n-1]`` in the dtype and on the device of ``x``."""
    return torch.arange(n, dtype=x.dtype, device=x.device)


@arange_like.rule
def _(x: SymTensor, n: Any) -> SymTensor:
    numeric_dtype(x, "arange_like")
    return like(x, [nonneg(as_poly(n), "arange_like: the length", x)])


@op("dim_like")
def dim_like(x: torch.Tensor, n: int) -> torch.Tensor:
    """The dimension ``n`` as a 0-d tensor in the dtype and on the device of ``x`` (to scale by a size)."""
    return torch.tensor(float(n), dtype=x.dtype, device=x.device)


@dim_like.rule
def _(x: SymTensor, n: Any) -> SymTensor:
    as_poly(n)
    return like(x, [])
