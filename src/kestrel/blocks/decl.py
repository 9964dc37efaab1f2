"""Reading a block class into its declaration: generics, members, where facts, functions.

Parsing is lazy (on first ``decl()``), so a notation error in one block is reported by ``kestrel
check`` with its file and line instead of failing the import of every model.
"""

from __future__ import annotations

import ast
import inspect
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Union

from ..errors import KestrelError
from ..shapes.facts import Fact, Facts
from ..shapes.parse import DimParseError, Parser, parse_facts
from ..shapes.poly import ONE, AtomOrder, Poly
from ..types.dtypes import DTYPES, KINDS, DType, DTypeKind, DTypeVar
from ..types.tensor import Scope, TensorType, Type, TypeParser, parse_param, parse_type
from .spec import ArraySpec, Dim, LayoutSpec, ParamSpec, Shape, SubSpec, group_runs


class DeclarationError(KestrelError):
    """A block declaration that cannot be read: bad notation, unknown generic, wrong sub arguments."""

    def __init__(self, message: str, file: str | None = None, line: int | None = None) -> None:
        self.message, self.file, self.line = message, file, line
        where = f"{file}:{line}: " if file else ""
        super().__init__(where + message)


@dataclass(frozen=True)
class GenericDecl:
    name: str
    kind: Any  # Dim, Shape or a DTypeKind
    default: DType | None = None

    @property
    def is_dim(self) -> bool:
        return self.kind is Dim

    @property
    def is_dtype(self) -> bool:
        return isinstance(self.kind, DTypeKind)


@dataclass(frozen=True)
class ParamDecl:
    name: str
    type: TensorType
    optional: bool
    line: int | None


GenericArg = Union[Poly, DType, DTypeVar]


@dataclass(frozen=True)
class SubDecl:
    name: str
    block: type
    args: tuple[GenericArg, ...]  # one per callee generic, defaults filled in
    count: Poly | None  # a sub array's length, None for a single sub
    line: int | None

    def callee_binding(self) -> tuple[dict[str, Poly], dict[str, DType | DTypeVar]]:
        """The callee's generics in terms of the caller's."""
        dims: dict[str, Poly] = {}
        dtypes: dict[str, DType | DTypeVar] = {}
        for g, a in zip(self.block.decl().generics, self.args):
            if isinstance(a, Poly):
                dims[g.name] = a
            else:
                dtypes[g.name] = a
        return dims, dtypes


@dataclass(frozen=True)
class FnDecl:
    name: str  # as printed: a private ``_embed`` prints as ``embed``
    pyname: str
    visibility: str  # "entry", "pub" or "private"
    generics: tuple[tuple[str, str], ...]  # (name, "Dim" | "Shape") in first-appearance order
    params: tuple[tuple[str, Type], ...]
    result: Type
    fn: Callable[..., Any]
    file: str
    line: int

    @property
    def free_dims(self) -> set[str]:
        return {n for n, k in self.generics if k == "Dim"}

    def arguments(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        """Positional and keyword arguments by parameter name; ValueError naming what does not fit."""
        names = [n for n, _ in self.params]
        values = arguments_by_name(names, args, kwargs, self.name, ValueError)
        missing = [n for n in names if n not in values]
        if missing:
            raise ValueError(f"{self.name}: missing input {missing[0]!r}")
        return values


def arguments_by_name(names: Sequence[str], args: tuple, kwargs: dict, who: str, error: type[Exception],
                      once: bool = False) -> dict[str, Any]:
    """The given positional and keyword arguments by input name (entry calls and exported programs);
    ``error`` naming ``who`` and an extra or unknown input, or with ``once`` one given twice."""
    if len(args) > len(names):
        raise error(f"{who} takes {len(names)} inputs ({', '.join(names)}), given {len(args)}")
    values = dict(zip(names, args))
    for k, v in kwargs.items():
        if k not in names:
            raise error(f"{who} has no input {k!r}; its inputs are {', '.join(names)}")
        if once and k in values:
            raise error(f"{who} input {k} given twice")
        values[k] = v
    return values


def format_signature(fn: FnDecl, order: AtomOrder | None = None) -> str:
    """``name<B: Dim>(x: Tensor[...]) -> Tensor[...]``: an entry as the seeds print it (the inspector's
    listings and the signatures exported programs carry both print with this)."""
    generics = ", ".join(f"*{n}: Shape" if k == "Shape" else f"{n}: Dim" for n, k in fn.generics)
    params = ", ".join(f"{n}: {t.format(order)}" for n, t in fn.params)
    head = f"{fn.name}<{generics}>" if generics else fn.name
    return f"{head}({params}) -> {fn.result.format(order)}"


def _fact_names(f: Fact) -> set[str]:
    return {s.name for s in (f.lhs - f.rhs).symbols()} | {s.name for s in f.lhs.symbols()}


@dataclass
class BlockDecl:
    name: str
    module: str
    cls: type
    generics: list[GenericDecl]
    members: list[ParamDecl | SubDecl] = field(default_factory=list)
    where: list[Fact] = field(default_factory=list)
    functions: list[FnDecl] = field(default_factory=list)
    order: AtomOrder = field(default_factory=AtomOrder)
    settings: dict[str, Any] = field(default_factory=dict)  # non-shape hyperparameters: ``eps: float = 1e-6``
    file: str = ""
    line: int = 0

    @property
    def qualname(self) -> str:
        return f"{self.module}::{self.name}"

    @property
    def params(self) -> list[ParamDecl]:
        return [m for m in self.members if isinstance(m, ParamDecl)]

    @property
    def subs(self) -> list[SubDecl]:
        return [m for m in self.members if isinstance(m, SubDecl)]

    @property
    def entries(self) -> list[FnDecl]:
        return [f for f in self.functions if f.visibility == "entry"]

    def function(self, pyname: str) -> FnDecl | None:
        return next((f for f in self.functions if f.pyname == pyname), None)

    def generic(self, name: str) -> GenericDecl | None:
        return next((g for g in self.generics if g.name == name), None)

    def block_where(self) -> list[Fact]:
        """The facts about the block's own generics (what binding the block checks)."""
        names = {g.name for g in self.generics if g.is_dim}
        return [f for f in self.where if _fact_names(f) <= names]

    def preconditions(self, fn: FnDecl) -> list[Fact]:
        """The facts that name ``fn``'s own dims: every caller of ``fn`` must prove them."""
        names = {g.name for g in self.generics if g.is_dim} | fn.free_dims
        return [f for f in self.where if _fact_names(f) & fn.free_dims and _fact_names(f) <= names]

    def facts(self, fn: FnDecl | None = None) -> Facts:
        """What a body may assume: the block's facts; inside ``fn`` also its preconditions, and that
        its own dims are positive (entry calls and callers prove both)."""
        if fn is None:
            return Facts(self.block_where())
        own = [Fact("ge", Poly.sym(n), ONE, f"{n} > 0") for n in sorted(fn.free_dims)]
        return Facts(self.block_where() + self.preconditions(fn) + own)

    def scope(self, free: bool = False) -> Scope:
        return Scope(
            dims={g.name for g in self.generics if g.is_dim},
            shapes={g.name for g in self.generics if g.kind is Shape},
            dtypes={g.name: DTypeVar(g.name, g.kind.name) for g in self.generics if g.is_dtype},
            free=free,
        )


# ------------------------------------------------------------------------------------ reading


def read_block(cls: type, module: str) -> BlockDecl:
    """Read ``cls`` and the blocks it inherits from: annotations, functions, ``where`` and settings merge
    along the method resolution order (a base's declarations first, in their order; a subclass that
    declares a name again replaces it in place, and its ``where`` facts add to its bases')."""
    file = inspect.getsourcefile(cls) or "<unknown>"
    try:
        _, first = inspect.getsourcelines(cls)
    except (OSError, TypeError):
        first = 0
    bases = block_bases(cls)
    annotations: dict[str, Any] = {}
    member_line: dict[str, int | None] = {}
    for base in bases:
        lines = _member_lines_of(base) if (inspect.getsourcefile(base) or "<unknown>") == file else {}
        for name, ann in class_annotations(base).items():
            annotations[name] = ann
            member_line[name] = lines.get(name)
        if "where" in base.__dict__:
            member_line["where"] = lines.get("where")

    generics: list[GenericDecl] = []
    for name, ann in annotations.items():
        if ann is Dim or ann is Shape or isinstance(ann, DTypeKind):
            default = _class_value(bases, name)
            if default is not None and not isinstance(default, DType):
                raise DeclarationError(f"default of generic {name} must be a dtype", file, member_line.get(name))
            if default is not None and not isinstance(ann, DTypeKind):
                raise DeclarationError(f"generic {name} is a {ann.__name__}: only dtype generics take a default",
                                       file, member_line.get(name))
            if default is not None and isinstance(ann, DTypeKind) and not ann.admits(default):
                raise DeclarationError(f"default of generic {name}: {ann.name} is {default}, which {ann.name} does "
                                       f"not admit", file, member_line.get(name))
            generics.append(GenericDecl(name, ann, default))

    decl = BlockDecl(cls.__name__, module, cls, generics, file=file, line=first)
    decl.settings = {n: _class_value(bases, n) for n, a in annotations.items() if a in (float, int, str, bool)}
    scope = decl.scope()

    for name, ann in annotations.items():
        line = member_line.get(name)
        try:
            if isinstance(ann, ParamSpec):
                ty = parse_param(ann.text, scope, decl.order)
                decl.members.append(ParamDecl(name, TensorType(ty.dims, ty.dtype, ann.optional), ann.optional, line))
            elif isinstance(ann, SubSpec):
                decl.members.append(_read_sub(name, ann, None, decl, line))
            elif isinstance(ann, ArraySpec):
                count = _parse_dim_in(ann.count, scope, decl.order)
                decl.members.append(_read_sub(name, ann.sub, count, decl, line))
            elif isinstance(ann, LayoutSpec):
                decl.members.extend(_read_layout(name, ann, _class_value(bases, "layout"), decl, line))
        except DimParseError as e:
            raise DeclarationError(f"in {decl.qualname}.{name}: {e}", file, line) from None

    for pyname, fn in _typed_functions(cls, bases).items():
        decl.functions.append(_read_function(pyname, fn, decl))

    # read after the functions: a fact may name a function's own dims (``H + 2 * Pad >= K``), and is
    # then a precondition of each function that has them, proved by every caller
    where_text = ", ".join(t for t in (b.__dict__.get("where", "") for b in bases) if t)
    if where_text:
        fn_dims = {n for f in decl.functions for n in f.free_dims}
        try:
            decl.where = parse_facts(where_text, _strict_resolver(scope, fn_dims))
        except DimParseError as e:
            raise DeclarationError(f"in {decl.qualname} where clause: {e}", file, member_line.get("where")) from None
    return decl


def _read_layout(name: str, spec: LayoutSpec, layout: Any, decl: BlockDecl, line: int | None) -> list[SubDecl]:
    """The subs a ``Layers`` / ``Runs`` member stands for under the block's ``layout`` data."""
    kinds = layout.get(name) if isinstance(layout, dict) else None
    known = ", ".join(k for k, _ in spec.kinds)
    if kinds is None:
        raise DeclarationError(f"{decl.qualname}.{name}: the block's `layout` has no entry {name!r} "
                               f"(a kind, or a tuple of kinds, of {known})", decl.file, line)
    single = isinstance(kinds, str)
    listed = (kinds,) if single else tuple(kinds)
    for k in listed:
        if spec.kind(k) is None:
            raise DeclarationError(f"{decl.qualname}.{name}: layout kind {k!r} is not one of {known}", decl.file, line)
    if single and not spec.runs:
        return [_read_sub(name, spec.kind(kinds), None, decl, line)]  # type: ignore[arg-type]
    if single:
        raise DeclarationError(f"{decl.qualname}.{name}: a Runs layout is a tuple of kinds, given {kinds!r}",
                               decl.file, line)
    if not spec.runs:
        return [_read_sub(f"{name}_{i}", spec.kind(k), None, decl, line) for i, k in enumerate(listed)]  # type: ignore[arg-type]
    return [_read_sub(f"{name}_{i}", spec.kind(k), Poly.const(n), decl, line)  # type: ignore[arg-type]
            for i, (k, n) in enumerate(group_runs(listed))]


def block_bases(cls: type) -> list[type]:
    """The blocks ``cls`` is made of, the most basic first and ``cls`` last (its MRO, reversed,
    without ``Block`` itself and the ``torch`` classes below it)."""
    # every block subclass sets ``_kestrel_module`` in its own namespace, ``Block`` itself does not (and
    # blocks.block imports this module, not back)
    return [c for c in reversed(cls.__mro__) if "_kestrel_module" in c.__dict__]


def _class_value(bases: list[type], name: str) -> Any:
    """A class attribute as the most derived block that sets it says (None when none does)."""
    for base in reversed(bases):
        if name in base.__dict__:
            return base.__dict__[name]
    return None


def _typed_functions(cls: type, bases: list[type]) -> dict[str, Callable[..., Any]]:
    """The typed functions along the bases, in the order first declared; an override replaces its
    base's in place. An untyped override of a typed function is refused: the checker would otherwise
    prove the base's body while the override runs."""
    out: dict[str, Callable[..., Any]] = {}
    for base in bases:
        for pyname, fn in base.__dict__.items():
            if not inspect.isfunction(fn) or pyname.startswith("__"):
                continue
            if fn.__annotations__:
                out[pyname] = fn
            elif pyname in out:
                raise DeclarationError(
                    f"{cls.__name__}: {base.__name__}.{pyname} overrides a typed function without its types "
                    f"(write the annotations again)", inspect.getsourcefile(fn), _def_line(fn))
    return out


def _member_lines_of(cls: type) -> dict[str, int]:
    try:
        lines, first = inspect.getsourcelines(cls)
    except (OSError, TypeError):
        return {}
    return _member_lines(lines, first)


def class_annotations(cls: type) -> dict[str, Any]:
    """The class body's annotations as objects, also under ``from __future__ import annotations``."""
    raw = dict(cls.__dict__.get("__annotations__", {}))
    if not any(isinstance(a, str) for a in raw.values()):
        return raw
    module = sys.modules.get(cls.__module__)
    env = dict(vars(module)) if module is not None else {}
    local = dict(cls.__dict__)
    out: dict[str, Any] = {}
    for name, ann in raw.items():
        if isinstance(ann, str):
            try:
                ann = eval(ann, env, local)  # the text of ``Param["D; T"]``, ``Dim``, ``Linear["D, D, T"]``
            except Exception:
                pass  # not one of kestrel's declarations: left as text, as before
        out[name] = ann
    return out


def _type_text(annotation: Any) -> Any:
    """A function annotation's notation; postponed evaluation keeps ``"Tensor[...]"`` with its quotes."""
    if isinstance(annotation, str) and len(annotation) >= 2 and annotation[0] == annotation[-1] in "'\"":
        try:
            value = ast.literal_eval(annotation)
        except (ValueError, SyntaxError):
            return annotation
        return value if isinstance(value, str) else annotation
    return annotation


def _member_lines(lines: list[str], first: int) -> dict[str, int]:
    out: dict[str, int] = {}
    for i, text in enumerate(lines):
        m = re.match(r"\s*([A-Za-z_]\w*)\s*[:=]", text)
        if m and m.group(1) not in out:
            out[m.group(1)] = first + i
    return out


def _strict_resolver(scope: Scope, fn_dims: set[str] = frozenset()):  # type: ignore[assignment]
    def resolve(name: str, col: int) -> Poly:
        if name in scope.dims or name in fn_dims:
            return Poly.sym(name)
        raise DimParseError(f"unbound generic {name!r}", name, 0)

    return resolve


def _parse_dim_in(text: str, scope: Scope, order: AtomOrder) -> Poly:
    p = TypeParser(text, scope, order)
    out = p.expr()
    p.finish()
    return out


def _read_sub(name: str, spec: SubSpec, count: Poly | None, caller: BlockDecl, line: int | None) -> SubDecl:
    # a block class is one with a declaration (``Block.decl``); blocks.block imports this module, not back
    if not (isinstance(spec.block, type) and callable(getattr(spec.block, "decl", None))
            and hasattr(spec.block, "_kestrel_module")):
        raise DeclarationError(f"sub {name}: {spec.block!r} is not a block", caller.file, line)
    callee = spec.block.decl()
    scope = caller.scope()
    p = TypeParser(spec.args, scope, caller.order)
    args: list[GenericArg] = []
    for i, g in enumerate(callee.generics):
        if p.tok.kind == "end":
            if g.default is None:
                missing = ", ".join(x.name for x in callee.generics[i:])
                raise DeclarationError(
                    f"sub {name}: {callee.qualname} needs generics {missing} (given {len(args)} of "
                    f"{len(callee.generics)})", caller.file, line)
            args.append(g.default)
            continue
        if i and not p.accept(","):
            raise p.error("expected ','")
        if g.is_dtype:
            args.append(_read_dtype_arg(p, scope, g, callee, name))
        elif g.is_dim:
            args.append(p.expr())
        else:
            raise p.error(f"generic {g.name} of kind Shape cannot be passed to a sub")
    if p.tok.kind != "end":
        raise DeclarationError(
            f"sub {name}: {callee.qualname} takes {len(callee.generics)} generics, given more: {spec.args!r}",
            caller.file, line)
    return SubDecl(name, spec.block, tuple(args), count, line)


def _read_dtype_arg(p: Parser, scope: Scope, g: GenericDecl, callee: BlockDecl, sub: str) -> DType | DTypeVar:
    tok = p.tok
    p.i += 1
    if tok.kind == "name" and tok.text in scope.dtypes:
        var = scope.dtypes[tok.text]
        if not set(KINDS[var.kind].members) <= set(g.kind.members):
            raise p.error(f"sub {sub}: generic {g.name}: {g.kind.name} of {callee.qualname} is given "
                          f"{var.name}: {var.kind}, which may be a dtype {g.kind.name} does not admit", tok)
        return var
    if tok.kind == "name" and tok.text in DTYPES:
        d = DTYPES[tok.text]
        if not g.kind.admits(d):
            raise p.error(f"sub {sub}: generic {g.name}: {g.kind.name} of {callee.qualname} does not admit {d}", tok)
        return d
    raise p.error(f"sub {sub}: generic {g.name} of {callee.qualname} is a dtype ({g.kind.name}), "
                  f"given {tok.text!r}", tok)


def _read_function(pyname: str, fn: Callable[..., Any], decl: BlockDecl) -> FnDecl:
    fn = inspect.unwrap(fn)  # entries are wrapped with their run-time input check
    file = inspect.getsourcefile(fn) or decl.file
    line = _def_line(fn)
    sig = inspect.signature(fn)
    scope = decl.scope(free=True)
    params: list[tuple[str, Type]] = []
    try:
        for pname, p in list(sig.parameters.items())[1:]:
            ann = _type_text(p.annotation)
            if ann is inspect.Parameter.empty or not isinstance(ann, str):
                raise DeclarationError(
                    f"{decl.qualname}.{pyname}: parameter {pname} needs a type such as \"Tensor[B, N, D; T]\"",
                    file, line)
            params.append((pname, parse_type(ann, scope, decl.order)))
        ret = _type_text(sig.return_annotation)
        if ret is inspect.Signature.empty or not isinstance(ret, str):
            raise DeclarationError(f"{decl.qualname}.{pyname}: the result needs a type", file, line)
        result = parse_type(ret, scope, decl.order)
    except DimParseError as e:
        raise DeclarationError(f"in {decl.qualname}.{pyname}: {e}", file, line) from None
    if getattr(fn, "__kestrel_entry__", False):
        visibility = "entry"
    elif pyname.startswith("_"):
        visibility = "private"
    else:
        visibility = "pub"
    name = pyname[1:] if pyname.startswith("_") else pyname
    return FnDecl(name, pyname, visibility, tuple(scope.new_order), tuple(params), result, fn, file, line)


def _def_line(fn: Callable[..., Any]) -> int:
    """The line of the ``def`` itself (``co_firstlineno`` points at the first decorator)."""
    try:
        lines, first = inspect.getsourcelines(fn)
    except (OSError, TypeError):
        return fn.__code__.co_firstlineno
    for i, text in enumerate(lines):
        if re.match(r"\s*(async\s+)?def\s", text):
            return first + i
    return first
