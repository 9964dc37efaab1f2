"""Layout ops: reshape and view, permutations, flattening, new and dropped axes, joins, splits, padding."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ... import kernels
from ...checker.rules import (
    axis,
    cancel_common,
    divisibility_hint,
    ge_hint,
    like,
    nonneg,
    numel,
    operand,
    same,
    same_dtype,
    show_dims,
    show_target,
    sum_dims,
)
from ...checker.symbolic import ShapeError, SymTensor, as_poly, current, fmt, op, require_positive
from ...shapes.poly import ONE, Poly, floordiv


def _spread(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Sizes or axes as torch takes them either way: spread (``x.reshape(2, 3)``) or as one list or
    tuple (``x.reshape([2, 3])``)."""
    return tuple(args[0]) if len(args) == 1 and isinstance(args[0], list | tuple) else args


@op("reshape", layout="preserve")
def reshape(x: torch.Tensor, *shape: Any) -> torch.Tensor:
    return x.reshape(*shape)


@reshape.rule
def _reshape_rule(x: SymTensor, *shape: Any) -> SymTensor:
    src = x.fixed_dims("reshape")
    target: list[Poly | None] = []
    for s in _spread(shape):
        target.append(None if (isinstance(s, int) and s == -1) else as_poly(s))
    facts = current().facts
    total = numel(src)
    if target.count(None) > 1:
        raise ShapeError(f"reshape of {x.show()}: at most one -1")
    if None in target:
        known = numel([t for t in target if t is not None])
        if not facts.divides(known, total):
            k2, t2 = cancel_common(known, total)
            raise ShapeError(f"reshape of {x.show()} to [{show_target(target)}]: cannot prove {fmt(known)} "
                             f"divides {fmt(total)}", hint=f"{operand(t2)} % {operand(k2)} == 0")
        require_positive(known)
        target[target.index(None)] = floordiv(total, known)
    dims: list[Poly] = [t for t in target if t is not None]
    for t in dims:
        nonneg(t, "reshape: a target axis", x)
    if not facts.equal(numel(dims), total):
        hint = divisibility_hint(dims)
        raise ShapeError(f"reshape of {x.show()} to [{show_dims(dims)}]: element counts {fmt(total)} and "
                         f"{fmt(numel(dims))} cannot be proved equal", hint=hint)
    return like(x, dims)


@op("view", layout="preserve")
def view(x: torch.Tensor, *shape: Any) -> torch.Tensor:
    """``x.view``: a reshape that never copies, so the checker accepts it only on a layout proved row-major."""
    return x.view(*shape)


@view.rule
def _(x: SymTensor, *shape: Any) -> SymTensor:
    if not x.row_major:
        raise ShapeError(f"view of {x.show()}, whose layout may not be row-major (a transpose, permute, expand, "
                         "slice or split result, or a function input): torch refuses views it cannot express; "
                         "use reshape (it views when it can, and copies only when it must)")
    return _reshape_rule(x, *shape)


@op("permute")
def permute(x: torch.Tensor, *order: int) -> torch.Tensor:
    return x.permute(*order)


@permute.rule
def _(x: SymTensor, *order: Any) -> SymTensor:
    d = x.fixed_dims("permute")
    order_ = _spread(order)
    if not order:
        raise ShapeError(f"permute of {x.show()} needs the order of its axes")
    if len(order_) != len(d) or sorted(axis(x, o) for o in order_) != list(range(len(d))):
        raise ShapeError(f"permute{order_} is not a permutation of the {len(d)} axes of {x.show()}")
    return like(x, [d[o] for o in order_])


@op("contiguous", layout="fresh", recorded=False)
def contiguous(x: torch.Tensor) -> torch.Tensor:
    """The same values laid out row-major. A layout choice, not a type change: a permuted view left as
    it is makes every later elementwise op (and each residual add, whose result keeps the first
    operand's strides) walk memory across the grain.

    Kernel: a token map transposed from channels-first whose rows alias in the caches is copied in
    slabs of channels (:func:`kestrel.kernels.contiguous`); anything else is ``x.contiguous()``."""
    return kernels.contiguous(x)


@contiguous.rule
def _(x: SymTensor) -> SymTensor:
    return SymTensor(x.type, x.vid, row_major=True)  # the same value in the graph, as x.contiguous()


@op("transpose")
def transpose(x: torch.Tensor, a: int, b: int) -> torch.Tensor:
    return x.transpose(a, b)


@transpose.rule
def _(x: SymTensor, a: int, b: int) -> SymTensor:
    d = x.fixed_dims("transpose")
    i, j = axis(x, a), axis(x, b)
    d[i], d[j] = d[j], d[i]
    return like(x, d)


@op("flatten")
def flatten(x: torch.Tensor, start: int = 0, end: int = -1) -> torch.Tensor:
    return x.flatten(start, end)


@flatten.rule
def _(x: SymTensor, start: int = 0, end: int = -1) -> SymTensor:
    d = x.fixed_dims("flatten")
    if not d:  # torch flattens a 0-d tensor to one axis of 1
        axis(x, start, 1), axis(x, end, 1)
        return like(x, [ONE])
    i, j = axis(x, start), axis(x, end)
    if i > j:
        raise ShapeError(f"flatten({start}, {end}) of {x.show()}: the start axis comes after the end axis")
    return like(x, [*d[:i], numel(d[i: j + 1]), *d[j + 1:]])


@op("unsqueeze")
def unsqueeze(x: torch.Tensor, dim: int) -> torch.Tensor:
    return x.unsqueeze(dim)


@unsqueeze.rule
def _(x: SymTensor, dim: int) -> SymTensor:
    d = x.fixed_dims("unsqueeze")
    i = axis(x, dim, len(d) + 1)
    return like(x, [*d[:i], ONE, *d[i:]])


@op("squeeze")
def squeeze(x: torch.Tensor, dim: int) -> torch.Tensor:
    return x.squeeze(dim)


@squeeze.rule
def _(x: SymTensor, dim: int) -> SymTensor:
    d = x.fixed_dims("squeeze")
    i = axis(x, dim)
    same(d[i], ONE, f"squeeze: axis {dim} is not of size 1", x)
    return like(x, d[:i] + d[i + 1:])


@op("expand")
def expand(x: torch.Tensor, *sizes: Any) -> torch.Tensor:
    return x.expand(*sizes)


@expand.rule
def _(x: SymTensor, *sizes: Any) -> SymTensor:
    d = x.fixed_dims("expand")
    raw = _spread(sizes)
    if len(raw) < len(d):
        raise ShapeError(f"expand of {x.show()} to {len(raw)} axes")
    out: list[Poly] = []
    offset = len(raw) - len(d)
    for i, s in enumerate(raw):
        cur = d[i - offset] if i >= offset else None
        if isinstance(s, int) and s == -1:
            if cur is None:
                raise ShapeError(f"expand: -1 for a new leading axis of {x.show()}")
            out.append(cur)
            continue
        want = nonneg(as_poly(s), "expand: a target axis", x)
        if cur is not None and cur != ONE:
            same(cur, want, f"expand: axis {i - offset} is not 1 and differs", x)
        out.append(want)
    return like(x, out)


def _alike(xs: Sequence[SymTensor], what: str, differs: Callable[[int], str], skip: int = -1) -> list[list[Poly]]:
    """The dims of each of ``xs`` (``cat``, ``stack``): one rank and dtype, every axis but ``skip`` the same."""
    first = xs[0]
    dims = [first.fixed_dims(what)]
    for x in xs[1:]:
        d = x.fixed_dims(what)
        if len(d) != len(dims[0]):
            raise ShapeError(f"{what}: ranks differ: {first.show()} and {x.show()}")
        same_dtype(first, x, what)
        for k, (a, b) in enumerate(zip(dims[0], d)):
            if k != skip:
                same(a, b, differs(k), first, x)
        dims.append(d)
    return dims


@op("cat")
def cat(xs: Sequence[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """Concatenate along ``dim``; every other axis must agree."""
    return torch.cat(list(xs), dim=dim)


@cat.rule
def _(xs: Sequence[SymTensor], dim: int = 0) -> SymTensor:
    first = xs[0]
    first.fixed_dims("cat")  # a hidden axis is the first thing to name, before a bad ``dim``
    i = axis(first, dim)
    dims = _alike(xs, "cat", lambda k: f"cat along axis {dim}: axis {k} differs", skip=i)
    out = list(dims[0])
    out[i] = sum_dims([d[i] for d in dims])
    return like(first, out)


@op("stack")
def stack(xs: Sequence[torch.Tensor], dim: int = 0) -> torch.Tensor:
    return torch.stack(list(xs), dim=dim)


@stack.rule
def _(xs: Sequence[SymTensor], dim: int = 0) -> SymTensor:
    d0 = _alike(xs, "stack", lambda k: "stack: shapes differ")[0]
    i = axis(xs[0], dim, len(d0) + 1)
    return like(xs[0], [*d0[:i], Poly.const(len(xs)), *d0[i:]])


@op("split")
def split(x: torch.Tensor, sizes: Sequence[Any], dim: int = -1) -> tuple[torch.Tensor, ...]:
    """Split into consecutive pieces of the given sizes along ``dim``."""
    return torch.split(x, list(sizes), dim=dim)


@split.rule
def _(x: SymTensor, sizes: Sequence[Any], dim: int = -1) -> tuple[SymTensor, ...]:
    d = list(x.dims)
    i = axis(x, dim)
    parts = [nonneg(as_poly(s), "split: a piece", x) for s in sizes]
    same(sum_dims(parts), d[i], "split: the pieces do not add up to the axis", x)  # type: ignore[arg-type]
    return tuple(like(x, [*d[:i], p, *d[i + 1:]]) for p in parts)


@op("pad")
def pad(x: torch.Tensor, pads: Sequence[Any], value: float = 0.0) -> torch.Tensor:
    """Constant padding, ``pads`` as torch orders it: last axis first, (before, after) pairs."""
    return F.pad(x, [int(p) for p in pads], value=value)


@pad.rule
def _(x: SymTensor, pads: Sequence[Any], value: float = 0.0) -> SymTensor:
    d = x.fixed_dims("pad")
    if len(pads) % 2 or len(pads) // 2 > len(d):
        raise ShapeError(f"pad: {len(pads)} values for {x.show()}")
    facts = current().facts
    for k in range(len(pads) // 2):
        before, after = as_poly(pads[2 * k]), as_poly(pads[2 * k + 1])
        for p in (before, after):
            if not facts.nonneg(p):
                raise ShapeError(f"pad: cannot prove the padding {fmt(p)} is nonnegative", hint=ge_hint(p))
        d[len(d) - 1 - k] = d[len(d) - 1 - k] + before + after
    return like(x, d)


@op("repeat")
def repeat(x: torch.Tensor, *times: Any) -> torch.Tensor:
    return x.repeat(*times)


@repeat.rule
def _(x: SymTensor, *times: Any) -> SymTensor:
    d = x.fixed_dims("repeat")
    if not times:
        raise ShapeError(f"repeat of {x.show()} needs one factor per axis")
    t = [nonneg(as_poly(s), "repeat: a factor", x) for s in times]
    if len(t) < len(d):
        raise ShapeError(f"repeat of {x.show()} with {len(t)} factors")
    d = [ONE] * (len(t) - len(d)) + d
    return like(x, [a * b for a, b in zip(d, t)])
