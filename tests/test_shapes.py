"""Dimension algebra: canonical polynomials, folding, printing, parsing and the prover.

The property tests build random expression trees and compare three independent readings of each:
Python-int evaluation with floor semantics (the reference), the canonical polynomial, and the text
printed then parsed back. Rewritten spellings of a tree (commuted, distributed, with a multiple of
the divisor moved in and out of a floor division) must land on the structurally equal polynomial.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from kestrel.blocks.block import fact_holds
from kestrel.shapes import (
    AtomOrder,
    DimParseError,
    Facts,
    FloorDiv,
    Mod,
    Poly,
    evaluate,
    floordiv,
    format_poly,
    maximum,
    minimum,
    mod,
    parse_dim,
    parse_facts,
    substitute,
)

SYMS = ("A", "Bq", "Cx", "Dz")
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ------------------------------------------------------------------------------ expression trees
# A tree is a tuple: ("sym", name) | ("const", c) | (op, a, b) for op in add sub mul min max,
# or ("div" | "mod", a, divisor) with a divisor ("const", c > 0) or ("sym", name).

leaf = st.one_of(st.sampled_from(SYMS).map(lambda s: ("sym", s)),
                 st.integers(-6, 9).map(lambda c: ("const", c)))
divisor = st.one_of(st.integers(1, 7).map(lambda c: ("const", c)), st.sampled_from(SYMS).map(lambda s: ("sym", s)))


def _extend(children):
    binary = st.tuples(st.sampled_from(["add", "sub", "mul", "add", "sub"]), children, children)
    division = st.tuples(st.sampled_from(["div", "mod", "div"]), children, divisor)
    minmax = st.tuples(st.sampled_from(["min", "max"]), children, children)
    return st.one_of(binary, division, minmax)


trees = st.recursive(leaf, _extend, max_leaves=7)
ring_trees = st.recursive(leaf, lambda c: st.tuples(st.sampled_from(["add", "sub", "mul"]), c, c), max_leaves=6)
envs = st.fixed_dictionaries({s: st.integers(1, 40) for s in SYMS})


def value(e, env):
    """The reference: Python ints, floor division and modulo."""
    tag = e[0]
    if tag == "sym":
        return env[e[1]]
    if tag == "const":
        return e[1]
    a, b = value(e[1], env), value(e[2], env)
    return {
        "add": lambda: a + b, "sub": lambda: a - b, "mul": lambda: a * b, "div": lambda: a // b,
        "mod": lambda: a % b, "min": lambda: min(a, b), "max": lambda: max(a, b),
    }[tag]()


def poly(e):
    """The same tree through the Poly operators."""
    tag = e[0]
    if tag == "sym":
        return Poly.sym(e[1])
    if tag == "const":
        return Poly.const(e[1])
    a, b = poly(e[1]), poly(e[2])
    return {
        "add": lambda: a + b, "sub": lambda: a - b, "mul": lambda: a * b, "div": lambda: a // b,
        "mod": lambda: a % b, "min": lambda: minimum(a, b), "max": lambda: maximum(a, b),
    }[tag]()


def text(e):
    """The tree written out fully parenthesised, in the notation (``/`` floor division)."""
    tag = e[0]
    if tag == "sym":
        return e[1]
    if tag == "const":
        return f"({e[1]})" if e[1] < 0 else str(e[1])
    a, b = text(e[1]), text(e[2])
    if tag in ("min", "max"):
        return f"{tag}({a}, {b})"
    op = {"add": "+", "sub": "-", "mul": "*", "div": "/", "mod": "%"}[tag]
    return f"({a} {op} {b})"


def respell(e, rnd: random.Random):
    """An equal expression written differently."""
    tag = e[0]
    if tag in ("sym", "const"):
        roll = rnd.random()
        if roll < 0.15:
            return ("mul", ("const", 1), e)
        if roll < 0.3:
            return ("add", e, ("const", 0))
        if roll < 0.4:
            return ("sub", ("add", e, e), e)
        return e
    a, b = respell(e[1], rnd), e[2] if tag in ("div", "mod") else respell(e[2], rnd)
    roll = rnd.random()
    if tag in ("add", "mul", "min", "max") and roll < 0.5:
        return (tag, b, a)  # commutativity
    if tag == "sub" and roll < 0.5:
        return ("add", ("mul", ("const", -1), b), a)
    if tag == "mul" and b[0] == "add" and roll < 0.8:
        return ("add", ("mul", a, b[1]), ("mul", b[2], a))  # distributivity
    if tag == "div" and roll < 0.8:
        # floor((a + k * t) / k) - t == floor(a / k) for any integer t
        t = respell(("sym", rnd.choice(SYMS)), rnd)
        return ("sub", ("div", ("add", ("mul", b, t), a), b), t)
    if tag == "mod" and roll < 0.8:
        t = ("sym", rnd.choice(SYMS))
        return ("mod", ("add", a, ("mul", t, b)), b)  # (a + t * k) mod k == a mod k
    return (tag, a, b)


# ------------------------------------------------------------------------------------ properties


@SETTINGS
@given(trees, envs)
def test_canonical_form_evaluates_as_floor_arithmetic(e, env):
    assert evaluate(poly(e), env) == value(e, env)


@SETTINGS
@given(trees, envs)
def test_parsing_agrees_with_the_operators(e, env):
    p = parse_dim(text(e))
    assert p == poly(e)
    assert evaluate(p, env) == value(e, env)


@SETTINGS
@given(trees, st.randoms(use_true_random=False), envs)
def test_two_spellings_are_structurally_equal(e, rnd, env):
    other = respell(e, rnd)
    assert value(other, env) == value(e, env)  # the rewrite is an identity (reference check)
    assert poly(other) == poly(e)
    assert hash(poly(other)) == hash(poly(e))
    assert parse_dim(text(other)) == poly(e)


@SETTINGS
@given(ring_trees, ring_trees, envs)
def test_ring_identities(a, b, env):
    pa, pb = poly(a), poly(b)
    assert pa + pb == pb + pa
    assert pa * pb == pb * pa
    assert pa * (pb + 3) == pa * pb + 3 * pa
    assert (pa - pb) + pb == pa
    # an exact division folds: (k * a + k * b) / k == a + b, for constant and symbolic k
    assert floordiv(4 * pa + 4 * pb, Poly.const(4)) == pa + pb
    assert floordiv(Poly.sym("Dz") * (pa + pb), Poly.sym("Dz")) == pa + pb
    assert mod(3 * pa + 6, Poly.const(3)) == Poly.const(0)
    assert evaluate(pa * pb, env) == value(a, env) * value(b, env)


@SETTINGS
@given(trees, envs)
def test_print_then_parse_round_trips(e, env):
    p = poly(e)
    printed = format_poly(p)
    back = parse_dim(printed)
    assert back == p, printed
    assert evaluate(back, env) == value(e, env)
    # and printing with another atom order changes the text at most, never the value
    order = AtomOrder()
    for s in reversed(SYMS):
        order.register(Poly.sym(s))
    assert parse_dim(format_poly(p, order)) == p


@SETTINGS
@given(trees, envs)
def test_substitution_commutes_with_evaluation(e, env):
    p = poly(e)
    half = {k: v for k, v in env.items() if k in ("A", "Cx")}
    rest = {k: v for k, v in env.items() if k not in half}
    assert evaluate(substitute(p, half), rest) == value(e, env)


# ---------------------------------------------------------------------------------- unit cases

H, W, K, S = Poly.sym("H"), Poly.sym("W"), Poly.sym("K"), Poly.sym("S")


def test_exact_divisions_fold():
    assert parse_dim("(4 * H + 2) / 2") == 2 * H + 1
    assert parse_dim("(4*H+2)/2") == parse_dim("2*H+1")
    assert parse_dim("(4 * H + 3) / 2") == 2 * H + 1  # floor: the remainder 1 / 2 is 0
    assert parse_dim("(2 * H + 1) % 2") == Poly.const(1)
    assert parse_dim("(6 * H * W) / (3 * W)") == 2 * H
    assert parse_dim("(H / 2) / 3") == parse_dim("H / 6")
    assert parse_dim("(H * S + W) / S") == H + parse_dim("W / S")
    assert parse_dim("H / 1") == H and parse_dim("H % 1") == Poly.const(0)
    assert parse_dim("7 / 2") == Poly.const(3) and parse_dim("-7 / 2") == Poly.const(-4)
    assert parse_dim("-7 % 2") == Poly.const(1)


def test_atoms_are_interned():
    a, b = parse_dim("(H + 1) / 2"), parse_dim("(1 + H) / 2")
    assert a.as_atom() is b.as_atom()
    assert isinstance(a.as_atom(), FloorDiv)
    assert isinstance(parse_dim("H % W").as_atom(), Mod)
    assert minimum(H, W) == minimum(W, H) and maximum(H, W) == maximum(W, H)
    assert minimum(2 * H + W, 3 * H - W) == minimum(3 * H - W, 2 * H + W)


def test_min_max_fold_only_when_sound():
    assert minimum(H, H + W) == H and maximum(H, H + W) == H + W
    # (K - H) / S may be negative, so min(H, H + (K - H) / S) must stay a min
    m = minimum(H, H + parse_dim("(K - H) / S"))
    assert m != H
    assert evaluate(m, {"H": 9, "K": 1, "S": 1}) == 1


def _conv_order() -> AtomOrder:
    """The order in which the Conv2d block reads its names: weight [Cout, Cin, K, K], x [B, Cin, H, W]."""
    order = AtomOrder()
    for name in ("Cout", "Cin", "K", "B", "H", "W", "Pad", "Stride"):
        order.register(Poly.sym(name))
    return order


def test_prints_like_the_seeds():
    order = _conv_order()
    conv = parse_dim("(H + 2 * Pad - K) / Stride + 1", order=order)
    assert format_poly(conv, order) == "1 + (-1 * K + H + 2 * Pad) / Stride"
    # registering the names in the other order moves the terms, so the order is what decides
    other = AtomOrder()
    for name in ("Stride", "Pad", "H", "K"):
        other.register(Poly.sym(name))
    assert format_poly(conv, other) == "1 + (2 * Pad + H + -1 * K) / Stride"

    order = AtomOrder()
    order.register(Poly.sym("Wh"))
    assert format_poly(parse_dim("2 * Wh - 1", order=order), order) == "-1 + 2 * Wh"

    order = AtomOrder()
    grid = parse_dim("(Height / Patch) * (Width / Patch)", order=order)
    assert format_poly(grid, order) == "(Height / Patch) * (Width / Patch)"
    assert format_poly(1 + grid, order) == "1 + (Height / Patch) * (Width / Patch)"

    assert format_poly(parse_dim("Hd / 4")) == "Hd / 4"
    assert format_poly(parse_dim("D + D + D")) == "3 * D"
    assert format_poly(parse_dim("D * 3")) == "3 * D"
    assert format_poly(parse_dim("H + H")) == "2 * H"
    assert format_poly(parse_dim("2 * (H / 4)")) == "2 * (H / 4)"
    assert format_poly(parse_dim("H % 4")) == "H % 4"
    assert format_poly(parse_dim("0")) == "0"
    assert format_poly(parse_dim("-3")) == "-3"


def test_the_conv2d_block_prints_its_result_as_the_seed():
    from kestrel.std.nn import Conv2d

    decl = Conv2d.decl()
    fwd = decl.function("forward")
    assert fwd is not None
    h, w = fwd.result.dims[2], fwd.result.dims[3]
    assert format_poly(h, decl.order) == "1 + (-1 * K + H + 2 * Pad) / Stride"
    assert format_poly(w, decl.order) == "1 + (-1 * K + W + 2 * Pad) / Stride"
    assert evaluate(h, {"H": 224, "K": 16, "Pad": 0, "Stride": 16}) == 14
    assert evaluate(h, {"H": 64, "K": 3, "Pad": 1, "Stride": 1}) == 64


def test_parse_errors_point_at_the_column():
    with pytest.raises(DimParseError) as e:
        parse_dim("H + * W")
    assert e.value.column == 4
    with pytest.raises(DimParseError) as e:
        parse_dim("(H + 1")
    assert e.value.column == 6 and "expected ')'" in str(e.value)
    with pytest.raises(DimParseError) as e:
        parse_dim("H / 0")
    assert e.value.column == 2 and "division by zero" in str(e.value)
    with pytest.raises(DimParseError) as e:
        parse_dim("H $ 2")
    assert e.value.column == 2


# -------------------------------------------------------------------------------------- prover

D, Heads = Poly.sym("D"), Poly.sym("Heads")


def test_divisibility_fact_makes_the_head_split_exact():
    with_fact = Facts(parse_facts("Heads > 0, D % Heads == 0"))
    without = Facts(parse_facts("Heads > 0"))
    split = Heads * floordiv(D, Heads)
    assert with_fact.equal(split, D)
    assert with_fact.divides(Heads, D)
    assert with_fact.equal(mod(D, Heads), Poly.const(0))
    assert not without.equal(split, D)
    assert not without.divides(Heads, D)
    # the counterexample the prover must not overlook: D = 10, Heads = 3
    assert evaluate(split, {"D": 10, "Heads": 3}) != 10


def test_bounds():
    facts = Facts(parse_facts("Stride > 0"))
    assert facts.positive(Poly.sym("Stride"))
    assert not Facts().positive(Poly.sym("Stride"))
    assert Facts().nonneg(Poly.sym("Stride"))  # every dimension is a natural number
    assert not facts.positive(Poly.sym("Stride") - 1)
    assert Facts(parse_facts("N >= 5")).positive(Poly.sym("N") - 4)
    assert Facts(parse_facts("N > 4")).nonneg(Poly.sym("N") - 5)
    assert not Facts(parse_facts("N > 4")).positive(Poly.sym("N") - 5)
    assert facts.positive(parse_dim("(H + Stride) / Stride"))  # 1 + H / Stride
    assert not facts.positive(parse_dim("H / Stride"))


def test_nested_bounds_are_not_shifted_twice():
    # with X >= 1 only, floor((X - 2) / S) is -1 at X = 1, S = 1
    facts = Facts(parse_facts("X > 0, S > 0"))
    assert not facts.nonneg(parse_dim("(X - 2) / S"))
    assert facts.nonneg(parse_dim("(X - 1) / S"))


def test_equalities_substitute():
    facts = Facts(parse_facts("N == H * W, Inner == 4 * D"))
    assert facts.equal(Poly.sym("N"), H * W)
    assert facts.equal(Poly.sym("N") + 1, W * H + 1)
    assert facts.equal(floordiv(Poly.sym("Inner"), Poly.const(4)), D)
    assert not facts.equal(Poly.sym("N"), H)
    assert not Facts().equal(Poly.sym("N"), H * W)


# ------------------------------------------------------------------------------------ soundness

fact_syms = ("P", "Q", "R")


@st.composite
def facts_and_binding(draw):
    """Facts that hold at a drawn binding, so whatever they prove must hold there too."""
    env = {s: draw(st.integers(1, 8)) for s in fact_syms}
    texts = []
    if draw(st.booleans()):  # a divisibility that holds: make it so
        k = draw(st.integers(1, 6))
        env["R"] = k * env["Q"]
        texts.append("R % Q == 0")
    if draw(st.booleans()):  # an equality that holds
        env["P"] = env["Q"] + 2
        texts.append("P == Q + 2")
    if draw(st.booleans()):  # a relational fact that holds, at its edge or beyond
        a, b = draw(st.sampled_from([("P", "Q"), ("Q", "R"), ("P", "R")]))
        lo, hi = sorted((a, b), key=lambda s: env[s])
        slack = draw(st.integers(0, max(0, env[hi] - env[lo])))
        texts.append(f"{hi} >= {lo} + {slack}" if draw(st.booleans()) else f"{hi} - {lo} - {slack} >= 0")
    if draw(st.booleans()):  # a combination: P + Q >= R - k
        k = max(0, env["R"] - env["P"] - env["Q"])
        texts.append(f"P + Q + {k} >= R")
    for s in fact_syms:  # bounds last, from the final values
        if draw(st.booleans()):  # a bound at or just below the value: the edge is where mistakes show
            low = max(0, env[s] - draw(st.integers(0, 2)))
            texts.append(f"{s} >= {low}" if draw(st.booleans()) else f"{s} > {low - 1}")
    assert all(fact_holds(f, env) for f in parse_facts(", ".join(texts))) if texts else True
    facts = Facts(parse_facts(", ".join(texts))) if texts else Facts()
    return facts, env


small_trees = st.recursive(
    st.one_of(st.sampled_from(fact_syms).map(lambda s: ("sym", s)), st.integers(-4, 4).map(lambda c: ("const", c))),
    lambda c: st.one_of(st.tuples(st.sampled_from(["add", "sub", "mul"]), c, c),
                        st.tuples(st.sampled_from(["div", "mod"]), c,
                                  st.one_of(st.integers(1, 4).map(lambda k: ("const", k)),
                                            st.sampled_from(fact_syms).map(lambda s: ("sym", s)))),
                        st.tuples(st.sampled_from(["min", "max"]), c, c)),
    max_leaves=6)


CYCLE = ("div", ("mod", ("sym", "P"), ("sym", "Q")), ("const", 2))  # its quotient bounds once led back to itself


@SETTINGS
@given(facts_and_binding(), small_trees, small_trees)
@example((Facts(), {"P": 1, "Q": 1, "R": 1}), CYCLE, ("sym", "P"))
@example((Facts(), {"P": 1, "Q": 1, "R": 1}), ("sym", "P"), CYCLE)
def test_prover_never_proves_a_false_statement(fb, a, b):
    facts, env = fb
    pa, pb = poly(a), poly(b)
    va, vb = value(a, env), value(b, env)
    if facts.equal(pa, pb):
        assert va == vb
    if facts.nonneg(pa):
        assert va >= 0
    if facts.positive(pb):
        assert vb > 0
    if vb > 0 and facts.divides(pb, pa):
        assert va % vb == 0
    # Q * (R / Q) is R exactly when the divisibility fact is there; the prover may use it
    split = poly(("mul", ("sym", "Q"), ("div", ("sym", "R"), ("sym", "Q"))))
    if facts.equal(split, Poly.sym("R")):
        assert env["Q"] * (env["R"] // env["Q"]) == env["R"]


def test_relational_facts_are_used():
    facts = Facts(parse_facts("H >= K, K > 0, S > 0"))
    h, k, s = Poly.sym("H"), Poly.sym("K"), Poly.sym("S")
    assert facts.nonneg(h - k)
    assert facts.positive(h - k + 1)
    assert facts.nonneg(floordiv(h - k, s))
    assert facts.positive(floordiv(h, k))  # H / K >= 1 when H >= K > 0
    assert not facts.positive(h - k)
    assert not Facts(parse_facts("K > 0")).nonneg(h - k)
    two = Facts(parse_facts("A >= B + 2, B >= C"))
    assert two.nonneg(Poly.sym("A") - Poly.sym("C") - 2)  # a chain of two facts
    assert not two.nonneg(Poly.sym("A") - Poly.sym("C") - 3)
    eq = Facts(parse_facts("D == Heads * Dh, Heads > 0"))
    assert eq.divides(Heads, D)  # divisibility from an equality
    assert eq.divides(Poly.sym("B") * Heads, Poly.sym("B") * Poly.sym("N") * D)  # common factors cancel


def test_padding_to_a_multiple_is_divisible():
    win, h = Poly.sym("Win"), Poly.sym("H")
    padded = h + mod(win - mod(h, win), win)
    assert mod(padded, win) == 0
    assert Facts(parse_facts("Win > 0")).divides(win, padded)
    for hv in range(1, 9):
        for wv in range(1, 5):
            assert evaluate(padded, {"H": hv, "Win": wv}) % wv == 0


@SETTINGS
@given(facts_and_binding(), small_trees)
def test_prover_uses_the_facts_it_is_given(fb, a):
    facts, env = fb
    said = {str(f) for f in facts.facts}
    assume("P == Q + 2" in said or "R % Q == 0" in said)
    pa = poly(a)
    if "P == Q + 2" in said:  # rewriting with the fact's own equality gives a dimension it calls equal
        rewritten = substitute(pa, {"P": Poly.sym("Q") + 2})
        assert facts.equal(pa, rewritten)
        assert evaluate(rewritten, env) == value(a, env)
    if "R % Q == 0" in said:
        q, r = Poly.sym("Q"), Poly.sym("R")
        assert facts.equal(q * floordiv(r, q), r)
        assert facts.equal(pa * q * floordiv(r, q), pa * r)
        assert facts.divides(q, r)


@SETTINGS
@given(st.integers(0, 5), st.integers(-3, 12), st.sampled_from(["div", "mod", "nested", "min", "max"]))
def test_bounds_are_sound_at_the_edge(low, c, shape):
    """With ``X >= low`` the prover may only call an expression nonnegative if it is, at X = low too."""
    facts = Facts(parse_facts(f"X >= {low}, S > 0"))
    x, s = Poly.sym("X"), Poly.sym("S")
    p = {
        "div": floordiv(x - c, s),
        "mod": mod(x - c, s) + floordiv(x - c, Poly.const(2)),
        "nested": floordiv(floordiv(x - c, s) + 1, s),
        "min": minimum(x, x + floordiv(Poly.const(low) - c, s)),
        "max": maximum(x - c, floordiv(x - c, s)),
    }[shape]
    for xv in range(low, low + 4):
        for sv in (1, 2, 3):
            got = evaluate(p, {"X": xv, "S": sv})
            if facts.nonneg(p):
                assert got >= 0, (format_poly(p), xv, sv)
            if facts.positive(p):
                assert got > 0, (format_poly(p), xv, sv)


@SETTINGS
@given(ring_trees, ring_trees, envs)
def test_min_max_evaluate_exactly(a, b, env):
    pa, pb = poly(a), poly(b)
    shifted = pa + floordiv(pb - 20, Poly.sym("Cx"))  # may be below pa: min must not drop it
    assert evaluate(minimum(pa, shifted), env) == min(value(a, env), evaluate(shifted, env))
    assert evaluate(maximum(pa, shifted), env) == max(value(a, env), evaluate(shifted, env))
