"""The proof helpers every shape rule uses: prove sizes nonnegative or positive, dims equal, dtypes of a kind,
axes in range, broadcasting, each failing with a :class:`ShapeError` that names both shapes and the missing fact.

Public so that std ops (and a user's own ops) state their rules with the same words and diagnostics.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..shapes.poly import ONE, Poly, ge_text
from ..types.dtypes import DType, DTypeVar
from ..types.tensor import TensorType, Variadic
from .symbolic import ShapeError, SymTensor, current, fmt, positive_hint


def like(x: SymTensor, dims: Sequence[Poly | Variadic], dtype: DType | DTypeVar | None = None) -> SymTensor:
    return SymTensor(TensorType(tuple(dims), dtype if dtype is not None else x.dtype))


def nonneg(p: Poly, what: str, x: SymTensor | None = None) -> Poly:
    """Prove the size ``p >= 0`` from the where clause, or fail naming the missing fact."""
    facts = current().facts
    if not facts.nonneg(p):
        shape = f" ({x.show()})" if x is not None else ""
        raise ShapeError(f"{what}: cannot prove the size {fmt(p)} is nonnegative{shape}{facts.witness('ge', p)}",
                         hint=ge_hint(p))
    return p


def positive(p: Poly, what: str, x: SymTensor | None = None) -> Poly:
    """Prove the size ``p > 0`` (where torch refuses an empty axis), or fail naming the missing fact."""
    facts = current().facts
    if not facts.positive(p):
        shape = f" ({x.show()})" if x is not None else ""
        raise ShapeError(f"{what}: cannot prove the size {fmt(p)} is positive{shape}"
                         f"{facts.witness('ge', p, ONE)}", hint=positive_hint(p))
    return p


def ge_hint(p: Poly, strict: bool = False) -> str:
    return ge_text(p, current().order, strict)


def same(a: Poly, b: Poly, what: str, x: SymTensor, y: SymTensor | None = None) -> None:
    """Prove a == b, or fail naming both shapes and the dims that differ."""
    if current().facts.equal(a, b):
        return
    shapes = f"{x.show()} and {y.show()}" if y is not None else x.show()
    raise ShapeError(f"{what}: {fmt(a)} vs {fmt(b)} ({shapes}){current().facts.witness('eq', a, b)}",
                     hint=f"{fmt(a)} == {fmt(b)}")


def same_dtype(x: SymTensor, y: SymTensor, what: str) -> None:
    if x.dtype != y.dtype:
        raise ShapeError(f"{what}: dtype {x.dtype} vs {y.dtype} ({x.show()} and {y.show()})")


def kind_of(x: SymTensor) -> str:
    """``Float``, ``Int``, ``Bool``, or ``DType`` for a generic that may be any of them."""
    d = x.dtype
    return d.kind if isinstance(d, DType | DTypeVar) else "DType"


def float_dtype(x: SymTensor, what: str) -> None:
    if kind_of(x) != "Float":
        hint = " (declare its dtype generic as `T: Float`, or cast it)" if isinstance(x.dtype, DTypeVar) else ""
        raise ShapeError(f"{what} needs a floating-point tensor, got {x.show()}{hint}")


def numeric_dtype(x: SymTensor, what: str) -> None:
    if kind_of(x) not in ("Float", "Int"):
        raise ShapeError(f"{what} needs a number tensor (Float or Int), got {x.show()}")


def scalar_fits(t: SymTensor, value: Any, what: str) -> None:
    """A Python number beside a tensor keeps the tensor's dtype only when torch would not promote it."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ShapeError(f"{what} of a tensor and a {type(value).__name__}")
    if isinstance(value, float) and kind_of(t) != "Float":
        raise ShapeError(f"{what}: a float {value} with {t.show()} would promote it to a float dtype; "
                         f"cast the tensor explicitly")


def axis(x: SymTensor, dim: int, rank: int | None = None) -> int:
    """The index of axis ``dim`` in ``x.dims`` (``rank``: of a result with that many axes).

    Through a variadic run ``*S`` only an axis after it, counted from the end, is known.
    """
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise ShapeError(f"an axis must be a Python int, got {type(dim).__name__} {dim!r}")
    if rank is None and x.type.rank is None:
        d = x.dims
        if dim >= 0 or -dim > len(d) or any(isinstance(a, Variadic) for a in d[dim:]):
            raise ShapeError(f"axis {dim} of {x.show()} is hidden by the variadic run *{x._var()}")
        return len(d) + dim
    n = rank if rank is not None else len(x.fixed_dims())
    if not -n <= dim < n:
        raise ShapeError(f"axis {dim} is out of range for {x.show()} ({n} axes)")
    return dim % n


def last_dim(x: SymTensor, what: str) -> Poly:
    if not x.dims or isinstance(x.dims[-1], Variadic):
        raise ShapeError(f"{what} needs a last axis, got {x.show()}")
    return x.dims[-1]  # type: ignore[return-value]


def broadcast_dims(x: Sequence[Poly | Variadic], y: Sequence[Poly | Variadic], what: str,
                   xs: str, ys: str) -> list[Poly | Variadic]:
    facts = current().facts
    out: list[Poly | Variadic] = []
    i, j = len(x) - 1, len(y) - 1
    while i >= 0 or j >= 0:
        a = x[i] if i >= 0 else None
        b = y[j] if j >= 0 else None
        if isinstance(a, Variadic) or isinstance(b, Variadic):
            # a variadic run passes through only against nothing or the same run (then the axes before
            # the run broadcast in turn: [*S, D] with [B, *S, D] is [B, *S, D])
            if a is not None and b is not None and a != b:
                raise ShapeError(f"{what}: cannot broadcast {xs} with {ys}: {a} against {b} (a run of unknown "
                                 "length cannot line up with another axis)")
            if a is not None and b is not None:
                head = broadcast_dims(x[:i], y[:j], what, xs, ys)
                return [*head, a, *reversed(out)]
            rest = list(x[: i + 1]) if isinstance(a, Variadic) else list(y[: j + 1])
            return rest + list(reversed(out))
        if a is None:
            out.append(b)  # type: ignore[arg-type]
        elif b is None:
            out.append(a)
        elif facts.equal(a, b) or b == ONE:
            out.append(a)
        elif a == ONE:
            out.append(b)
        else:
            raise ShapeError(f"{what}: cannot broadcast {xs} with {ys}: {fmt(a)} against {fmt(b)}",
                             hint=f"{fmt(a)} == {fmt(b)}")
        i, j = i - 1, j - 1
    return list(reversed(out))


def show_dims(dims: Sequence[Poly]) -> str:
    return ", ".join(fmt(d) for d in dims)


def numel(dims: Sequence[Poly]) -> Poly:
    out = ONE
    for d in dims:
        out = out * d
    return out


def sum_dims(ps: Sequence[Poly]) -> Poly:
    out = Poly()
    for p in ps:
        out = out + p
    return out


def pair(v: Any) -> tuple[Any, Any]:
    return (v[0], v[1]) if isinstance(v, tuple | list) else (v, v)


def cancel_common(known: Poly, total: Poly) -> tuple[Poly, Poly]:
    """``known`` and ``total`` without their common monomial factor: what the hint must name."""
    from ..shapes.facts import _common_factor

    _, k, t = _common_factor(known, total)
    return k, t


def show_target(t: Sequence[Poly | None]) -> str:
    return ", ".join("-1" if d is None else fmt(d) for d in t)


def divisibility_hint(dims: Sequence[Poly]) -> str | None:
    from ..shapes.poly import FloorDiv

    facts = current().facts
    for d in dims:
        for a in d.atoms():  # the first division not already known exact is the missing fact
            if isinstance(a, FloorDiv) and not facts.divides(a.b, a.a):
                return f"{operand(a.a)} % {operand(a.b)} == 0"
    return None


def operand(p: Poly) -> str:
    text = fmt(p)
    return text if p.is_const or p.as_atom() is not None else f"({text})"

