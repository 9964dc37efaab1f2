"""Dimensions as canonical polynomials.

A dimension is a polynomial with integer coefficients over *atoms*: symbols, and floor division,
modulo, min and max of canonical polynomials. Atoms are interned, so two equal expressions are the
same object structurally and compare equal with ``==``. Operations fold what they can prove from the
structure alone (``(4 * H + 2) / 2`` is ``2 * H + 1``); facts from ``where`` clauses live in
:mod:`kestrel.shapes.facts`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Union

__all__ = [
    "ONE", "ZERO", "Atom", "AtomOrder", "FloorDiv", "Max", "Min", "Mod", "Poly", "Sym", "evaluate", "floordiv",
    "format_poly", "maximum", "minimum", "mod", "substitute",
]

# ----------------------------------------------------------------------------------------- atoms

_next_id = itertools.count()
_interned: dict[tuple, Atom] = {}


class Atom:
    """An indivisible factor of a monomial. Interned: build atoms with the ``make`` class methods."""

    __slots__ = ("id", "key")
    id: int
    key: tuple

    def __new__(cls, key: tuple) -> Atom:  # interning constructor, use the make_* helpers
        found = _interned.get(key)
        if found is not None:
            return found
        atom = object.__new__(cls)
        atom.id = next(_next_id)
        atom.key = key
        _interned[key] = atom
        return atom

    def __reduce__(self):  # atoms pickle by key and re-intern
        return (type(self), (self.key,))

    def __lt__(self, other: Atom) -> bool:
        return self.id < other.id

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self})"

    def children(self) -> tuple[Poly, ...]:
        return ()


class Sym(Atom):
    """A named dimension: a generic such as ``D`` or ``B``."""

    __slots__ = ()

    def __new__(cls, name: str) -> Sym:  # type: ignore[misc]
        return super().__new__(cls, ("sym", name))  # type: ignore[return-value]

    def __reduce__(self):
        return (Sym, (self.name,))

    @property
    def name(self) -> str:
        return self.key[1]

    def __str__(self) -> str:
        return self.name


class _Binary(Atom):
    """An atom over two canonical polynomials."""

    __slots__ = ()
    tag = ""  # the atom's kind in its key, given in the class header: ``class Mod(_Binary, tag="mod")``

    def __init_subclass__(cls, tag: str = "", **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.tag = tag

    def __new__(cls, a: Poly, b: Poly) -> _Binary:  # type: ignore[misc]
        return super().__new__(cls, (cls.tag, a, b))  # type: ignore[return-value]

    def __reduce__(self):
        return (type(self), (self.key[1], self.key[2]))

    @property
    def a(self) -> Poly:
        return self.key[1]

    @property
    def b(self) -> Poly:
        return self.key[2]

    def children(self) -> tuple[Poly, ...]:
        return (self.a, self.b)

    def __str__(self) -> str:
        return format_poly(Poly.atom(self))


class FloorDiv(_Binary, tag="div"):
    __slots__ = ()


class Mod(_Binary, tag="mod"):
    __slots__ = ()


class Min(_Binary, tag="min"):
    __slots__ = ()


class Max(_Binary, tag="max"):
    __slots__ = ()


# ------------------------------------------------------------------------------------ polynomials

Monomial = tuple[Atom, ...]  # atoms sorted by id, repeated for powers; () is the constant monomial
DimLike = Union["Poly", int]


class Poly:
    """A canonical polynomial: an immutable map from monomials to nonzero integer coefficients."""

    __slots__ = ("_hash", "terms")
    terms: tuple[tuple[Monomial, int], ...]

    def __init__(self, terms: Mapping[Monomial, int] | Iterable[tuple[Monomial, int]] = ()) -> None:
        items = terms.items() if isinstance(terms, Mapping) else terms
        acc: dict[Monomial, int] = {}
        for mono, coef in items:
            acc[mono] = acc.get(mono, 0) + coef
        self.terms = tuple(sorted(((m, c) for m, c in acc.items() if c != 0), key=_mono_key))
        self._hash = hash(self.terms)

    # construction ---------------------------------------------------------------------------
    @staticmethod
    def const(value: int) -> Poly:
        return Poly({(): int(value)})

    @staticmethod
    def atom(a: Atom) -> Poly:
        return Poly({(a,): 1})

    @staticmethod
    def sym(name: str) -> Poly:
        return Poly.atom(Sym(name))

    @staticmethod
    def of(value: DimLike) -> Poly:
        if isinstance(value, Poly):
            return value
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"a dimension must be an int or a Poly, not {type(value).__name__}")
        return Poly.const(value)

    # queries --------------------------------------------------------------------------------
    @property
    def is_const(self) -> bool:
        return all(m == () for m, _ in self.terms)

    @property
    def value(self) -> int:
        """The integer value of a constant polynomial."""
        if not self.is_const:
            raise ValueError(f"{format_poly(self)} is not a constant")
        return self.terms[0][1] if self.terms else 0

    def const_term(self) -> int:
        return dict(self.terms).get((), 0)

    def as_atom(self) -> Atom | None:
        """The atom if this polynomial is exactly one atom with coefficient 1."""
        if len(self.terms) == 1 and self.terms[0][1] == 1 and len(self.terms[0][0]) == 1:
            return self.terms[0][0][0]
        return None

    def atoms(self) -> list[Atom]:
        """Every atom in this polynomial, nested ones included, each once, in creation order."""
        seen: dict[Atom, None] = {}

        def walk(p: Poly) -> None:
            for mono, _ in p.terms:
                for a in mono:
                    for child in a.children():
                        walk(child)
                    seen.setdefault(a, None)

        walk(self)
        return sorted(seen)

    def symbols(self) -> list[Sym]:
        return [a for a in self.atoms() if isinstance(a, Sym)]

    # arithmetic -----------------------------------------------------------------------------
    def __add__(self, other: DimLike) -> Poly:
        other = Poly.of(other)
        return Poly(list(self.terms) + list(other.terms))

    __radd__ = __add__

    def __neg__(self) -> Poly:
        return Poly((m, -c) for m, c in self.terms)

    def __sub__(self, other: DimLike) -> Poly:
        return self + (-Poly.of(other))

    def __rsub__(self, other: DimLike) -> Poly:
        return Poly.of(other) - self

    def __mul__(self, other: DimLike) -> Poly:
        other = Poly.of(other)
        out: list[tuple[Monomial, int]] = []
        for m1, c1 in self.terms:
            for m2, c2 in other.terms:
                out.append((tuple(sorted(m1 + m2)), c1 * c2))
        return Poly(out)

    __rmul__ = __mul__

    def __floordiv__(self, other: DimLike) -> Poly:
        return floordiv(self, Poly.of(other))

    def __rfloordiv__(self, other: DimLike) -> Poly:
        return floordiv(Poly.of(other), self)

    def __mod__(self, other: DimLike) -> Poly:
        return mod(self, Poly.of(other))

    def __rmod__(self, other: DimLike) -> Poly:
        return mod(Poly.of(other), self)

    # identity -------------------------------------------------------------------------------
    def __eq__(self, other: object) -> bool:
        if isinstance(other, int) and not isinstance(other, bool):
            other = Poly.const(other)
        return isinstance(other, Poly) and self.terms == other.terms

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self):
        return (Poly, (self.terms,))

    def __repr__(self) -> str:
        return f"Poly({format_poly(self)})"

    def __str__(self) -> str:
        return format_poly(self)


def _mono_key(item: tuple[Monomial, int]) -> tuple:
    mono = item[0]
    return (len(mono) > 0, tuple(a.id for a in mono))


ZERO = Poly()
ONE = Poly.const(1)

# ---------------------------------------------------------------------------- folding operations


def _split_by(n: Poly, d: Poly) -> tuple[Poly, Poly] | None:
    """Write n = d * q + r where d is a single term and r keeps the terms d does not divide.

    For a constant divisor c each coefficient a splits as a = c * (a // c) + a % c, which is valid
    under the floor: floor((d * q + r) / d) = q + floor(r / d) whenever q is an integer.
    Returns None when d is not a single term.
    """
    if len(d.terms) != 1:
        return None
    dmono, dcoef = d.terms[0]
    if dcoef <= 0:
        return None
    q: list[tuple[Monomial, int]] = []
    r: list[tuple[Monomial, int]] = []
    for mono, coef in n.terms:
        rest = _mono_divide(mono, dmono)
        if rest is None:
            r.append((mono, coef))
            continue
        if dmono:  # symbolic divisor: only exact coefficients move into the quotient
            if coef % dcoef == 0:
                q.append((rest, coef // dcoef))
            else:
                r.append((mono, coef))
        else:
            q.append((rest, coef // dcoef))
            if coef % dcoef:
                r.append((mono, coef % dcoef))
    return Poly(q), Poly(r)


def _mono_divide(mono: Monomial, by: Monomial) -> Monomial | None:
    rest = list(mono)
    for a in by:
        if a not in rest:
            return None
        rest.remove(a)
    return tuple(rest)


def _content_gcd(p: Poly) -> int:
    from math import gcd

    g = 0
    for _, c in p.terms:
        g = gcd(g, abs(c))
    return g


def floordiv(n: Poly, d: Poly) -> Poly:
    """floor(n / d) in canonical form. The divisor must be positive (the checker proves it)."""
    if d.is_const:
        if d.value == 0:
            raise ZeroDivisionError(f"division of {format_poly(n)} by zero")
        if d.value < 0:
            return floordiv(-n, -d)
        if d.value == 1:
            return n
        if n.is_const:
            return Poly.const(n.value // d.value)
    common = _common_monomial(n, d)
    if common:  # floor(m * a / (m * b)) == floor(a / b): the divisor is positive, so m is not 0
        return floordiv(_strip(n, common), _strip(d, common))
    if len(d.terms) > 1:
        exact = exact_quotient(n, d)
        if exact is not None:  # n == d * q as polynomials: the floor is q
            return exact
        content = _common_monomial(d, d)
        if content:  # d = c * d' with d' dividing n: floor(n / d) = floor((n / d') / c)
            inner = exact_quotient(n, _strip(d, content))
            if inner is not None:
                return floordiv(inner, Poly({content: 1}))
    split = _split_by(n, d)
    if split is not None:
        q, r = split
        if r == ZERO:
            return q
        if q != ZERO:
            return q + floordiv(r, d)
        n = r
    if n == ZERO:
        return ZERO
    # floor(k * a / (k * b)) == floor(a / b) for a positive common factor k of every coefficient
    from math import gcd

    g = gcd(_content_gcd(n), _content_gcd(d))
    if g > 1 and all(c > 0 for _, c in d.terms):
        n = Poly((m, c // g) for m, c in n.terms)
        d = Poly((m, c // g) for m, c in d.terms)
        return floordiv(n, d)
    # floor(floor(a / b) / c) == floor(a / (b * c)) for positive b, c
    inner = n.as_atom()
    if isinstance(inner, FloorDiv):
        return floordiv(inner.a, inner.b * d)
    return Poly.atom(FloorDiv(n, d))


def _lead(p: Poly) -> tuple[Monomial, int]:
    """The leading term in graded order over atom ids (a fixed monomial order)."""
    return max(p.terms, key=lambda t: (len(t[0]), sorted((a.id for a in t[0]), reverse=True)))


def exact_quotient(n: Poly, d: Poly) -> Poly | None:
    """q with ``n == d * q`` as polynomials over the atoms, or None.

    Division by one polynomial in a fixed monomial order leaves a unique remainder, zero exactly
    when d divides n; integer coefficients must divide too (otherwise None: not proved).
    """
    if d == ZERO:
        return None
    dm, dc = _lead(d)
    q: list[tuple[Monomial, int]] = []
    r = n
    for _ in range(64):
        if r == ZERO:
            return Poly(q)
        rm, rc = _lead(r)
        rest = _mono_divide(rm, dm)
        if rest is None or rc % dc:
            return None
        term = Poly({tuple(sorted(rest)): rc // dc})
        q.append((tuple(sorted(rest)), rc // dc))
        r = r - d * term
    return None


def _common_monomial(n: Poly, d: Poly) -> Monomial:
    common: list[Atom] | None = None
    for mono, _ in (*n.terms, *d.terms):
        if common is None:
            common = list(mono)
            continue
        rest, keep = list(mono), []
        for a in common:
            if a in rest:
                rest.remove(a)
                keep.append(a)
        common = keep
        if not common:
            break
    return tuple(sorted(common or ()))


def _strip(p: Poly, m: Monomial) -> Poly:
    out = []
    for mono, c in p.terms:
        rest = list(mono)
        for a in m:
            rest.remove(a)
        out.append((tuple(rest), c))
    return Poly(out)


def mod(n: Poly, d: Poly) -> Poly:
    """n mod d (floor semantics, result in [0, d)) in canonical form."""
    if d.is_const:
        if d.value == 0:
            raise ZeroDivisionError(f"{format_poly(n)} modulo zero")
        if d.value == 1:
            return ZERO
        if n.is_const:
            return Poly.const(n.value % d.value)
    n = _unwrap_mods(n, d)  # (a + c * (y % d)) mod d == (a + c * y) mod d
    split = _split_by(n, d)
    if split is not None:
        n = split[1]  # (d * q + r) mod d == r mod d
    if n == ZERO:
        return ZERO
    if d.is_const and n.is_const:  # the remainder may have become a constant: (2 * H + 1) % 2 is 1
        return Poly.const(n.value % d.value)
    return Poly.atom(Mod(n, d))


def _unwrap_mods(n: Poly, d: Poly) -> Poly:
    """Replace each term ``c * (y % d)`` of n by ``c * y``: the same value modulo d."""
    for _ in range(8):
        out: list[tuple[Monomial, int]] = []
        changed = False
        for mono, coef in n.terms:
            if len(mono) == 1 and isinstance(mono[0], Mod) and mono[0].b == d:
                out.extend((m, coef * c) for m, c in mono[0].a.terms)
                changed = True
            else:
                out.append((mono, coef))
        if not changed:
            return n
        n = Poly(out)
    return n


def _structurally_nonneg(p: Poly) -> bool:
    """Nonnegative for every binding of the symbols to natural numbers, from the structure alone.

    Divisors are positive (the checker proves it), so ``n / d`` is nonnegative when ``n`` is and
    ``n % d`` always is; symbols are natural numbers.
    """
    return all(c >= 0 for _, c in p.terms) and all(_atom_nonneg(a) for m, _ in p.terms for a in m)


def _atom_nonneg(a: Atom) -> bool:
    if isinstance(a, Sym):
        return True
    if isinstance(a, Mod):  # a negative constant divisor gives a remainder in (d, 0]
        return _structurally_nonneg(a.b)
    if isinstance(a, FloorDiv):
        return _structurally_nonneg(a.a)
    if isinstance(a, Min):
        return _structurally_nonneg(a.a) and _structurally_nonneg(a.b)
    if isinstance(a, Max):
        return _structurally_nonneg(a.a) or _structurally_nonneg(a.b)
    return False


def _operand_key(p: Poly) -> tuple:
    """A total order on polynomials, so ``min(a, b)`` and ``min(b, a)`` intern the same atom."""
    return tuple((_mono_key(t), t[1]) for t in p.terms)


def _extremum(a: Poly, b: Poly, smaller: bool) -> Poly:
    """``min(a, b)`` (``smaller``) or ``max(a, b)``: folded where the order is structural, else one
    atom whose operands are sorted, so both argument orders intern the same atom."""
    if a.is_const and b.is_const:
        return Poly.const(min(a.value, b.value) if smaller else max(a.value, b.value))
    if a == b or _structurally_nonneg(b - a):  # a <= b
        return a if smaller else b
    if _structurally_nonneg(a - b):  # b <= a
        return b if smaller else a
    x, y = sorted((a, b), key=_operand_key)
    return Poly.atom(Min(x, y) if smaller else Max(x, y))


def minimum(a: Poly, b: Poly) -> Poly:
    return _extremum(a, b, smaller=True)


def maximum(a: Poly, b: Poly) -> Poly:
    return _extremum(a, b, smaller=False)


_REBUILD = {FloorDiv: floordiv, Mod: mod, Min: minimum, Max: maximum}


def substitute(p: Poly, binding: Mapping[str, DimLike]) -> Poly:
    """Replace symbols by polynomials or ints and re-canonicalise (divisions fold as they can)."""
    if not binding:
        return p
    cache: dict[Atom, Poly] = {}

    def atom_value(a: Atom) -> Poly:
        if a in cache:
            return cache[a]
        if isinstance(a, Sym):
            v = binding.get(a.name)
            out = Poly.of(v) if v is not None else Poly.atom(a)
        else:
            assert isinstance(a, _Binary)
            out = _REBUILD[type(a)](substitute(a.a, binding), substitute(a.b, binding))
        cache[a] = out
        return out

    return rebuild(p, atom_value)


def rebuild(p: Poly, atom_value: Callable[[Atom], Poly]) -> Poly:
    """``p`` with each atom replaced by ``atom_value`` of it, re-canonicalised (the caller caches)."""
    total = ZERO
    for mono, coef in p.terms:
        term = Poly.const(coef)
        for a in mono:
            term = term * atom_value(a)
        total = total + term
    return total


def evaluate(p: Poly, binding: Mapping[str, int]) -> int:
    """The integer value of p at a complete binding of its symbols."""
    out = substitute(p, binding)
    if not out.is_const:
        missing = ", ".join(s.name for s in out.symbols())
        raise KeyError(f"{format_poly(p)} has unbound generics: {missing}")
    return out.value


# -------------------------------------------------------------------------------------- printing


class AtomOrder:
    """The order in which a block first uses its atoms; terms print in this order.

    Atoms that were never registered sort after the registered ones, in creation order.
    """

    def __init__(self) -> None:
        self._index: dict[Atom, int] = {}

    def register(self, p: Poly) -> None:
        for a in p.atoms():
            self._index.setdefault(a, len(self._index))

    def key(self, a: Atom) -> tuple[int, int]:
        i = self._index.get(a)
        return (0, i) if i is not None else (1, a.id)

    def copy(self) -> AtomOrder:
        out = AtomOrder()
        out._index = dict(self._index)
        return out


_DEFAULT_ORDER = AtomOrder()


def format_poly(p: Poly, order: AtomOrder | None = None) -> str:
    """Print as the seeds do: constant first, then terms in atom order, ``c * X``, ``a / b``."""
    order = order or _DEFAULT_ORDER
    if not p.terms:
        return "0"
    const = p.const_term()
    rest = [(tuple(sorted(m, key=order.key)), c) for m, c in p.terms if m]
    rest.sort(key=lambda t: [order.key(a) for a in t[0]])
    parts = [str(const)] if const else []
    for mono, coef in rest:
        alone = coef == 1 and len(mono) == 1
        factors = [_format_atom(a, order, alone) for a in mono]
        if coef != 1:
            factors.insert(0, str(coef))
        parts.append(" * ".join(factors))
    return " + ".join(parts)


def _format_operand(p: Poly, order: AtomOrder) -> str:
    simple = (p.is_const and p.value >= 0) or isinstance(p.as_atom(), Sym)
    text = format_poly(p, order)
    return text if simple else f"({text})"


def _format_atom(a: Atom, order: AtomOrder, alone: bool) -> str:
    if isinstance(a, Sym):
        return a.name
    assert isinstance(a, _Binary)
    if isinstance(a, (Min, Max)):
        name = "min" if isinstance(a, Min) else "max"
        return f"{name}({format_poly(a.a, order)}, {format_poly(a.b, order)})"
    op = "/" if isinstance(a, FloorDiv) else "%"
    text = f"{_format_operand(a.a, order)} {op} {_format_operand(a.b, order)}"
    return text if alone else f"({text})"


def ge_text(p: Poly, order: AtomOrder | None = None, strict: bool = False) -> str:
    """``p >= 0`` (``p > 0`` when strict) as a reader writes it: negative terms moved right."""
    pos = Poly([t for t in p.terms if t[1] > 0])
    neg = -Poly([t for t in p.terms if t[1] < 0])
    if not strict and neg == Poly.const(1):  # ``D >= 1`` reads ``D > 0``
        return f"{format_poly(pos, order)} > 0"
    return f"{format_poly(pos, order)} {'>' if strict else '>='} {format_poly(neg, order)}"
