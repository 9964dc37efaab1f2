"""Running every typed function of a program symbolically and proving its declared types.

Each function runs once with symbolic inputs from its annotations. ``self.X`` gives a generic's
symbol, a param its declared type, and a call into a sub checks the callee's *declared* signature
instantiated with the caller's generics (callee bodies are checked once, generically).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

from ..blocks.block import Block
from ..blocks.decl import BlockDecl, DeclarationError, FnDecl, ParamDecl, SubDecl
from ..shapes.facts import Facts
from ..shapes.poly import FloorDiv, Mod, Poly, format_poly, substitute
from ..types.dtypes import DType, DTypeVar
from ..types.tensor import TensorType, TupleType, Type
from ..types.unify import Binding, match
from .graph import Graph
from .symbolic import Context, ShapeError, SymDim, SymTensor, checking, current, dim_of, record


@dataclass
class Diagnostic:
    block: str
    function: str | None
    message: str
    file: str | None = None
    line: int | None = None
    hint: str | None = None

    def format(self) -> str:
        where = f"{_relative(self.file)}:{self.line}: " if self.file else ""
        what = f"{self.block}.{self.function}" if self.function else self.block
        # a declaration error's message already says which block and member it is in
        scope = "" if self.block == "declaration" else f"in {what}: "
        text = f"{where}error: {scope}{self.message}"
        if self.hint:
            text += f"\n    hint: add `where {self.hint}` to {self.block}"
        return text

    __str__ = format


def _relative(path: str | None) -> str:
    if not path:
        return "<unknown>"
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return rel if not rel.startswith("..") else path


@dataclass
class Report:
    """What checking a program found: the blocks in order, diagnostics, and each function's graph."""

    root: str
    blocks: list[BlockDecl] = field(default_factory=list)
    diagnostics: list[Diagnostic] = field(default_factory=list)
    graphs: dict[tuple[str, str], Graph] = field(default_factory=dict)
    checked: int = 0

    @property
    def ok(self) -> bool:
        return not self.diagnostics


# ------------------------------------------------------------------------------------- proxies


class SelfProxy:
    """``self`` inside a function under the checker."""

    def __init__(self, decl: BlockDecl) -> None:
        object.__setattr__(self, "_decl", decl)
        object.__setattr__(self, "_params", {})

    def __getattr__(self, name: str) -> Any:
        decl: BlockDecl = self._decl
        g = decl.generic(name)
        if g is not None:
            if g.is_dim:
                return dim_of(Poly.sym(name))
            return DTypeVar(name, g.kind.name)
        for m in decl.members:
            if m.name != name:
                continue
            if isinstance(m, ParamDecl):
                if name not in self._params:
                    t = SymTensor(TensorType(m.type.dims, m.type.dtype))
                    current().graph.values[t.vid].name = name
                    record(name, [], [t], kind="param")
                    self._params[name] = t
                return self._params[name]
            return ArrayProxy(m) if m.count is not None else SubProxy(m, name)
        fn = decl.function(name)
        if fn is not None:
            return lambda *a, **k: call_declared(decl, fn, {}, {}, a, k, f"self.{fn.name}", own=True)
        attr = getattr(decl.cls, name, None)
        if callable(attr):  # an untyped helper: inline it
            return attr.__get__(self)
        if attr is not None and not isinstance(attr, Block):
            return attr
        raise ShapeError(f"{decl.qualname} has no generic, param, sub or function named {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        raise ShapeError(f"a block's function may not assign self.{name}: blocks are their declarations")


class SubProxy:
    """A sub-block under the checker: calls check against its declared signatures."""

    def __init__(self, sub: SubDecl, label: str) -> None:
        self.sub, self.label = sub, label

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call("forward", args, kwargs)

    def _call(self, fname: str, args: tuple, kwargs: dict) -> Any:
        callee = self.sub.block.decl()
        fn = callee.function(fname)
        if fn is None or fn.visibility == "private":
            raise ShapeError(f"{callee.qualname} has no public function {fname!r}")
        dims, dtypes = self.sub.callee_binding()
        label = self.label if fname == "forward" else f"{self.label}.{fname}"
        return call_declared(callee, fn, dims, dtypes, args, kwargs, label)

    def __getattr__(self, name: str) -> Any:
        callee = self.sub.block.decl()
        if callee.function(name) is not None:
            return lambda *a, **k: self._call(name, a, k)
        dims, dtypes = self.sub.callee_binding()
        if name in dims:
            return dim_of(dims[name])
        for p in callee.params:
            if p.name == name:
                t = SymTensor(p.type.substitute(dims, dtypes))  # type: ignore[arg-type]
                record(f"{self.label}.{name}", [], [t], kind="param")
                return t
        raise ShapeError(f"sub {self.label} ({callee.qualname}) has no function, generic or param {name!r}")


class ArrayProxy:
    """A sub array under the checker: a loop body is checked once, for every layer at once."""

    def __init__(self, sub: SubDecl) -> None:
        self.sub = sub

    def __iter__(self) -> Any:
        yield SubProxy(self.sub, f"{self.sub.name}[i]")

    def __len__(self) -> int:
        assert self.sub.count is not None
        if self.sub.count.is_const:
            return self.sub.count.value
        raise ShapeError(f"len({self.sub.name}) is the symbolic {format_poly(self.sub.count, current().order)}")

    def __getitem__(self, i: int) -> SubProxy:
        assert self.sub.count is not None
        if not current().facts.positive(self.sub.count - (i if i >= 0 else -i - 1)):
            raise ShapeError(f"{self.sub.name}[{i}] may be out of range for "
                             f"{format_poly(self.sub.count, current().order)} layers")
        return SubProxy(self.sub, f"{self.sub.name}[{i}]")


# ------------------------------------------------------------------------------ declared calls


def call_declared(callee: BlockDecl, fn: FnDecl, dims: dict[str, Poly], dtypes: dict[str, DType | DTypeVar],
                  args: tuple, kwargs: dict, label: str, own: bool = False) -> Any:
    """Check a call against ``fn``'s declared signature; return symbolic results of its declared type."""
    ctx = current()
    try:
        given = fn.arguments(args, kwargs)
    except ValueError as e:
        raise ShapeError(f"{label}: {e}") from None
    free = {n for n, k in fn.generics if k == "Dim"}
    rename = {n: Poly.sym(n + "'") for n in free if any(n in {s.name for s in p.symbols()} for p in dims.values())}
    mapping: dict[str, Poly] = {**dims, **rename}
    free_now = {(n + "'" if n in rename else n) for n in free}
    binding = Binding()
    inputs: list[SymTensor] = []
    sig = f"{callee.name}<{', '.join(_fmt_arg(a) for a in _args_in_order(callee, dims, dtypes))}>.{fn.name}"
    for name, declared in fn.params:
        value = given[name]
        assert isinstance(declared, TensorType)
        want = declared.substitute(mapping, dtypes)  # type: ignore[arg-type]
        if not isinstance(value, SymTensor):
            raise ShapeError(f"{label}: argument {name} must be a tensor {want.format(ctx.order)}, "
                             f"got {type(value).__name__}")
        problems = match(want, value.dims, value.dtype, binding, free_now, ctx.facts, ctx.order)
        if problems:
            raise ShapeError(
                f"{label}: {sig} expects {name}: {want.format(ctx.order)}, got {value.show()}: "
                + "; ".join(map(str, problems)),
                hint=_equality_hint(problems))
        inputs.append(value)
    result = fn.result
    outs = [t.substitute(mapping, dtypes) for t in (result.items if isinstance(result, TupleType) else (result,))]
    out_tensors = [SymTensor(binding.apply(t)) for t in outs]  # type: ignore[arg-type]
    node = record(label, inputs, out_tensors, kind="fn" if own else "sub", detail=sig)
    node.callee = (callee.qualname, fn.name)
    back = {v: k for k, v in ((n, n + "'") for n in rename)}
    node.subst = {"dims": {**dims, **{back.get(k, k): v for k, v in binding.dims.items()}},
                  "shapes": dict(binding.shapes), "dtypes": {**dtypes, **binding.dtypes}}
    return tuple(out_tensors) if isinstance(result, TupleType) else out_tensors[0]


def _args_in_order(callee: BlockDecl, dims: dict[str, Poly], dtypes: dict) -> list:
    return [dims.get(g.name, dtypes.get(g.name, g.name)) for g in callee.generics]


def _fmt_arg(a: Any) -> str:
    if isinstance(a, Poly):
        return format_poly(a, current().order)
    return str(a)


def _equality_hint(problems: list) -> str | None:
    for p in problems:
        if p.axis is not None and p.expected != p.actual:
            return f"{p.actual} == {p.expected}"
    return None


# ---------------------------------------------------------------------------------- functions


def check_function(decl: BlockDecl, fn: FnDecl) -> tuple[Graph, list[Diagnostic]]:
    graph = Graph(decl.qualname, fn.name, decl.order.copy())
    ctx = Context(decl.facts(), graph.order, graph, fn.fn.__code__)
    diags: list[Diagnostic] = []

    def diag(message: str, file: str | None, line: int | None, hint: str | None = None) -> None:
        diags.append(Diagnostic(decl.qualname, fn.name, message, file, line, _where_hint(decl, hint)))

    with checking(ctx):
        args = []
        for name, t in fn.params:
            assert isinstance(t, TensorType)
            v = SymTensor(t)
            graph.values[v.vid].name = name
            graph.add_node("input", name, [], [v.vid], fn.file, fn.line)
            args.append(v)
        try:
            out = fn.fn(SelfProxy(decl), *args)
        except ShapeError as e:
            diag(e.message, e.file, e.line, e.hint)
            return graph, diags
        except DeclarationError as e:
            diag(e.message, e.file, e.line)
            return graph, diags
        _check_result(fn, out, ctx, diag)
    return graph, diags


def _where_hint(decl: BlockDecl, hint: str | None) -> str | None:
    """The suggested fact, when a ``where`` clause can say it: only block generics, not ``B`` or ``N``."""
    if hint is None:
        return None
    names = set(re.findall(r"[A-Za-z_]\w*", hint)) - {"min", "max"}
    return hint if names <= {g.name for g in decl.generics if g.is_dim} else None


def _check_result(fn: FnDecl, out: Any, ctx: Context, diag: Any) -> None:
    declared = fn.result.items if isinstance(fn.result, TupleType) else (fn.result,)
    got = out if isinstance(out, tuple) else (out,)
    want_text = fn.result.format(ctx.order)
    if len(got) != len(declared) or not all(isinstance(g, SymTensor) for g in got):
        diag(f"returns {len(got)} value(s) where the declared result is {want_text}", fn.file, fn.line)
        return
    for i, (g, d) in enumerate(zip(got, declared)):
        problems = match(d, g.dims, g.dtype, Binding(), set(), ctx.facts, ctx.order)
        if problems:
            node = next((n for n in reversed(ctx.graph.nodes) if g.vid in n.outputs), None)
            which = f"result {i}" if len(declared) > 1 else "the result"
            diag(f"{which} is {g.show()}, declared {d.format(ctx.order)}: " + "; ".join(map(str, problems)),
                 node.file if node else fn.file, node.line if node else fn.line, _equality_hint(problems))
        ctx.graph.add_node("output", f"result{i}" if len(declared) > 1 else "result", [g.vid], [])


# ------------------------------------------------------------------------------------- blocks


def _declared_types(decl: BlockDecl) -> list[tuple[Type | Poly, int | None]]:
    out: list[tuple[Type | Poly, int | None]] = []
    for m in decl.members:
        if isinstance(m, ParamDecl):
            out.append((m.type, m.line))
        else:
            out.extend((a, m.line) for a in m.args if isinstance(a, Poly))
            if m.count is not None:
                out.append((m.count, m.line))
    for f in decl.functions:
        out.extend((t, f.line) for _, t in f.params)
        out.append((f.result, f.line))
    return out


def _dims_of(t: Type | Poly) -> list[Poly]:
    if isinstance(t, Poly):
        return [t]
    items = t.items if isinstance(t, TupleType) else (t,)
    return [d for item in items for d in item.dims if isinstance(d, Poly)]


def check_block(decl: BlockDecl) -> list[Diagnostic]:
    """Declaration-level facts: divisors positive, and each sub's ``where`` holds for its arguments."""
    facts = decl.facts()
    diags: list[Diagnostic] = []
    seen: set[Poly] = set()
    for t, line in _declared_types(decl):
        for d in _dims_of(t):
            for atom in d.atoms():
                if isinstance(atom, FloorDiv | Mod) and atom.b not in seen:
                    seen.add(atom.b)
                    if not facts.positive(atom.b):
                        den = format_poly(atom.b, decl.order)
                        diags.append(Diagnostic(decl.qualname, None, f"cannot prove the divisor {den} is positive "
                                                f"in {format_poly(d, decl.order)}", decl.file, line, f"{den} > 0"))
    for sub in decl.subs:
        callee = sub.block.decl()
        dims, _ = sub.callee_binding()
        for fact in callee.where:
            lhs, rhs = substitute(fact.lhs, dims), substitute(fact.rhs, dims)
            if not _holds(facts, fact.kind, lhs, rhs):
                same = lhs == fact.lhs and rhs == fact.rhs
                shown = str(fact) if same else _fact_text(fact.kind, lhs, rhs, decl)
                reads = "" if same else f", which here reads `{shown}`,"
                diags.append(Diagnostic(
                    decl.qualname, None,
                    f"sub {sub.name}: {callee.qualname} requires `{fact}`{reads} and this cannot be proved "
                    f"from the where clause of {decl.qualname}", decl.file, sub.line, shown))
    return diags


def _holds(facts: Facts, kind: str, lhs: Poly, rhs: Poly) -> bool:
    if kind == "eq":
        return facts.equal(lhs, rhs)
    if kind == "ge":
        return facts.nonneg(lhs - rhs)
    return facts.divides(lhs, rhs)


def _fact_text(kind: str, lhs: Poly, rhs: Poly, decl: BlockDecl) -> str:
    a, b = format_poly(lhs, decl.order), format_poly(rhs, decl.order)
    mod_atom = lhs.as_atom()
    if kind == "eq" and isinstance(mod_atom, Mod) and rhs == Poly.const(0):
        return f"{_operand(mod_atom.a, decl)} % {_operand(mod_atom.b, decl)} == 0"
    if kind == "ge":
        return f"{a} >= {b}"
    if kind == "divides":
        return f"{b} % {a} == 0"
    return f"{a} == {b}"


def _operand(p: Poly, decl: BlockDecl) -> str:
    text = format_poly(p, decl.order)
    return text if len(p.terms) <= 1 and (p.is_const or p.as_atom() is not None) else f"({text})"


def program_blocks(root: type[Block]) -> list[type[Block]]:
    """The root block and every block it uses, each once, in the order first reached."""
    seen: dict[type[Block], None] = {}

    def visit(cls: type[Block]) -> None:
        if cls in seen:
            return
        seen[cls] = None
        for sub in cls.decl().subs:
            visit(sub.block)

    visit(root)
    return list(seen)


def _check_classes(report: Report, classes: list[type[Block]]) -> Report:
    for cls in classes:
        decl = cls.decl()
        report.blocks.append(decl)
        report.diagnostics.extend(check_block(decl))
        for fn in decl.functions:
            graph, diags = check_function(decl, fn)
            report.graphs[(decl.qualname, fn.name)] = graph
            report.diagnostics.extend(diags)
            report.checked += 1
    return report


def check_program(root: type[Block]) -> Report:
    """Check every function of every block of the program rooted at ``root``."""
    return _check_reading(root, lambda: program_blocks(root))


def check_block_class(cls: type[Block]) -> Report:
    """Check one block's own functions (not its subs' bodies)."""

    def classes() -> list[type[Block]]:
        cls.decl()  # read it here, so a declaration error becomes a diagnostic
        return [cls]

    return _check_reading(cls, classes)


def _check_reading(root: type[Block], classes) -> Report:
    report = Report(root.__name__)
    try:
        found = classes()
    except DeclarationError as e:
        report.diagnostics.append(Diagnostic("declaration", None, e.message, e.file, e.line))
        return report
    return _check_classes(report, found)


__all__ = ["Diagnostic", "Report", "SymDim", "check_block_class", "check_function", "check_program"]
