"""Facts from ``where`` clauses and the prover over them.

The prover answers three questions about canonical polynomials: are two dimensions equal, is a
dimension nonnegative (or positive), does one divide another. ``False`` means "cannot prove", and
the checker then names the missing fact. A small hand-written prover answers the common questions
fast; what it cannot prove goes to the SMT solver (:mod:`kestrel.shapes.smt`), whose answer under
Python's floor semantics is the last word (tests cross-check the fast path against z3 and against
brute force over small bindings).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from . import smt
from .poly import (
    ZERO,
    Atom,
    FloorDiv,
    Max,
    Min,
    Mod,
    Poly,
    Sym,
    _Binary,
    exact_quotient,
    floordiv,
    format_poly,
    mod,
    rebuild,
    substitute,
)

__all__ = ["Fact", "Facts"]


@dataclass(frozen=True)
class Fact:
    """One ``where`` fact: ``lhs > rhs``, ``lhs >= rhs``, ``lhs == rhs`` or ``d | n``."""

    kind: str  # "ge" (lhs - rhs >= 0), "eq" (lhs == rhs), "divides" (lhs divides rhs)
    lhs: Poly
    rhs: Poly
    text: str = ""

    def __str__(self) -> str:
        return self.text or f"{format_poly(self.lhs)} {self.kind} {format_poly(self.rhs)}"


@dataclass
class Facts:
    """What a block's ``where`` clause lets the checker assume about its generics."""

    facts: list[Fact] = field(default_factory=list)
    _cache_key: tuple | None = field(default=None, repr=False, compare=False)
    _cache: tuple = field(default=(), repr=False, compare=False)

    def add(self, fact: Fact) -> None:
        self.facts.append(fact)

    # normalisation --------------------------------------------------------------------------
    def _equalities(self) -> dict[str, Poly]:
        subst: dict[str, Poly] = {}
        for f in self.facts:
            if f.kind != "eq":
                continue
            for a, b in ((f.lhs, f.rhs), (f.rhs, f.lhs)):
                s = a.as_atom()
                if isinstance(s, Sym) and s.name not in subst and s not in b.atoms():
                    subst[s.name] = b
                    break
        return subst

    def _divisors(self) -> list[tuple[Poly, Poly]]:
        out = []
        for f in self.facts:
            if f.kind == "divides":
                out.append((f.lhs, f.rhs))
            elif f.kind == "eq" and f.rhs == ZERO:  # ``n % d == 0``
                a = f.lhs.as_atom()
                if isinstance(a, Mod):
                    out.append((a.b, a.a))
        return out

    def simplify(self, p: Poly) -> Poly:
        """Rewrite p with the equalities, and ``d * (n / d)`` to ``n`` where ``d`` divides ``n``.

        The operands of nested atoms are simplified first (``(H * (D / H)) / K`` is ``D / K``
        when ``H`` divides ``D``).
        """
        p = _map_atoms(p, self.simplify)
        return self._simplify_top(p)

    def _simplify_top(self, p: Poly) -> Poly:
        subst = self._equalities()
        for _ in range(4):  # equalities may chain; a few rounds reach the fixed point here
            q = substitute(p, subst)
            if q == p:
                break
            p = q
        divisors = [(substitute(d, subst), substitute(n, subst)) for d, n in self._divisors()]
        # quotients that are exact from their structure (``(H + (-H) % W) / W``) cancel too
        divisors += [(a.b, a.a) for a in p.atoms() if isinstance(a, FloorDiv) and mod(a.a, a.b) == ZERO]
        if not divisors:
            return p
        return _cancel_exact_divisions(p, divisors)

    # questions ------------------------------------------------------------------------------
    def fast_equal(self, a: Poly, b: Poly) -> bool:
        """The hand prover's ``a == b`` (no solver)."""
        return self.simplify(a - b) == ZERO

    def fast_nonneg(self, p: Poly) -> bool:
        """The hand prover's ``p >= 0`` (no solver): for every binding the facts allow (``False``: cannot prove).

        Lower bounds ``X >= c`` shift ``X`` to ``c + X'`` with ``X'`` natural; then ``p`` is
        nonnegative if it is a nonnegative combination of the (shifted) ``>=`` facts plus a
        polynomial that is nonnegative from its structure (natural symbols, nonnegative
        coefficients, atoms proved nonnegative the same way). Relational facts such as
        ``H >= K`` or ``H - K - 2 * P >= 0`` enter through that combination.
        """
        p = self.simplify(p)
        shift, ges = self._shifted_facts()
        p = substitute(p, shift)
        ges = ges + [g for g in _quotient_bounds(p) if g not in ges]
        return _nonneg(p, ges, _DEPTH)

    def nonneg(self, p: Poly) -> bool:
        """``p >= 0`` for every binding the facts allow (``False``: cannot prove)."""
        return self.fast_nonneg(p) or self._smt("ge", p, ZERO)

    def equal(self, a: Poly, b: Poly) -> bool:
        return self.fast_equal(a, b) or self._smt("eq", a, b)

    def divides(self, d: Poly, n: Poly) -> bool:
        return self.fast_divides(d, n) or self._smt("divides", d, n)

    def counterexample(self, kind: str, lhs: Poly, rhs: Poly = ZERO) -> dict[str, int] | None:
        """A binding the facts allow at which ``lhs >= rhs`` (``ge``), ``lhs == rhs`` (``eq``) or ``lhs | rhs``
        (``divides``) fails, as z3 finds it; None when it finds none (or the statement holds)."""
        return smt.counterexample(self._statements(), smt.Statement(kind, lhs, rhs))

    def witness(self, kind: str, lhs: Poly, rhs: Poly = ZERO) -> str:
        """`` (at H = 5, K = 2: 4 against 5)``: a counterexample z3 finds, as a concrete binding with both
        sides' values there; empty when the statement is constant or no counterexample is found."""
        if lhs.is_const and rhs.is_const:
            return ""
        found = self.counterexample(kind, lhs, rhs)
        if not found:
            return ""
        names = list(dict.fromkeys(s.name for p in (lhs, rhs) for s in _all_symbols(p)))  # as written
        if any(n not in found for n in names):
            return ""
        binding = ", ".join(f"{n} = {found[n]}" for n in names)
        a, b = smt.evaluate(lhs, found), smt.evaluate(rhs, found)
        if a is None or b is None:
            return f" (fails at {binding})"
        return f" (at {binding}: {a} against {b})"

    def satisfiable_with(self, more: list[Fact]) -> bool | None:
        """Whether some binding satisfies these facts and ``more`` (None: the solver could not tell)."""
        return smt.satisfiable([*self._statements(), *(smt.Statement(f.kind, f.lhs, f.rhs) for f in more)])

    def _statements(self) -> tuple[smt.Statement, ...]:
        return tuple(smt.Statement(f.kind, f.lhs, f.rhs) for f in self.facts)

    def _smt(self, kind: str, lhs: Poly, rhs: Poly) -> bool:
        return smt.proves(self._statements(), smt.Statement(kind, lhs, rhs))

    def positive(self, p: Poly) -> bool:
        return self.nonneg(p - 1)

    def fast_divides(self, d: Poly, n: Poly) -> bool:
        """The hand prover's ``d | n`` (no solver)."""
        if d == ZERO:
            return False
        common, d2, n2 = _common_factor(d, n)  # m * d' divides m * n' when d' divides n'
        if common is not None:
            return self.fast_divides(d2, n2)
        if n == ZERO or mod(n, d) == ZERO or (d.is_const and d.value in (1, -1)):
            return True
        if len(d.terms) > 1:
            if exact_quotient(n, d) is not None:
                return True
            common, _, rest = _common_factor(d, d)  # d = c * d': d' | n and c | n / d'
            if common is not None and len(rest.terms) > 1:
                inner = exact_quotient(n, rest)
                if inner is not None:
                    return self.fast_divides(common, inner)
        d, n = self.simplify(d), self.simplify(n)
        if n == ZERO or mod(n, d) == ZERO:
            return True
        common, d2, n2 = _common_factor(d, n)
        if common is not None:
            return self.fast_divides(d2, n2)
        if any(self.fast_equal(d, fd) and self.fast_equal(n, fn) for fd, fn in self._divisors()):
            return True
        # d | a and d | b give d | (a * k + b * l): split n into terms the known divisors cover
        return _covered(n, d, [fn for fd, fn in self._divisors() if self.fast_equal(d, fd)])

    # helpers --------------------------------------------------------------------------------
    def _shifted_facts(self) -> tuple[dict[str, Poly], list[Poly]]:
        """The shift ``X -> c + X'`` from the lower bounds, and every ``>=`` fact as ``g >= 0`` over X'."""
        key = tuple(self.facts)
        if self._cache_key != key:
            lows = self._lower_bounds()
            shift = {name: Poly.sym(name) + low for name, low in lows.items() if low != 0}
            ges: list[Poly] = []
            for f in self.facts:
                if f.kind == "ge":
                    g = substitute(self.simplify(f.lhs - f.rhs), shift)
                    if g != ZERO and not _structural(g) and g not in ges:
                        ges.append(g)
            for g in list(ges):
                ges += [b for b in _quotient_bounds(g) if b not in ges]
            self._cache = (shift, ges)
            self._cache_key = key
        return self._cache

    def _lower_bounds(self) -> dict[str, int]:
        """``X >= c`` for the facts of the form ``X + k >= c`` (``X > 0``, ``X >= 1``, ``X > 2``)."""
        lows: dict[str, int] = {}
        for f in self.facts:
            if f.kind == "ge" and f.rhs.is_const:
                k = f.lhs.const_term()
                s = (f.lhs - k).as_atom()
                if isinstance(s, Sym):
                    lows[s.name] = max(lows.get(s.name, 0), f.rhs.value - k)
        return lows


_DEPTH = 3


def _all_symbols(p: Poly) -> list[Sym]:
    """Every symbol of p, inside atoms too."""
    out: list[Sym] = []
    for mono, _ in p.terms:
        for a in mono:
            if isinstance(a, Sym):
                out.append(a)
            elif isinstance(a, _Binary):
                out += _all_symbols(a.a) + _all_symbols(a.b)
    return out


def _structural(p: Poly) -> bool:
    return _nonneg(p, [], 0)


def _nonneg(p: Poly, ges: list[Poly], depth: int, proving: frozenset[Atom] = frozenset()) -> bool:
    """p >= 0 over natural symbols, given ``g >= 0`` for each g in ``ges``.

    Sound by construction: it only ever returns True for ``p = sum(k_i * g_i) + q`` with integers
    ``k_i >= 0`` and ``q`` nonnegative term by term. ``proving`` holds the atoms whose own
    nonnegativity is being proved further up: meeting one again is a cycle (``(P % Q) / 2`` with its
    quotient bounds led back to itself), answered "cannot prove".
    """
    bad = [(m, c) for m, c in p.terms if c < 0 or not all(_atom_nonneg(a, ges, proving) for a in m)]
    if not bad:
        return True
    if depth == 0 or not ges:
        return False
    mono, coef = bad[0]
    for g in ges:
        cg = dict(g.terms).get(mono, 0)
        if coef < 0 and cg < 0:
            k = -(coef // -cg)  # ceil(|coef| / |cg|): the term becomes nonnegative
        elif coef > 0 and cg > 0 and coef % cg == 0:
            k = coef // cg  # an atom not known nonnegative: cancel it exactly
        else:
            continue
        if _nonneg(p - k * g, ges, depth - 1, proving):
            return True
    return False


def _quotient_bounds(p: Poly) -> list[Poly]:
    """``n - c * q >= 0`` and ``c * q + c - 1 - n >= 0`` for each quotient ``q = n / c`` in p (c > 0)."""
    out = []
    for a in p.atoms():
        if isinstance(a, FloorDiv) and a.b.is_const and a.b.value > 0:
            c, q = a.b.value, Poly.atom(a)
            out += [a.a - c * q, c * q + (c - 1) - a.a]
    return out



def _atom_nonneg(a: Atom, ges: list[Poly], proving: frozenset[Atom] = frozenset()) -> bool:
    if isinstance(a, Sym):
        return True  # every dimension is a natural number
    assert isinstance(a, _Binary)
    if a in proving:
        return False
    inner = proving | {a}

    def nonneg(p: Poly) -> bool:
        return _nonneg(p, ges, _DEPTH, inner)

    if isinstance(a, Mod):
        return nonneg(a.b - 1)
    if isinstance(a, FloorDiv):
        return nonneg(a.a) and nonneg(a.b - 1)
    if isinstance(a, Min):
        return nonneg(a.a) and nonneg(a.b)
    if isinstance(a, Max):
        return nonneg(a.a) or nonneg(a.b)
    return False


def _monomial_gcd(polys: list[Poly]) -> tuple[Atom, ...]:
    common: list[Atom] | None = None
    for p in polys:
        for mono, _ in p.terms:
            if common is None:
                common = list(mono)
            else:
                rest = list(mono)
                keep = []
                for a in common:
                    if a in rest:
                        rest.remove(a)
                        keep.append(a)
                common = keep
    return tuple(sorted(common or ()))


def _common_factor(d: Poly, n: Poly) -> tuple[Poly | None, Poly, Poly]:
    """``d = m * d'`` and ``n = m * n'`` for the largest common monomial ``m`` (None if it is 1)."""
    from math import gcd

    m = _monomial_gcd([d, n])
    g = 0
    for _, c in (*d.terms, *n.terms):
        g = gcd(g, abs(c))
    if not m and g <= 1:
        return None, d, n
    g = max(g, 1)

    def div(p: Poly) -> Poly:
        out = []
        for mono, c in p.terms:
            rest = list(mono)
            for a in m:
                rest.remove(a)
            out.append((tuple(rest), c // g))
        return Poly(out)

    return Poly([(m, g)]), div(d), div(n)


def _covered(n: Poly, d: Poly, known: list[Poly]) -> bool:
    """n is a sum of terms each a multiple of ``d`` or of a known multiple of ``d``."""
    if not known:
        return False
    rest = n
    for fn in known:
        if len(fn.terms) != 1:
            continue
        fmono, fc = fn.terms[0]
        kept = []
        for mono, c in rest.terms:
            left = list(mono)
            ok = all(a in left and not left.remove(a) for a in fmono) and c % fc == 0
            if not ok:
                kept.append((mono, c))
        rest = Poly(kept)
    return rest == ZERO or mod(rest, d) == ZERO


_REBUILD = {FloorDiv: floordiv, Mod: mod}


def _map_atoms(p: Poly, f) -> Poly:
    """p with every floor-division and modulo atom rebuilt from ``f`` of its operands."""
    if all(isinstance(a, Sym) for m, _ in p.terms for a in m):
        return p
    cache: dict[Atom, Poly] = {}

    def atom(a: Atom) -> Poly:
        if a not in cache:
            build = _REBUILD.get(type(a))
            cache[a] = build(f(a.a), f(a.b)) if build is not None else Poly.atom(a)  # type: ignore[attr-defined]
        return cache[a]

    return rebuild(p, atom)


def _cancel_exact_divisions(p: Poly, divisors: list[tuple[Poly, Poly]]) -> Poly:
    """Replace ``d * (n / d)`` by ``n`` and ``n % d`` by 0 in every term, for known ``d | n``."""
    changed = True
    while changed:
        changed = False
        out = ZERO
        for mono, coef in p.terms:
            term = _cancel_term(list(mono), coef, divisors)
            changed |= term is not None
            out = out + (term if term is not None else Poly([(mono, coef)]))
        p = out
    return p


def _cancel_term(mono: list[Atom], coef: int, divisors: list[tuple[Poly, Poly]]) -> Poly | None:
    for i, a in enumerate(mono):
        for d, n in divisors:
            if isinstance(a, Mod) and a.a == n and a.b == d:
                return ZERO
            if not (isinstance(a, FloorDiv) and a.a == n and a.b == d):
                continue
            rest = mono[:i] + mono[i + 1 :]
            remaining = Poly([(tuple(sorted(rest)), coef)])
            # d * (n / d) * rest  ->  n * rest, when d's monomial is in rest
            q = floordiv(remaining, d)
            if q * d == remaining:
                return q * n
    return None
