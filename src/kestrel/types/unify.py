"""Matching a declared tensor type against an actual one, binding the function's generics.

Used by the checker (actual dims symbolic) and by entry calls at run time (actual dims concrete):
one rule for both, so what the checker proves is what a call checks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..shapes.facts import Facts
from ..shapes.poly import AtomOrder, Poly, format_poly, substitute
from .dtypes import KINDS, DType, DTypeVar
from .tensor import DimItem, TensorType, Variadic


@dataclass
class Binding:
    """What matching has learnt: function dims, variadic runs, dtype generics."""

    dims: dict[str, Poly] = field(default_factory=dict)
    shapes: dict[str, tuple[DimItem, ...]] = field(default_factory=dict)
    dtypes: dict[str, DType | DTypeVar] = field(default_factory=dict)

    def apply(self, t: TensorType) -> TensorType:
        dims: list[DimItem] = []
        for d in t.dims:
            if isinstance(d, Variadic):
                dims.extend(self.shapes.get(d.name, (d,)))
            else:
                dims.append(substitute(d, self.dims))
        dtype = self.dtypes.get(t.dtype.name, t.dtype) if isinstance(t.dtype, DTypeVar) else t.dtype
        return TensorType(tuple(dims), dtype, t.optional)


@dataclass(frozen=True)
class Mismatch:
    """One way an actual tensor differs from its declared type."""

    axis: int | None  # None for rank and dtype problems
    expected: str
    actual: str
    why: str

    def __str__(self) -> str:
        return self.why


def _fmt(d: DimItem, order: AtomOrder | None) -> str:
    return str(d) if isinstance(d, Variadic) else format_poly(d, order)


def match(
    pattern: TensorType,
    dims: Sequence[DimItem],
    dtype: DType | DTypeVar,
    binding: Binding,
    free: set[str],
    facts: Facts | None = None,
    order: AtomOrder | None = None,
    free_dtypes: frozenset[str] | set[str] = frozenset(),
) -> list[Mismatch]:
    """Match ``dims``/``dtype`` against ``pattern``, extending ``binding`` with the free generics.

    ``pattern`` must already be in the caller's terms except for the names in ``free`` (the
    function's own dims) and its variadic runs. Returns the mismatches; empty means it matched.
    Dtype generics bind only when named in ``free_dtypes``; any other dtype generic in the pattern
    is a fixed unknown of the scope and matches only itself.
    """
    facts = facts or Facts()
    out: list[Mismatch] = []
    pat = list(pattern.dims)
    var_at = next((i for i, d in enumerate(pat) if isinstance(d, Variadic)), None)
    act = list(dims)
    if var_at is None:
        if len(act) != len(pat) or any(isinstance(d, Variadic) for d in act):
            return [Mismatch(None, str(len(pat)), str(len(act)),
                             f"rank {len(act)} where {len(pat)} axes are declared")]
        pairs = list(zip(range(len(pat)), pat, act))
    else:
        pre, post = pat[:var_at], pat[var_at + 1:]
        act_var = [i for i, d in enumerate(act) if isinstance(d, Variadic)]
        if act_var:  # the actual's own run must fall inside the pattern's run
            fits = act_var[0] >= len(pre) and len(act) - 1 - act_var[0] >= len(post)
        else:
            fits = len(act) >= len(pre) + len(post)
        if not fits:
            return [Mismatch(None, f">= {len(pre) + len(post)}", str(len(act)),
                             f"{len(act)} axes where at least {len(pre) + len(post)} are declared")]
        run = tuple(act[len(pre): len(act) - len(post)])
        name = pat[var_at].name  # type: ignore[union-attr]
        if name in binding.shapes and binding.shapes[name] != run:
            bound = ", ".join(_fmt(d, order) for d in binding.shapes[name])
            got = ", ".join(_fmt(d, order) for d in run)
            if binding.shapes[name] == (Variadic(name),):
                why = f"*{name} must be the arguments' own *{name}, here [{got}]"
            else:
                why = f"*{name} is [{bound}] from an earlier argument, here [{got}]"
            out.append(Mismatch(None, bound, got, why))
        binding.shapes.setdefault(name, run)
        pairs = [(i, p, act[i]) for i, p in enumerate(pre)]
        pairs += [(len(act) - len(post) + j, p, act[len(act) - len(post) + j]) for j, p in enumerate(post)]

    for axis, p, a in pairs:
        assert isinstance(p, Poly)
        if isinstance(a, Variadic):
            out.append(Mismatch(axis, _fmt(p, order), str(a), f"axis {axis}: a variadic run {a} where "
                                f"{_fmt(p, order)} is declared"))
            continue
        sym = p.as_atom()
        if sym is not None and getattr(sym, "name", None) in free and sym.name not in binding.dims:  # type: ignore[attr-defined]
            binding.dims[sym.name] = a  # type: ignore[attr-defined]
            continue
        want = substitute(p, binding.dims)
        # the declared axis's own free generics not bound yet (the bound value may reuse a name: the
        # caller's ``B`` bound to the callee's ``B``)
        unbound = [s.name for s in p.symbols() if s.name in free and s.name not in binding.dims]
        if unbound:
            out.append(Mismatch(axis, _fmt(want, order), _fmt(a, order),
                                f"axis {axis}: cannot infer {', '.join(unbound)} from {_fmt(a, order)}"))
            continue
        if not facts.equal(want, a):
            out.append(Mismatch(axis, _fmt(want, order), _fmt(a, order),
                                f"axis {axis} is {_fmt(a, order)}, declared {_fmt(want, order)}"
                                + _origin(p, want, binding, order) + facts.witness("eq", a, want)))

    want_dtype = pattern.dtype
    if isinstance(want_dtype, DTypeVar) and want_dtype.name in binding.dtypes:
        want_dtype = binding.dtypes[want_dtype.name]
    if isinstance(want_dtype, DTypeVar) and want_dtype.name in free_dtypes:
        # a free dtype generic binds once, to a dtype its kind admits
        if isinstance(dtype, DType) and not KINDS[want_dtype.kind].admits(dtype):
            out.append(Mismatch(None, str(want_dtype), str(dtype),
                                f"dtype {dtype} is not a {want_dtype.kind} ({want_dtype.name}: {want_dtype.kind})"))
        elif isinstance(dtype, DTypeVar) and not _kind_within(dtype.kind, want_dtype.kind):
            out.append(Mismatch(None, str(want_dtype), str(dtype),
                                f"dtype {dtype}: {dtype.kind} is not always a {want_dtype.kind}"))
        else:
            binding.dtypes[want_dtype.name] = dtype
    elif want_dtype != dtype:
        # a dtype generic of the scope (``T``) is one unknown dtype: it equals only itself, never a
        # concrete dtype (``f32`` is not ``T`` when T may be bf16)
        why = f"dtype {dtype}, declared {want_dtype}"
        if isinstance(want_dtype, DTypeVar) or isinstance(dtype, DTypeVar):
            why += " (a dtype generic equals only itself; cast explicitly)"
        out.append(Mismatch(None, str(want_dtype), str(dtype), why))
    return out


def _kind_within(inner: str, outer: str) -> bool:
    return set(KINDS[inner].members) <= set(KINDS[outer].members)


def _origin(p: Poly, want: Poly, binding: Binding, order: AtomOrder | None) -> str:
    """`` (B = 2 from an earlier argument)`` when a function generic explains the expectation."""
    names = [s.name for s in p.symbols() if s.name in binding.dims]
    if not names:
        return ""
    said = ", ".join(f"{n} = {format_poly(binding.dims[n], order)}" for n in names)
    return f" ({said} from an earlier argument)"
