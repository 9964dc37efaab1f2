"""The prover is never wrong: every "proved" of the hand prover and of z3 is checked against brute force.

Random polynomials over floor-division and modulo atoms, random facts; for each statement, every
binding with each symbol in 0..12 that satisfies the facts is evaluated (numpy, Python's floor
semantics). A statement either prover calls proved must hold at all of them, and z3 must never refute
what the hand prover proves.
"""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from kestrel.shapes import smt
from kestrel.shapes.facts import Fact, Facts
from kestrel.shapes.parse import parse_dim, parse_facts
from kestrel.shapes.poly import FloorDiv, Max, Min, Mod, Poly, Sym, floordiv, mod

BOX = 13  # every symbol in 0..12
NAMES = ("H", "K", "W")
GRID = dict(zip(NAMES, (a.ravel() for a in np.meshgrid(*(np.arange(BOX, dtype=np.int64),) * 3, indexing="ij"))))


def values(p: Poly, env: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """``p`` at every binding of the grid at once, and where it is defined (no division by zero)."""
    n = len(next(iter(env.values())))
    total, ok = np.zeros(n, dtype=np.int64), np.ones(n, dtype=bool)
    for mono, coef in p.terms:
        term = np.full(n, coef, dtype=np.int64)
        for a in mono:
            if isinstance(a, Sym):
                v = env[a.name]
            else:
                x, xo = values(a.a, env)
                y, yo = values(a.b, env)
                ok &= xo & yo
                if isinstance(a, FloorDiv | Mod):
                    ok &= y != 0
                    safe = np.where(y == 0, 1, y)
                    v = x // safe if isinstance(a, FloorDiv) else x % safe
                elif isinstance(a, Min):
                    v = np.minimum(x, y)
                else:
                    assert isinstance(a, Max)
                    v = np.maximum(x, y)
            term = term * v
        total = total + term
    return total, ok


def holds(kind: str, lhs: Poly, rhs: Poly, env: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    a, ao = values(lhs, env)
    b, bo = values(rhs, env)
    if kind == "ge":
        return a >= b, ao & bo
    if kind == "eq":
        return a == b, ao & bo
    ok = ao & bo & (a != 0)  # divisibility is claimed only where the divisor is not 0
    return b % np.where(a == 0, 1, a) == 0, ok


def allowed(facts: Facts) -> np.ndarray:
    mask = np.ones(BOX ** 3, dtype=bool)
    for f in facts.facts:
        h, ok = holds(f.kind, f.lhs, f.rhs, GRID)
        mask &= h & ok
    return mask


def random_poly(rng: random.Random, depth: int = 2) -> Poly:
    syms = [Poly.sym(n) for n in NAMES]
    if depth == 0 or rng.random() < 0.3:
        return rng.choice(syms) if rng.random() < 0.7 else Poly.const(rng.randint(-3, 4))
    a, b = random_poly(rng, depth - 1), random_poly(rng, depth - 1)
    kind = rng.choice(("add", "sub", "mul", "div", "mod", "div", "mod"))
    if kind in ("div", "mod"):
        b = rng.choice([*syms, Poly.const(rng.randint(1, 4))])  # divisors the facts make positive
        if not b.is_const:
            b = b + 1
        return floordiv(a, b) if kind == "div" else mod(a, b)
    return {"add": a + b, "sub": a - b, "mul": a * b}[kind]


FACT_TEXTS = ("H >= K", "K > 1", "K > 0", "H > 0", "W > 0", "H % 2 == 0", "H >= 2 * K", "W >= K + 1",
              "H == 2 * W", "K % W == 0", "H + W >= 3")


def random_facts(rng: random.Random) -> Facts:
    chosen = rng.sample(FACT_TEXTS, rng.randint(0, 3))
    return Facts(parse_facts(", ".join(chosen)) if chosen else [])


def _fast(facts: Facts, kind: str, lhs: Poly, rhs: Poly) -> bool:
    if kind == "ge":
        return facts.fast_nonneg(lhs - rhs)
    if kind == "eq":
        return facts.fast_equal(lhs, rhs)
    return facts.fast_divides(lhs, rhs)


def test_fast_proofs_and_smt_proofs_hold_at_every_small_binding(monkeypatch):
    _sweep(monkeypatch, seed=2113, cases=60)


@pytest.mark.soundness_sweep
def test_prover_sweep_large(monkeypatch):
    _sweep(monkeypatch, seed=7, cases=1500)


def _sweep(monkeypatch, seed: int, cases: int) -> None:
    monkeypatch.setattr(smt, "TIMEOUT_MS", 100)  # a timeout is "cannot prove": soundness holds at any budget
    rng = random.Random(seed)
    proved_fast = proved_smt = 0
    for _ in range(cases):
        facts = random_facts(rng)
        mask = allowed(facts)
        p, q = random_poly(rng), random_poly(rng)
        d = rng.choice([Poly.sym("K"), Poly.sym("W") + 1, Poly.const(2), Poly.sym("K") * Poly.sym("W")])
        for kind, lhs, rhs in (("ge", p, Poly()), ("eq", p, q), ("ge", p - q, Poly.const(1)), ("divides", d, p)):
            fast = _fast(facts, kind, lhs, rhs)
            statements = [smt.Statement(f.kind, f.lhs, f.rhs) for f in facts.facts]
            by_smt = smt.proves(statements, smt.Statement(kind, lhs, rhs))
            h, ok = holds(kind, lhs, rhs, GRID)
            true_everywhere = bool(np.all(h[mask & ok]))
            shown = f"{facts.facts} |- {kind} {lhs} {rhs}"
            if fast:
                proved_fast += 1
                assert true_everywhere, f"hand prover proved a false statement: {shown}"
                # z3 may time out on nonlinear facts, but it must never refute what the hand prover proved
                assert by_smt or smt.counterexample(statements, smt.Statement(kind, lhs, rhs)) is None, shown
            if by_smt:
                proved_smt += 1
                assert true_everywhere, f"z3 proved a false statement: {shown}"
            else:
                cex = smt.counterexample(statements, smt.Statement(kind, lhs, rhs))
                if cex is not None:  # a counterexample satisfies the facts and breaks the statement
                    assert all(smt.holds_at(f, cex) is not False for f in statements)
                    assert smt.holds_at(smt.Statement(kind, lhs, rhs), cex) is not True
    assert proved_fast > cases // 10 and proved_smt > proved_fast  # the sweep exercises both provers


def _facts(text: str) -> Facts:
    return Facts(parse_facts(text))


def test_the_issue_examples():
    facts = _facts("K > 1, H >= K")
    wrong = parse_dim("2 * (H / 2) - H - 1")
    assert not facts.nonneg(wrong)
    cex = facts.counterexample("ge", wrong)
    assert cex is not None and 2 * (cex["H"] // 2) - cex["H"] - 1 < 0 and cex["K"] > 1 and cex["H"] >= cex["K"]
    assert not facts.equal(2 * floordiv(Poly.sym("H"), Poly.const(2)), Poly.sym("H"))  # H = 5 gives 4 rows
    ceil = _facts("Win > 0")
    w, win = Poly.sym("W"), Poly.sym("Win")
    padded = win * floordiv(w + win - 1, win)
    assert ceil.nonneg(padded - w)  # b * ((a + b - 1) / b) >= a
    assert ceil.positive(w + win - padded)  # ... < a + b


def test_timeout_or_unknown_is_not_a_proof(monkeypatch):
    monkeypatch.setattr(smt, "TIMEOUT_MS", 1)
    smt._cache.clear()
    # a true but nonlinear statement: at 1 ms the solver may or may not finish; it must never call a
    # false one proved, whatever the budget
    facts = _facts("A > 0, B > 0")
    a, b = Poly.sym("A"), Poly.sym("B")
    assert not facts.nonneg(a * b - a - b - 1)  # false at A = B = 1
    smt._cache.clear()


@pytest.mark.parametrize("low", [0, 1, 2])
def test_brute_force_of_canonical_forms(low):
    """The canonical forms the prover reasons about evaluate as Python does."""
    rng = random.Random(low)
    for _ in range(60):
        p = random_poly(rng, 3)
        env = {n: np.arange(low, low + 9, dtype=np.int64) for n in NAMES}
        got, ok = values(p, env)
        for i in range(9):
            binding = {n: int(env[n][i]) for n in NAMES}
            want = smt.evaluate(p, binding)
            if ok[i] and want is not None:
                assert want == got[i]


def test_every_fact_kind_is_encoded():
    facts = Facts([Fact("divides", Poly.sym("K"), Poly.sym("H")), *parse_facts("K > 0, W == H + 1")])
    assert facts.divides(Poly.sym("K"), Poly.sym("H") * 3)
    assert facts.equal(Poly.sym("W") - 1, Poly.sym("H"))
    assert not facts.divides(Poly.sym("K") * 2, Poly.sym("H"))
    for values_ in itertools.islice(itertools.product(range(5), repeat=3), 10):
        binding = dict(zip(("H", "K", "W"), values_))
        assert smt.evaluate(mod(Poly.sym("H"), Poly.sym("K") + 1), binding) == binding["H"] % (binding["K"] + 1)
