"""Running every typed function of a program symbolically and proving its declared types.

Each function runs once with symbolic inputs from its annotations. ``self.X`` gives a generic's
symbol, a param its declared type, and a call into a sub checks the callee's *declared* signature
instantiated with the caller's generics (callee bodies are checked once, generically).
"""

from __future__ import annotations

import dis
import itertools
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any

from ..blocks.block import Block
from ..blocks.decl import BlockDecl, DeclarationError, FnDecl, ParamDecl, SubDecl
from ..shapes.facts import Facts
from ..shapes.parse import DimParseError, parse_facts
from ..shapes.poly import FloorDiv, Mod, Poly, Sym, format_poly, ge_text, substitute
from ..types.dtypes import DType, DTypeVar
from ..types.tensor import TensorType, TupleType, Type, Variadic
from ..types.unify import Binding, match
from .graph import Graph
from .language import Watch, code_info, static_refusals
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
                if m.optional and _optional_absent(name):
                    return None
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
                if p.optional and _optional_absent(f"{self.label}.{name}"):
                    return None
                t = SymTensor(p.type.substitute(dims, dtypes))  # type: ignore[arg-type]
                record(f"{self.label}.{name}", [], [t], kind="param")
                return t
        raise ShapeError(f"sub {self.label} ({callee.qualname}) has no function, generic or param {name!r}")


class ArrayProxy:
    """A sub array under the checker: a loop body is checked once, for every layer at once. A slice of
    it (``self.layers[:-1]``) is iterated the same way: the check holds for any number of layers."""

    def __init__(self, sub: SubDecl, sliced: str | None = None) -> None:
        self.sub = sub
        self.sliced = sliced  # "[:-1]" for a slice: iterated like the array, neither measured nor indexed

    def __iter__(self) -> Any:
        """One symbolic iteration standing for every layer, checked as a fixed point.

        The loop-carried values are the caller's local tensors that the body rebinds: each must
        come out of an iteration with the type it went in with, so after any number of layers
        (zero included) it has that type. A list that grows in the body would have a symbolic
        length, so it is refused.
        """
        frame = sys._getframe(1)  # the frame running the ``for`` (through enumerate/zip too)
        loop = _loop_of(self.sub, frame)
        before = dict(frame.f_locals)
        sizes = {k: len(v) for k, v in before.items() if isinstance(v, list | dict | set)}
        cells = {k: _items(v) for k, v in before.items() if isinstance(v, list | dict)}
        pending = getattr(current(), "open_loops", None)
        token = (self.sub.name, frame.f_code.co_filename, frame.f_lineno)
        if pending is not None:
            pending.append(token)
        yield SubProxy(self.sub, f"{self.sub.name}[i]")
        # only reached when the for statement asks for a second layer: the body ran through once
        if pending is not None:
            pending.remove(token)
        after = dict(frame.f_locals)
        targets = set(loop.targets) if loop is not None else set()
        if loop is not None:
            for t in loop.targets:
                if t in loop.loads and not isinstance(after.get(t), SubProxy | SymTensor | tuple):
                    raise ShapeError(f"the loop over {self.sub.name} uses its index {t} in the body: the checker "
                                     "checks one iteration for every layer, so the index would look like 0; give "
                                     "every layer the same code")
        _check_fixed_point(self.sub, before, sizes, after, targets, cells)
        _check_defined_before(self.sub, frame, [k for k in after if k not in before])

    def __len__(self) -> int:
        assert self.sub.count is not None
        if self.sliced is not None:
            raise ShapeError(f"len({self.sub.name}{self.sliced}): the checker iterates a slice of a sub array "
                             "but does not count or index it")
        if self.sub.count.is_const:
            return self.sub.count.value
        raise ShapeError(f"len({self.sub.name}) is the symbolic {format_poly(self.sub.count, current().order)}")

    def __getitem__(self, i: int | slice) -> Any:
        assert self.sub.count is not None
        if self.sliced is not None:
            raise ShapeError(f"{self.sub.name}{self.sliced}[{_show_index(i)}]: the checker iterates a slice of a "
                             f"sub array but does not index it again; index {self.sub.name} itself")
        if isinstance(i, slice):
            # a loop over any run of the layers is checked as the loop over all of them (zero included);
            # a step would still be such a run, but nothing needs one, so it is refused rather than guessed at
            if i.step is not None or not all(b is None or type(b) is int for b in (i.start, i.stop)):
                raise ShapeError(f"{self.sub.name}[{_show_slice(i)}]: a sub array is sliced by constant bounds "
                                 "without a step, such as [:-1] or [1:]")
            return ArrayProxy(self.sub, f"[{_show_slice(i)}]")
        if type(i) is not int:
            raise ShapeError(f"{self.sub.name}[{i!r}]: a sub array is indexed by a constant int")
        if not current().facts.positive(self.sub.count - (i if i >= 0 else -i - 1)):
            raise ShapeError(f"{self.sub.name}[{i}] may be out of range for "
                             f"{format_poly(self.sub.count, current().order)} layers")
        return SubProxy(self.sub, f"{self.sub.name}[{i}]")


def _show_index(i: Any) -> str:
    return _show_slice(i) if isinstance(i, slice) else repr(i)


def _show_slice(s: slice) -> str:
    return ":".join("" if b is None else repr(b) for b in (s.start, s.stop, *(() if s.step is None else (s.step,))))


def _items(v: list | dict) -> list:
    """A list's items, or a dict's keys then values: compared by identity before and after an iteration."""
    return [*v.keys(), *v.values()] if isinstance(v, dict) else list(v)


def _loop_of(sub: SubDecl, frame: Any) -> Any:
    """The ``for`` statement iterating the sub array, from its source; refuse what one iteration cannot stand for."""
    instr = next((i for i in dis.get_instructions(frame.f_code) if i.offset == frame.f_lasti), None)
    if instr is None or instr.opname != "FOR_ITER" or frame.f_code.co_name.startswith("<"):
        raise ShapeError(f"the sub array {sub.name} is iterated other than by a for statement (a comprehension, "
                         "list(), sum() or similar would see a single layer): write a for loop")
    loop = code_info(frame.f_code).loop_at(frame.f_lineno)
    if loop is None:  # no for statement in the source here: an inlined comprehension, or no source at all
        raise ShapeError(f"the sub array {sub.name} is iterated where the checker finds no for statement (a "
                         "comprehension, or code without source): write a for loop")
    if loop.escape is not None:
        raise ShapeError(f"{loop.escape} inside the loop over {sub.name}: the checker checks one iteration for "
                         "every layer, so every layer must run the whole body")
    return loop


def _check_fixed_point(sub: SubDecl, before: dict[str, Any], sizes: dict[str, int], after: dict[str, Any],
                       targets: set[str] | None = None, cells: dict[str, list] | None = None) -> None:
    ctx = current()
    what = f"the loop over {sub.name} ({format_poly(sub.count, ctx.order) if sub.count is not None else 1} layers)"
    for name, old in before.items():
        new = after.get(name, old)
        if new is old:
            continue
        a, b = _tensors_of(old), _tensors_of(new)
        if a is None:
            if name in (targets or ()) or isinstance(new, SubProxy):
                continue
            raise ShapeError(f"{what} carries the Python value {name} from one iteration to the next "
                             f"({_show_value(old)} before an iteration, {_show_value(new)} after it): the checker "
                             "checks one iteration for every layer; compute it before the loop or keep it in a "
                             "tensor of a fixed type")
        if b is None or len(a) != len(b):
            raise ShapeError(f"{what} changes what {name} holds: before an iteration {_show_value(old)}, "
                             f"after it {_show_value(new)}")
        for x, y in zip(a, b):
            problems = match(x.type, y.dims, y.dtype, Binding(shapes=_self_runs(x.type)), set(), ctx.facts,
                             ctx.order)
            if problems:
                raise ShapeError(
                    f"{what} changes the type of {name}: {x.show()} before an iteration, {y.show()} after it "
                    "(a layer stack must map its loop-carried types to themselves): "
                    + "; ".join(map(str, problems)), hint=_equality_hint(problems))
    for name, n in sizes.items():
        v = after.get(name)
        if isinstance(v, list | dict | set) and v is before[name] and len(v) != n:
            raise ShapeError(f"{what} grows {name} by {len(v) - n} per iteration: its length would be symbolic; "
                             "stack the layers' outputs with a typed sub instead")
        if isinstance(v, list | dict) and v is before[name]:
            now = _items(v)
            old_items = (cells or {}).get(name, now)
            if any(x is not y for x, y in zip(old_items, now)):
                raise ShapeError(f"{what} changes an item of {name} in each iteration: a Python list or dict may "
                                 "not carry values from one layer to the next; carry a tensor in a local name")


def _check_defined_before(sub: SubDecl, frame: Any, new: list[str]) -> None:
    """A name first bound inside the loop and read after it needs at least one layer."""
    ctx = current()
    if not new or sub.count is None or ctx.facts.positive(sub.count):
        return
    instrs = list(dis.get_instructions(frame.f_code))
    loop = next((i for i in instrs if i.offset == frame.f_lasti), None)
    if loop is None or loop.opname != "FOR_ITER":
        return
    first: dict[str, str] = {}  # after the loop, whether each name is first read or first bound again
    for i in instrs:
        if i.offset >= loop.argval and i.argval in new and i.argval not in first:
            if i.opname.startswith("LOAD_"):
                first[i.argval] = "load"
            elif i.opname.startswith("STORE_"):
                first[i.argval] = "store"
    read = sorted(n for n, k in first.items() if k == "load")
    if read:
        count = format_poly(sub.count, ctx.order)
        raise ShapeError(f"{', '.join(read)} is bound only inside the loop over {sub.name} and read after it, "
                         f"but {sub.name} may have no layers ({count} may be 0): bind it before the loop",
                         hint=f"{count} > 0")


def _tensors_of(v: Any) -> list[SymTensor] | None:
    if isinstance(v, SymTensor):
        return [v]
    if isinstance(v, tuple) and v and all(isinstance(t, SymTensor) for t in v):
        return list(v)
    return None


def _show_value(v: Any) -> str:
    ts = _tensors_of(v)
    if ts is None:
        return type(v).__name__
    return ", ".join(t.show() for t in ts)


def _self_runs(t: TensorType) -> dict[str, tuple]:
    return {d.name: (d,) for d in t.dims if isinstance(d, Variadic)}


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
    _prove_preconditions(callee, fn, mapping, binding, free_now, label, sig)
    result = fn.result
    outs = [t.substitute(mapping, dtypes) for t in (result.items if isinstance(result, TupleType) else (result,))]
    out_tensors = [SymTensor(binding.apply(t)) for t in outs]  # type: ignore[arg-type]
    node = record(label, inputs, out_tensors, kind="fn" if own else "sub", detail=sig)
    node.callee = (callee.qualname, fn.name)
    back = {v: k for k, v in ((n, n + "'") for n in rename)}
    node.subst = {"dims": {**dims, **{back.get(k, k): v for k, v in binding.dims.items()}},
                  "shapes": dict(binding.shapes), "dtypes": {**dtypes, **binding.dtypes}}
    return tuple(out_tensors) if isinstance(result, TupleType) else out_tensors[0]


def _prove_preconditions(callee: BlockDecl, fn: FnDecl, mapping: dict[str, Poly], binding: Binding,
                         free_now: set[str], label: str, sig: str) -> None:
    """The callee's own dims are positive and its ``where`` facts on them hold, in the caller's terms."""
    ctx = current()
    for n in sorted(free_now):
        v = binding.dims.get(n)
        if v is not None and not ctx.facts.positive(v):
            text = format_poly(v, ctx.order)
            raise ShapeError(f"{label}: {sig} binds its dim {n.rstrip(chr(39))} to {text}, which cannot be proved "
                             "positive", hint=f"{text} > 0")
    for fact in callee.preconditions(fn):
        lhs, rhs = substitute(fact.lhs, mapping), substitute(fact.rhs, mapping)
        lhs, rhs = substitute(lhs, binding.dims), substitute(rhs, binding.dims)
        if not _holds(ctx.facts, fact.kind, lhs, rhs):
            shown = _fact_text(fact.kind, lhs, rhs, None)
            raise ShapeError(f"{label}: {sig} requires `{fact}`, which here reads `{shown}` and cannot be "
                             "proved", hint=shown)


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
    ctx = Context(decl.facts(fn), graph.order, graph, fn.fn.__code__)
    diags: list[Diagnostic] = []

    def diag(message: str, file: str | None, line: int | None, hint: str | None = None) -> None:
        diags.append(Diagnostic(decl.qualname, fn.name, message, file, line, _where_hint(decl, hint)))

    dtype_generics = {g.name for g in decl.generics if g.is_dtype}
    refused = static_refusals(fn.fn, dtype_generics)
    for r in refused:
        diag(f"{r.construct} is outside the language the checker models", r.file, r.line)
    if refused:
        return graph, diags
    ok, read = _run(decl, fn, ctx, diag, frozenset())
    if not ok:
        return graph, diags
    # an optional param may be absent at run time: every combination the function reads is checked too
    if len(read) > MAX_OPTIONAL:
        diag(f"reads {len(read)} optional params ({', '.join(read)}); the checker checks every combination of "
             f"present and absent ones up to {MAX_OPTIONAL}", fn.file, fn.line)
        return graph, diags
    for k in range(1, len(read) + 1):
        for absent in itertools.combinations(read, k):
            scratch = Graph(decl.qualname, fn.name, decl.order.copy())
            sctx = Context(ctx.facts, scratch.order, scratch, fn.fn.__code__)
            prefix = f"with the optional param{'s' if k > 1 else ''} {', '.join(absent)} absent: "
            if not _run(decl, fn, sctx, lambda m, f, ln, h=None, p=prefix: diag(p + m, f, ln, h), frozenset(absent))[0]:
                return graph, diags
    return graph, diags


MAX_OPTIONAL = 6


def _run(decl: BlockDecl, fn: FnDecl, ctx: Context, diag: Any, absent: frozenset[str]) -> tuple[bool, list[str]]:
    """Run ``fn`` once under the checker; False when it reported a diagnostic. Also the optional params it read."""
    ctx.absent = absent  # type: ignore[attr-defined]
    ctx.optional_read = []  # type: ignore[attr-defined]
    ctx.open_loops = []  # type: ignore[attr-defined]
    graph = ctx.graph
    reported: list[str] = []

    def note(message: str, file: str | None, line: int | None, hint: str | None = None) -> None:
        reported.append(message)
        diag(message, file, line, hint)

    with checking(ctx):
        args = []
        for name, t in fn.params:
            assert isinstance(t, TensorType)
            v = SymTensor(t)
            graph.values[v.vid].name = name
            graph.add_node("input", name, [], [v.vid], fn.file, fn.line)
            args.append(v)
        watch = Watch({g.name for g in decl.generics if g.is_dtype}, fn.fn.__code__)
        try:
            with watch:
                out = fn.fn(SelfProxy(decl), *args)
            if watch.found:
                r = watch.found[0]
                refusal = ShapeError(f"{r.construct} is outside the language the checker models")
                refusal.file, refusal.line = r.file, r.line
                raise refusal
            if ctx.open_loops:  # type: ignore[attr-defined]
                name, file, line = ctx.open_loops[0]  # type: ignore[attr-defined]
                stop = ShapeError(f"the loop over {name} stopped before its first iteration was checked (zip with "
                                  "a shorter sequence first, or a break): iterate the sub array alone, or put it "
                                  "first in zip")
                stop.file, stop.line = file, line
                raise stop
        except ShapeError as e:
            diag(e.message, e.file, e.line, e.hint)
            return False, []
        except DeclarationError as e:
            diag(e.message, e.file, e.line)
            return False, []
        except RecursionError:
            diag("recursion under the checker: a block function may not call itself", fn.file, fn.line)
            return False, []
        except Exception as e:  # Python the checker does not model: a diagnostic, never a crash
            file, line = _user_line(e.__traceback__, fn)
            diag(f"{type(e).__name__} under the checker: {e} (the checker models a closed subset of Python; see "
                 "the README's list)", file, line)
            return False, []
        _check_result(fn, out, ctx, note)
    return not reported, list(dict.fromkeys(ctx.optional_read))  # type: ignore[attr-defined]


def _optional_absent(key: str) -> bool:
    """Whether the optional param ``key`` is absent in this run (and note that the function reads it)."""
    ctx = current()
    read = getattr(ctx, "optional_read", None)
    if read is not None:
        read.append(key)
    return key in getattr(ctx, "absent", ())


def _user_line(tb: Any, fn: FnDecl) -> tuple[str | None, int | None]:
    """The innermost traceback line inside the user's source (outside the checker machinery)."""
    from .symbolic import _INTERNAL

    file, line = fn.file, fn.line
    while tb is not None:
        name = os.path.abspath(tb.tb_frame.f_code.co_filename)
        if not name.startswith(_INTERNAL) and os.sep + "kestrel" + os.sep + "blocks" not in name:
            file, line = tb.tb_frame.f_code.co_filename, tb.tb_lineno
        tb = tb.tb_next
    return file, line


def _where_hint(decl: BlockDecl, hint: str | None, facts: Facts | None = None) -> str | None:
    """The suggested fact, when a ``where`` clause can say it and it would help.

    Only facts over the block's generics (not ``B`` or ``N``), never a constant one (``8 == 0``
    is either already true or impossible), and never one the where clause already implies (it
    would change nothing).
    """
    if hint is None:
        return None
    names = set(re.findall(r"[A-Za-z_]\w*", hint)) - {"min", "max"}
    if not names or not names <= {g.name for g in decl.generics if g.is_dim}:
        return None
    try:
        said = parse_facts(hint)
    except DimParseError:
        return None
    facts = facts if facts is not None else decl.facts()
    if all(_holds(facts, f.kind, f.lhs, f.rhs) for f in said):
        return None  # already implied: naming it would not make the diagnostic go away
    if _impossible(said, facts) or facts.satisfiable_with(said) is not True:
        return None  # a fact no binding of the where clause satisfies (or the solver cannot tell)
    return hint


def _impossible(said: list, facts: Facts) -> bool:
    """A fact false at every binding the where clause allows, as far as the prover sees."""
    for f in said:
        diff = facts.simplify(f.lhs - f.rhs)
        if f.kind == "eq" and (facts.positive(diff) or facts.positive(-diff)):
            return True
        if f.kind == "ge" and facts.positive(-diff):
            return True
        if f.kind == "eq" and diff.is_const and diff.value != 0:
            return True
        if f.kind == "ge" and diff.is_const and diff.value < 0:
            return True
        if f.kind == "ge" and all(c < 0 for _, c in diff.terms) and _nonneg_atoms(diff):
            return True  # -X - 3 >= 0 cannot hold for natural X
    return False


def _nonneg_atoms(p: Poly) -> bool:
    return all(isinstance(a, Sym) for m, _ in p.terms for a in m)


def _variadic_names(fn: FnDecl) -> set[str]:
    types = [t for _, t in fn.params] + [fn.result]
    items = [i for t in types for i in (t.items if isinstance(t, TupleType) else (t,))]
    return {d.name for t in items for d in t.dims if isinstance(d, Variadic)}


def _check_result(fn: FnDecl, out: Any, ctx: Context, diag: Any) -> None:
    declared = fn.result.items if isinstance(fn.result, TupleType) else (fn.result,)
    got = out if isinstance(out, tuple) else (out,)
    want_text = fn.result.format(ctx.order)
    if isinstance(out, tuple) != isinstance(fn.result, TupleType):
        shown = (f"a {len(out)}-tuple" if isinstance(out, tuple) else
                 out.show() if isinstance(out, SymTensor) else type(out).__name__)
        diag(f"returns {shown} where the declared result is {want_text}", fn.file, fn.line)
        return
    if len(got) != len(declared) or not all(isinstance(g, SymTensor) for g in got):
        diag(f"returns {len(got)} value(s) where the declared result is {want_text}", fn.file, fn.line)
        return
    for i, (g, d) in enumerate(zip(got, declared)):
        # ``*S`` in the result is the arguments' ``*S``: the run is bound to itself, not inferred afresh
        fixed = Binding(shapes={n: (Variadic(n),) for n in _variadic_names(fn)})
        problems = match(d, g.dims, g.dtype, fixed, set(), ctx.facts, ctx.order)
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
    # every allocated size is a natural number: params' axes, subs' Dim arguments, array lengths
    sizes: list[tuple[Poly, str, int | None]] = []
    for m in decl.members:
        if isinstance(m, ParamDecl):
            sizes += [(d, f"param {m.name}: {m.type.format(decl.order)}", m.line) for d in m.type.dims
                      if isinstance(d, Poly)]
        else:
            sizes += [(a, f"sub {m.name}: generic argument", m.line) for a in m.args if isinstance(a, Poly)]
            if m.count is not None:
                sizes.append((m.count, f"sub array {m.name}: layer count", m.line))
    for d, what, line in sizes:
        if not facts.nonneg(d):
            text = format_poly(d, decl.order)
            diags.append(Diagnostic(decl.qualname, None, f"{what}: cannot prove the size {text} is nonnegative "
                                    f"from the where clause of {decl.qualname}", decl.file, line,
                                    _where_hint(decl, ge_text(d, decl.order), facts)))
    for sub in decl.subs:
        callee = sub.block.decl()
        dims, _ = sub.callee_binding()
        for fact in callee.block_where():
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


def _fact_text(kind: str, lhs: Poly, rhs: Poly, decl: BlockDecl | None) -> str:
    order = decl.order if decl is not None else current().order
    a, b = format_poly(lhs, order), format_poly(rhs, order)
    mod_atom = lhs.as_atom()
    if kind == "eq" and isinstance(mod_atom, Mod) and rhs == Poly.const(0):
        return f"{_operand(mod_atom.a, decl)} % {_operand(mod_atom.b, decl)} == 0"
    if kind == "ge":
        return ge_text(lhs - rhs, order)
    if kind == "divides":
        return f"{b} % {a} == 0"
    return f"{a} == {b}"


def _operand(p: Poly, decl: BlockDecl | None) -> str:
    text = format_poly(p, decl.order if decl is not None else current().order)
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
        try:
            report.diagnostics.extend(check_block(decl))
        except (ShapeError, DeclarationError) as e:
            report.diagnostics.append(Diagnostic(decl.qualname, None, e.message, e.file, e.line))
        except Exception as e:  # a bug in the checker: one diagnostic here, the other blocks still checked
            report.diagnostics.append(Diagnostic(decl.qualname, None, f"internal error of the checker (a bug): "
                                                 f"{type(e).__name__}: {e}", decl.file, None))
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
