"""Facts from ``where`` clauses and a small sound prover over them.

The prover answers three questions about canonical polynomials: are two dimensions equal, is a
dimension nonnegative (or positive), does one divide another. It is sound and deliberately
incomplete: ``False`` means "cannot prove", and the checker then names the missing fact.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
    floordiv,
    format_poly,
    mod,
    substitute,
)


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
        """Rewrite p with the equalities, and ``d * (n / d)`` to ``n`` where ``d`` divides ``n``."""
        subst = self._equalities()
        for _ in range(4):  # equalities may chain; a few rounds reach the fixed point here
            q = substitute(p, subst)
            if q == p:
                break
            p = q
        divisors = [(substitute(d, subst), substitute(n, subst)) for d, n in self._divisors()]
        if not divisors:
            return p
        return _cancel_exact_divisions(p, divisors)

    # questions ------------------------------------------------------------------------------
    def equal(self, a: Poly, b: Poly) -> bool:
        return self.simplify(a - b) == ZERO

    def nonneg(self, p: Poly) -> bool:
        p = self.simplify(p)
        if any(f.kind == "ge" and self.simplify(f.lhs - f.rhs) == p for f in self.facts):
            return True  # a relational fact states it (``H + P >= K``)
        lows = self._lower_bounds()
        shift = {name: Poly.sym(name) + low for name, low in lows.items() if low != 0}
        p = substitute(p, shift)  # X >= c: write X as c + X' with X' >= 0
        # From here on p is over the shifted X' (each a natural number): the facts speak of the
        # unshifted X, so nested atoms are judged by their structure only, never shifted again.
        return _nonneg_shifted(p)

    def positive(self, p: Poly) -> bool:
        return self.nonneg(p - 1)

    def divides(self, d: Poly, n: Poly) -> bool:
        d, n = self.simplify(d), self.simplify(n)
        if n == ZERO or mod(n, d) == ZERO:
            return True
        return any(self.equal(d, fd) and self.equal(n, fn) for fd, fn in self._divisors())

    # helpers --------------------------------------------------------------------------------
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


def _nonneg_shifted(p: Poly) -> bool:
    """Structurally nonnegative: coefficients >= 0 over atoms that are (every symbol is natural)."""
    return all(c >= 0 for _, c in p.terms) and all(_atom_nonneg(a) for m, _ in p.terms for a in m)


def _atom_nonneg(a: Atom) -> bool:
    if isinstance(a, Sym):
        return True  # every dimension is a natural number
    assert isinstance(a, _Binary)
    if isinstance(a, Mod):
        return _nonneg_shifted(a.b - 1)
    if isinstance(a, FloorDiv):
        return _nonneg_shifted(a.a) and _nonneg_shifted(a.b - 1)
    if isinstance(a, Min):
        return _nonneg_shifted(a.a) and _nonneg_shifted(a.b)
    if isinstance(a, Max):
        return _nonneg_shifted(a.a) or _nonneg_shifted(a.b)
    return False


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
