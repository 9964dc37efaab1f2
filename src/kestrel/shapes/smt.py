"""The prover's last word: an SMT solver (z3) deciding facts about dimensions under Python's semantics.

Every dimension symbol is a natural number. Each atom becomes a fresh integer with its defining
constraints: ``q = a // b`` as ``b * q <= a < b * q + b`` when ``b > 0`` (and the mirrored bounds when
``b < 0``; nothing when ``b == 0``, where the program would have failed), ``r = a % b`` as ``a - b * q``
with that same ``q``, ``min`` and ``max`` as if-then-else. A statement is proved only when z3 answers
*unsat* for its negation under the facts; ``unknown`` or a timeout means "cannot prove". When z3 finds
a counterexample, :func:`counterexample` gives it as a concrete binding of the symbols.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import z3

from .poly import FloorDiv, Max, Min, Mod, Poly, Sym, _Binary, substitute

TIMEOUT_MS = 2000  # per question; a timeout is "cannot prove", never "proved"


@dataclass(frozen=True)
class Statement:
    """``lhs >= rhs`` (kind ``ge``), ``lhs == rhs`` (``eq``), or ``lhs`` divides ``rhs`` (``divides``: ``rhs % lhs
    == 0`` wherever ``lhs != 0``; a caller that divides proves ``lhs > 0`` on its own)."""

    kind: str
    lhs: Poly
    rhs: Poly


class _Encoder:
    """Polynomials as z3 integer terms; each atom's defining constraints collected in ``side``."""

    def __init__(self) -> None:
        self.syms: dict[str, z3.ArithRef] = {}
        self.atoms: dict[object, z3.ArithRef] = {}
        self.quotients: dict[tuple[Poly, Poly], z3.ArithRef] = {}
        self.side: list[z3.BoolRef] = []
        self.fresh = 0

    def sym(self, name: str) -> z3.ArithRef:
        v = self.syms.get(name)
        if v is None:
            v = self.syms[name] = z3.Int(name)
            self.side.append(v >= 0)  # every dimension is a natural number
        return v

    def _new(self, tag: str) -> z3.ArithRef:
        self.fresh += 1
        return z3.Int(f"_{tag}{self.fresh}")

    def quotient(self, a: Poly, b: Poly) -> z3.ArithRef:
        key = (a, b)
        q = self.quotients.get(key)
        if q is None:
            za, zb = self.poly(a), self.poly(b)
            q = self.quotients[key] = self._new("q")
            self.side.append(z3.Implies(zb > 0, z3.And(zb * q <= za, za < zb * q + zb)))
            self.side.append(z3.Implies(zb < 0, z3.And(zb * q >= za, za > zb * q + zb)))
        return q

    def atom(self, a: object) -> z3.ArithRef:
        if isinstance(a, Sym):
            return self.sym(a.name)
        found = self.atoms.get(a)
        if found is not None:
            return found
        assert isinstance(a, _Binary)
        if isinstance(a, FloorDiv):
            out = self.quotient(a.a, a.b)
        elif isinstance(a, Mod):
            out = self.poly(a.a) - self.poly(a.b) * self.quotient(a.a, a.b)
        elif isinstance(a, Min):
            x, y = self.poly(a.a), self.poly(a.b)
            out = z3.If(x <= y, x, y)
        elif isinstance(a, Max):
            x, y = self.poly(a.a), self.poly(a.b)
            out = z3.If(x >= y, x, y)
        else:  # pragma: no cover - every atom kind is listed above
            raise TypeError(f"unknown atom {a!r}")
        self.atoms[a] = out
        return out

    def poly(self, p: Poly) -> z3.ArithRef:
        total: z3.ArithRef = z3.IntVal(0)
        for mono, coef in p.terms:
            term: z3.ArithRef = z3.IntVal(coef)
            for a in mono:
                term = term * self.atom(a)
            total = total + term
        return total

    def statement(self, s: Statement) -> z3.BoolRef:
        if s.kind == "ge":
            return self.poly(s.lhs) - self.poly(s.rhs) >= 0
        if s.kind == "eq":
            return self.poly(s.lhs) == self.poly(s.rhs)
        if s.kind == "divides":  # lhs divides rhs: rhs % lhs == 0 wherever lhs is not 0 (callers prove
            d, n = self.poly(s.lhs), self.poly(s.rhs)  # the divisor positive on their own)
            q = self.quotient(s.rhs, s.lhs)
            return z3.Implies(d != 0, n == d * q)
        raise ValueError(f"unknown statement kind {s.kind!r}")


def _solver(facts: Iterable[Statement], goal_negated: Statement | None, enc: _Encoder) -> z3.Solver:
    solver = z3.Solver()
    solver.set("timeout", TIMEOUT_MS)
    for f in facts:
        solver.add(enc.statement(f))
    if goal_negated is not None:
        solver.add(z3.Not(enc.statement(goal_negated)))
    solver.add(*enc.side)
    return solver


_cache: dict[tuple, tuple[bool, dict[str, int] | None]] = {}
_models: dict[tuple, list[dict[str, int]]] = {}  # bindings z3 found that satisfy all of a facts tuple


def _names(p: Poly) -> set[str]:
    out: set[str] = set()
    for mono, _ in p.terms:
        for a in mono:
            if isinstance(a, Sym):
                out.add(a.name)
            elif isinstance(a, _Binary):
                out |= _names(a.a) | _names(a.b)
    return out


def _statement_names(s: Statement) -> set[str]:
    return _names(s.lhs) | _names(s.rhs)


def _relevant(facts: tuple[Statement, ...], goal: Statement) -> tuple[Statement, ...]:
    """The facts that share symbols with the goal, transitively (dropping the rest only weakens the
    assumptions, so a proof without them is a proof with them)."""
    names = _statement_names(goal)
    pool = [(f, _statement_names(f)) for f in facts]
    keep: list[Statement] = []
    changed = True
    while changed:
        changed = False
        for item in list(pool):
            f, fn = item
            if not fn or fn & names:
                keep.append(f)
                names |= fn
                pool.remove(item)
                changed = True
    return tuple(f for f in facts if f in keep)


def holds_at(s: Statement, binding: Mapping[str, int]) -> bool | None:
    """Whether a statement holds at a concrete binding (None where it cannot be evaluated)."""
    a, b = evaluate(s.lhs, binding), evaluate(s.rhs, binding)
    if a is None or b is None:
        return None
    if s.kind == "ge":
        return a >= b
    if s.kind == "eq":
        return a == b
    return a == 0 or b % a == 0


def _decide(facts: tuple[Statement, ...], goal: Statement) -> tuple[bool, dict[str, int] | None]:
    key = (facts, goal)
    found = _cache.get(key)
    if found is not None:
        return found
    out: tuple[bool, dict[str, int] | None] | None = None
    goal_names = _statement_names(goal)
    for model in _models.get(facts, ()):  # a binding already known to satisfy the facts may refute the goal
        if goal_names <= model.keys() and holds_at(goal, model) is False:
            out = (False, model)
            break
    if out is None:
        relevant = _relevant(facts, goal)
        enc = _Encoder()
        solver = _solver(relevant, goal, enc)
        verdict = solver.check()
        model = None
        if verdict == z3.sat:
            m = solver.model()
            model = {name: m.eval(v, model_completion=True).as_long() for name, v in enc.syms.items()}
            if relevant == facts and all(holds_at(f, model) for f in facts):
                _models.setdefault(facts, []).append(model)
        out = (verdict == z3.unsat, model)
    if len(_cache) > 20000:
        _cache.clear()
        _models.clear()
    _cache[key] = out
    return out


def proves(facts: Iterable[Statement], goal: Statement) -> bool:
    """True only when z3 shows ``goal`` holds at every natural binding that satisfies ``facts``."""
    return _decide(tuple(facts), goal)[0]


def counterexample(facts: Iterable[Statement], goal: Statement) -> dict[str, int] | None:
    """A binding of the symbols that satisfies ``facts`` and breaks ``goal``, when z3 finds one."""
    return _decide(tuple(facts), goal)[1]


def satisfiable(facts: Iterable[Statement]) -> bool | None:
    """Whether some natural binding satisfies every fact (None: z3 could not tell in time)."""
    enc = _Encoder()
    solver = _solver(facts, None, enc)
    verdict = solver.check()
    return None if verdict == z3.unknown else verdict == z3.sat


def evaluate(p: Poly, binding: Mapping[str, int]) -> int | None:
    """The value of ``p`` at a concrete binding, under Python's semantics (None where a divisor is 0)."""
    try:
        v = substitute(p, dict(binding))
    except ZeroDivisionError:
        return None
    return v.value if v.is_const else None
