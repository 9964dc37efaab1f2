"""The closed language of block functions: what the checker models, and the refusal of everything else.

A block function may use assignments and tuple unpacking, calls of ops, subs and the block's own
functions (and untyped helpers written the same way), ``for`` over a sub array, a tuple or
``range`` of a constant, ``if`` on facts the prover decides, comprehensions over Python tuples, and
tuples as results. The checker runs the function once with symbolic values, so constructs whose
meaning depends on something it does not see are refused, each with its own diagnostic:

- ``try`` (it would swallow the checker's own errors), ``while``, ``with``, ``match``, generators,
  ``global``/``nonlocal``: refused wherever they appear (:func:`static_refusals`);
- comparisons with a dtype generic (``self.T == bf16``): the dtype is only known when bound;
- a loop over a sub array stands for every layer at once, so inside it ``break``, ``continue`` and
  ``return``, a loop index used in the body, and Python values carried from one iteration to the
  next are refused, as is iterating a sub array other than with a ``for`` statement
  (:class:`LoopInfo`, checked when the loop runs).
"""

from __future__ import annotations

import ast
import inspect
import os
import sys
import sysconfig
import textwrap
from dataclasses import dataclass, field
from types import CodeType
from typing import Any

REFUSED = {
    ast.Try: "a try statement (it would hide the checker's own errors): remove it",
    ast.While: "a while loop (its trip count is not a type): loop over a sub array or range of a constant",
    ast.With: "a with statement (it may swallow errors): move it out of the block function",
    ast.AsyncWith: "an async with statement",
    ast.AsyncFor: "an async for loop",
    ast.Await: "await",
    ast.Yield: "a generator (yield): return the values",
    ast.YieldFrom: "a generator (yield from): return the values",
    ast.Global: "a global statement: a block function may only read module constants",
    ast.Nonlocal: "a nonlocal statement: return the value instead",
    ast.Match: "a match statement: branch with if on facts",
}
if hasattr(ast, "TryStar"):
    REFUSED[ast.TryStar] = REFUSED[ast.Try]


@dataclass(frozen=True)
class Refusal:
    construct: str
    file: str
    line: int


@dataclass
class LoopInfo:
    """What a ``for`` statement's source says: its targets, the names its body reads, its escapes."""

    line: int
    end: int
    targets: tuple[str, ...]
    loads: frozenset[str]
    escape: str | None  # "break", "continue" or "return" directly inside it (not in a nested loop)


@dataclass
class CodeInfo:
    loops: list[LoopInfo] = field(default_factory=list)

    def loop_at(self, line: int) -> LoopInfo | None:
        inside = [lp for lp in self.loops if lp.line <= line <= lp.end]
        return max(inside, key=lambda lp: lp.line) if inside else None


def _parse(obj: Any) -> tuple[ast.AST, str, int] | None:
    """The AST of a function or code object, its file and the line offset of its source."""
    try:
        lines, first = inspect.getsourcelines(obj)
        file = inspect.getsourcefile(obj) or "<unknown>"
    except (OSError, TypeError):
        return None
    try:
        tree = ast.parse(textwrap.dedent("".join(lines)))
    except SyntaxError:
        return None
    ast.increment_lineno(tree, first - 1)
    return tree, file, first


def static_refusals(fn: Any, dtype_generics: set[str]) -> list[Refusal]:
    """The constructs outside the closed language in ``fn``'s source (nested helpers included)."""
    parsed = _parse(fn)
    if parsed is None:
        return []
    tree, file, _ = parsed
    out: list[Refusal] = []
    for node in ast.walk(tree):
        for kind, text in REFUSED.items():
            if isinstance(node, kind):
                out.append(Refusal(text, file, node.lineno))
        if isinstance(node, ast.Compare | ast.Call):
            operands = [node.left, *node.comparators] if isinstance(node, ast.Compare) else list(node.args)
            named = [_self_attr(o) for o in operands]
            if isinstance(node, ast.Call) and not (isinstance(node.func, ast.Name) and node.func.id in (
                    "isinstance", "issubclass")):
                continue
            for name in named:
                if name in dtype_generics:
                    out.append(Refusal(f"a branch on the dtype generic {name} (its dtype is only known when the "
                                       "block is bound, so the checker would see one branch): write one path for "
                                       "every dtype, or a cast", file, node.lineno))
    return sorted(set(out), key=lambda r: r.line)


_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LIBS = {os.path.abspath(sysconfig.get_paths()[k]) for k in ("stdlib", "purelib", "platlib")}
_NOT_USER = tuple(_LIBS | {os.path.join(_PKG, d) for d in ("checker", "shapes", "types", "blocks",
                                                            os.path.join("std", "ops"))})


class Watch:
    """While a function is checked, the static refusals of every other Python function it runs.

    Untyped helpers (the block's own methods, module functions) run under the checker too; a profile
    hook sees each code object once and parses its source. Comprehensions and lambdas are parsed with
    the function that holds them.
    """

    def __init__(self, dtype_generics: set[str], checked: CodeType) -> None:
        self.dtype_generics = dtype_generics
        self.seen: set[CodeType] = {checked}
        self.found: list[Refusal] = []

    def __enter__(self) -> Watch:
        self.previous = sys.getprofile()
        sys.setprofile(self._hook)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(self.previous)

    def _hook(self, frame: Any, event: str, arg: Any) -> None:
        if event != "call":
            return
        code = frame.f_code
        if code in self.seen:
            return
        self.seen.add(code)
        name = code.co_filename
        if name.startswith("<") or code.co_name.startswith("<"):
            return
        if os.path.abspath(name).startswith(_NOT_USER):
            return
        self.found += static_refusals(code, self.dtype_generics)


def _self_attr(node: ast.AST) -> str | None:
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return node.attr
    return None


_code_info: dict[CodeType, CodeInfo] = {}


def code_info(code: CodeType) -> CodeInfo:
    """The loops of the function whose code object is ``code`` (parsed once)."""
    found = _code_info.get(code)
    if found is not None:
        return found
    info = CodeInfo()
    parsed = _parse(code)
    if parsed is not None:
        tree = parsed[0]
        func = next((n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
                     and n.lineno == code.co_firstlineno), None)
        for node in ast.walk(func if func is not None else tree):
            if isinstance(node, ast.For):
                info.loops.append(_loop(node))
    _code_info[code] = info
    return info


def _loop(node: ast.For) -> LoopInfo:
    targets = tuple(n.id for n in ast.walk(node.target) if isinstance(n, ast.Name))
    loads = frozenset(n.id for stmt in node.body for n in ast.walk(stmt)
                      if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load))
    return LoopInfo(node.lineno, node.iter.end_lineno or node.lineno, targets, loads, _escape(node.body))


def _escape(body: list[ast.stmt]) -> str | None:
    """``break``/``continue``/``return`` that leaves this loop's iteration (nested loops and functions own theirs)."""
    stack: list[ast.AST] = list(body)
    while stack:
        n = stack.pop()
        if isinstance(n, ast.Break):
            return "break"
        if isinstance(n, ast.Continue):
            return "continue"
        if isinstance(n, ast.Return):
            return "return"
        if isinstance(n, ast.For | ast.While | ast.AsyncFor):
            stack.extend(n.orelse)  # the else of an inner loop belongs to this one
            if any(isinstance(m, ast.Return) for s in n.body for m in ast.walk(s)):
                return "return"
            continue
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef):
            continue
        stack.extend(ast.iter_child_nodes(n))
    return None
