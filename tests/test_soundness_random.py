"""Soundness in practice: random small blocks from the std ops, checked, then run in torch.

A generator writes blocks from the closed language (linear, conv, pool, pad, reshape into heads,
attention, slices, cat, split into a tuple, norm, interpolate, casts, views after contiguous, layer
loops of any depth, branches on facts, tuple results) with a ``where`` clause and a declared result
that it derives itself; then it mutates some of them (a fact dropped, a result axis off by one, a
dtype changed, a tuple result swapped). Every block the
checker accepts is bound at random generics allowed by its ``where`` clause and run on random
inputs: it must run, and return exactly the declared shape and dtype. The default run uses a fixed
seed; ``-m soundness_sweep`` runs a larger sweep.
"""

from __future__ import annotations

import importlib.util
import os
import random
import sys
from dataclasses import dataclass, field

import pytest
import torch

from kestrel.blocks import BindError, EntryError
from kestrel.blocks.block import check_entry_inputs
from kestrel.checker.check import check_block_class
from kestrel.shapes import evaluate
from kestrel.types.dtypes import DType
from kestrel.types.tensor import TupleType


@dataclass
class Program:
    generics: list[str] = field(default_factory=list)
    facts: list[str] = field(default_factory=list)
    subs: list[str] = field(default_factory=list)
    body: list[str] = field(default_factory=list)
    dims: list[str] = field(default_factory=list)  # the current tensor's axes, in the notation
    dtype: str = "T"
    n: int = 0

    def new(self, prefix: str) -> str:
        self.n += 1
        name = f"{prefix}{self.n}"
        self.generics.append(name)
        return name


def _p(e: str) -> str:
    return e if e.isidentifier() or e.isdigit() else f"({e})"


def _token_ops(rnd: random.Random, prog: Program) -> None:
    """One op on a ``[B, N, D]`` tensor."""
    last = prog.dims[-1]
    choice = rnd.choice(["linear", "norm", "gelu", "heads", "slice", "cat", "residual", "attention", "stack",
                         "softmax", "branch", "split", "view", "drop"])
    if choice == "linear":
        e = prog.new("E")
        prog.facts.append(f"{e} > 0")
        prog.subs.append(f"lin{prog.n}: Linear[\"{last}, {e}, T\"]")
        prog.body.append(f"x = self.lin{prog.n}(x)")
        prog.dims[-1] = e
    elif choice == "norm":
        prog.subs.append(f"norm{prog.n}: RmsNorm[\"{last}, T\"]")
        prog.n += 1
        prog.body.append(f"x = self.norm{prog.n - 1}(x)")
    elif choice == "gelu":
        prog.body.append("x = ops.gelu(x)")
    elif choice == "softmax":
        prog.body.append("x = ops.softmax(x, dim=-1)")
    elif choice == "stack":  # a layer stack of any depth, zero included
        n = prog.new("L")
        prog.subs.append(f"stack{prog.n}: Array[Linear[\"{last}, {last}, T\"], \"{n}\"]")
        prog.body.append(f"for layer in self.stack{prog.n}:")
        prog.body.append("    x = ops.gelu(layer(x)) + x")
    elif choice == "residual":
        prog.body.append("x = x + ops.silu(x)")
    elif choice == "branch":  # an if on a fact the prover decides
        k = prog.new("Br")
        prog.facts.append(f"{k} >= 2")
        prog.body.append(f"if self.{k} > 1:")
        prog.body.append("    x = ops.gelu(x)")
        prog.body.append("else:")
        prog.body.append("    x = x[:, :, 1:]")
    elif choice == "split" and last.isidentifier():  # a tuple of two pieces, joined again
        k = prog.new("Sp")
        prog.facts.append(f"{last} >= {k}")
        prog.body.append(f"a, b = ops.split(x, [self.{k}, x.shape[-1] - self.{k}], dim=-1)")
        prog.body.append("x = ops.cat([b, a], dim=-1)")
    elif choice == "view":
        prog.body.append("b, n = x.shape[0], x.shape[1]")
        prog.body.append("x = x.transpose(1, 2).contiguous().transpose(1, 2).contiguous().view(b, n, -1)")
    elif choice == "drop" and last.isidentifier():  # an off-by-one waiting to happen: drop the first column
        prog.facts.append(f"{last} > 1")
        prog.body.append("x = x[:, :, 1:]")
        prog.dims[-1] = f"{last} - 1"
    elif choice in ("heads", "attention") and last.isidentifier():
        h = prog.new("Hd")
        prog.facts += [f"{h} > 0", f"{last} % {h} == 0"]
        prog.body.append("b, n = x.shape[0], x.shape[1]")
        if choice == "heads":
            prog.body.append(f"x = x.reshape(b, n, self.{h}, -1).reshape(b, n, -1)")
        else:
            prog.body.append(f"q = x.reshape(b, n, self.{h}, -1).transpose(1, 2)")
            prog.body.append("x = ops.attention(q, q, q).transpose(1, 2).reshape(b, n, -1)")
    elif choice == "slice" and last.isidentifier():
        k = prog.new("K")
        prog.facts.append(f"{last} >= {k}")
        prog.body.append(f"x = x[..., : self.{k}]")
        prog.dims[-1] = k
    elif choice == "cat":
        if last.isidentifier():
            prog.facts.append(f"{last} > 0")
        prog.body.append("x = ops.cat([x, x[:, :, :1]], dim=-1)")
        prog.dims[-1] = f"{_p(last)} + 1"
    else:
        prog.body.append("x = ops.gelu(x)")


def _image_ops(rnd: random.Random, prog: Program) -> None:
    """One op on a ``[B, C, H, W]`` tensor."""
    c, h, w = prog.dims[1], prog.dims[2], prog.dims[3]
    choice = rnd.choice(["conv", "conv", "pool", "pad", "interpolate", "gelu"])
    if choice == "conv":
        co, k, s, pad = prog.new("Co"), prog.new("Kk"), prog.new("St"), prog.new("Pd")
        prog.facts += [f"{co} > 0", f"{k} > 0", f"{s} > 0", f"{h} + 2 * {pad} >= {k}", f"{w} + 2 * {pad} >= {k}"]
        prog.subs.append(f"conv{prog.n}: Conv2d[\"{c}, {co}, {k}, {s}, {pad}, T\"]")
        prog.body.append(f"x = self.conv{prog.n}(x)")
        prog.dims[1:] = [co, f"({h} + 2 * {pad} - {k}) / {s} + 1", f"({w} + 2 * {pad} - {k}) / {s} + 1"]
    elif choice == "pool":
        prog.facts += [f"{h} >= 2", f"{w} >= 2"]
        prog.body.append("x = ops.max_pool2d(x, 2)")
        prog.dims[2:] = [f"({h} - 2) / 2 + 1", f"({w} - 2) / 2 + 1"]
    elif choice == "pad":
        pad = prog.new("Pd")
        prog.body.append(f"x = ops.pad(x, (0, self.{pad}, self.{pad}, 0))")
        prog.dims[2:] = [f"{_p(h)} + {pad}", f"{_p(w)} + {pad}"]
    elif choice == "interpolate":
        s = prog.new("Sz")
        prog.facts.append(f"{s} > 0")
        prog.body.append(f"x = ops.interpolate(x, size=(self.{s}, self.{s}), mode='nearest')")
        prog.dims[2:] = [s, s]
    else:
        prog.body.append("x = ops.gelu(x)")


def generate(rnd: random.Random, index: int) -> tuple[str, bool]:
    """The source of one block, and whether it was mutated (it may then be wrong)."""
    prog = Program()
    image = rnd.random() < 0.5
    if image:
        c = prog.new("C")
        prog.facts.append(f"{c} > 0")
        prog.dims = ["B", c, "H", "W"]
        inp = f"Tensor[B, {c}, H, W; T]"
        for _ in range(rnd.randint(1, 3)):
            _image_ops(rnd, prog)
        prog.body.append("x = x.flatten(2).transpose(1, 2)")
        prog.dims = ["B", f"{_p(prog.dims[2])} * {_p(prog.dims[3])}", prog.dims[1]]
    else:
        d = prog.new("D")
        prog.dims = ["B", "N", d]
        inp = f"Tensor[B, N, {d}; T]"
    for _ in range(rnd.randint(1, 4)):
        _token_ops(rnd, prog)
    if rnd.random() < 0.2:
        prog.body.append("x = ops.cast(x, f32)")
        prog.dtype = "f32"
    pair = rnd.random() < 0.25  # a tuple result: the tensor and its first token
    if pair:
        prog.body.append("y = x[:, 0]")
    mutated = rnd.random() < 0.35
    if mutated:
        what = rnd.choice(["fact", "fact", "axis", "dtype", "swap" if pair else "axis"])
        if what == "fact" and prog.facts:
            prog.facts.pop(rnd.randrange(len(prog.facts)))
        elif what == "axis":
            i = rnd.randrange(len(prog.dims))
            prog.dims[i] = f"{_p(prog.dims[i])} + 1"
        elif what == "swap":
            pair = "swapped"
        else:
            prog.dtype = "f32" if prog.dtype == "T" else "T"
    generics = "\n".join(f"    {g}: Dim" for g in prog.generics)
    where = ", ".join(prog.facts)
    subs = "\n".join(f"    {s}" for s in prog.subs)
    body = "\n".join(f"        {line}" for line in prog.body)
    out = f"Tensor[{', '.join(prog.dims)}; {prog.dtype}]"
    first = f"Tensor[{', '.join(prog.dims[:1] + prog.dims[2:])}; {prog.dtype}]"
    result = "x"
    if pair:
        out = f"({out}, {first})" if pair is True else f"({first}, {out})"
        result = "x, y"
    src = f'''

class P{index}(Block, module="rand.p{index}"):
{generics}
    T: Float = f32
    where = "{where}"
{subs}

    @entry
    def forward(self, x: "{inp}") -> "{out}":
{body}
        return {result}
'''
    return src, mutated


HEADER = """from kestrel.blocks import Array, Block, Dim, Float, entry, f32
from kestrel.std import ops
from kestrel.std.nn import Conv2d, Linear, RmsNorm
"""


def with_fact(cls, fact: str):
    """The same block with one more ``where`` fact (a fresh class: declarations are read once)."""
    from kestrel.blocks import Block

    ns = {k: v for k, v in cls.__dict__.items() if k not in ("__dict__", "__weakref__", "_kestrel_decl")}
    old = cls.__dict__.get("where", "")
    ns["where"] = f"{old}, {fact}" if old else fact
    return type(cls.__name__, (Block,), ns, module="rand.hinted")


def _load(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def _bindings(rnd: random.Random, cls, tries: int) -> list[dict]:
    """Random generics that the where clause allows (bind_generics refuses the others)."""
    out = []
    names = [g.name for g in cls.decl().generics if g.is_dim]
    for _ in range(tries * 20):
        g = {n: rnd.randint(0, 6) for n in names}
        g["T"] = rnd.choice(["f32", "bf16"])
        try:
            cls(**g)
        except BindError:
            continue
        out.append(g)
        if len(out) == tries:
            break
    return out


def run_sweep(seed: int, count: int, tmp_path, bindings: int = 3) -> dict[str, int]:
    rnd = random.Random(seed)
    sources = [generate(rnd, i) for i in range(count)]
    path = os.path.join(str(tmp_path), f"rand_blocks_{seed}.py")
    with open(path, "w") as f:
        f.write(HEADER + "".join(s for s, _ in sources))
    module = _load(path, f"rand_blocks_{seed}")
    stats = {"accepted": 0, "refused": 0, "runs": 0, "refused_unmutated": 0, "hints": 0}
    for i, (src, mutated) in enumerate(sources):
        cls = getattr(module, f"P{i}")
        report = check_block_class(cls)
        if not report.ok:
            stats["refused"] += 1
            stats["refused_unmutated"] += not mutated
            for d in report.diagnostics:  # a hint, added to the where clause, clears its diagnostic
                if d.hint is not None:
                    again = check_block_class(with_fact(cls, d.hint)).diagnostics
                    assert not [x for x in again if (x.function, x.message) == (d.function, d.message)], (src, d)
                    stats["hints"] += 1
            continue
        stats["accepted"] += 1
        fn = cls.decl().function("forward")
        for g in _bindings(rnd, cls, bindings):
            block = cls(**g)
            shape = [rnd.randint(1, 2)] + [0] * (len(fn.params[0][1].dims) - 1)
            dims = {k: v for k, v in block.generics.items() if isinstance(v, int)}
            declared_in = fn.params[0][1]
            for axis, d in enumerate(declared_in.dims[1:], start=1):
                free = {s.name for s in d.symbols()} - set(dims)
                shape[axis] = rnd.randint(1, 9) if free else evaluate(d, dims)
            dtype = block.generics["T"]
            assert isinstance(dtype, DType)
            x = torch.randn(shape).to(dtype.torch)
            try:
                binding = check_entry_inputs(block, fn, (x,), {})
            except EntryError:
                continue  # the inputs miss a precondition: the entry refuses them, as it must
            for p in block.parameters():
                torch.nn.init.normal_(p, std=0.1)
            with torch.no_grad():
                out = block(x)
            env = {**dims, **{k: v.value for k, v in binding.dims.items()}}
            declared = fn.result.items if isinstance(fn.result, TupleType) else (fn.result,)
            got = out if isinstance(out, tuple) else (out,)
            assert isinstance(out, tuple) == isinstance(fn.result, TupleType) and len(got) == len(declared), src
            for y, want_type in zip(got, declared):
                want = tuple(evaluate(d, env) for d in want_type.dims)
                want_dtype = want_type.dtype if isinstance(want_type.dtype, DType) else dtype
                assert tuple(y.shape) == want, (src, g, shape, tuple(y.shape), want)
                assert y.dtype == want_dtype.torch, (src, g, y.dtype, want_dtype)
            stats["runs"] += 1
    return stats


def test_random_blocks_that_check_run_with_their_declared_types(tmp_path):
    stats = run_sweep(seed=11, count=24, tmp_path=tmp_path)
    # the test has teeth: most generated programs are accepted and run, the mutants are refused
    assert stats["accepted"] >= 12 and stats["runs"] >= 20, stats
    assert stats["refused"] >= 3 and stats["hints"] >= 2, stats
    assert stats["refused_unmutated"] == 0, stats  # and the right ones are accepted


@pytest.mark.soundness_sweep
@pytest.mark.parametrize("seed", range(10))
def test_random_blocks_sweep(tmp_path, seed):
    stats = run_sweep(seed=1000 + seed, count=60, tmp_path=tmp_path, bindings=4)
    print(f"soundness sweep seed {1000 + seed}: 60 programs drawn, {stats}")
    assert stats["accepted"] > 0, stats
