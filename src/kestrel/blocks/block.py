"""``Block``: a typed declaration that, bound to concrete generics, is a ``torch.nn.Module``.

Subs become child modules, sub arrays ``ModuleList``s and params ``nn.Parameter``s, so the
``state_dict`` keys are the parameter paths. Entry calls check their inputs against the declared
types before running.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import torch
from torch import nn

from ..errors import KestrelError
from ..shapes.facts import Fact
from ..shapes.poly import Poly, evaluate, format_poly, substitute
from ..types.dtypes import DType, DTypeVar, dtype_named, from_torch
from ..types.tensor import TensorType, TupleType
from ..types.unify import Binding, match
from .decl import BlockDecl, FnDecl, ParamDecl, SubDecl, block_bases, class_annotations, read_block
from .spec import ArraySpec, SubSpec

Generics = dict[str, "int | DType"]


class BindError(KestrelError, ValueError):
    """Generics that do not fit a block: missing, unknown, of the wrong kind, or against ``where``."""


class EntryError(KestrelError, TypeError):
    """An entry called with inputs that do not fit its declared types."""


# Functions run around every entry call of a block: each is called as the entry starts and returns a function to
# call when it returns. The layers above register here (the runtime's memory release after a calibration);
# blocks import none of them.
ENTRY_HOOKS: list[Callable[[], Callable[[], None]]] = []

# every block class by its kestrel module name (``sam``, ``std.nn.conv``), in definition order
REGISTRY: dict[str, list[type[Block]]] = {}


class Block(nn.Module):
    """Base class of every block. See DESIGN.md, "Blocks"."""

    _kestrel_module: ClassVar[str]
    _kestrel_decl: ClassVar[BlockDecl | None]

    def __init_subclass__(cls, module: str | None = None, abstract: bool = False, **kwargs: Any) -> None:
        """``module=`` names the kestrel module the block prints under (default: its Python module's
        last name); ``abstract=True`` marks a base that only other blocks inherit from: it is not
        listed in its module (it may leave generics to its subclasses)."""
        super().__init_subclass__(**kwargs)
        cls._kestrel_module = module or cls.__module__.rsplit(".", 1)[-1]
        cls._kestrel_decl = None
        if not abstract:
            REGISTRY.setdefault(cls._kestrel_module, []).append(cls)
        for name, fn in list(cls.__dict__.items()):
            if getattr(fn, "__kestrel_entry__", False):
                setattr(cls, name, _checked_entry(fn, name))

    def __class_getitem__(cls, args: str) -> SubSpec:  # type: ignore[override]
        return SubSpec(cls, args)

    @classmethod
    def decl(cls) -> BlockDecl:
        """The parsed declaration (generics, members, where facts, typed functions)."""
        if cls.__dict__.get("_kestrel_decl") is None:
            cls._kestrel_decl = read_block(cls, cls._kestrel_module)
        return cls._kestrel_decl  # type: ignore[return-value]

    def __init__(self, **generics: Any) -> None:
        super().__init__()
        decl = type(self).decl()
        self.generics: Generics = bind_generics(decl, generics)
        for name, value in self.generics.items():
            setattr(self, name, value)
        dims = {k: v for k, v in self.generics.items() if isinstance(v, int)}
        dtypes = {k: v for k, v in self.generics.items() if isinstance(v, DType)}
        for m in decl.members:
            if isinstance(m, ParamDecl):
                shape = concrete_shape(m.type, dims)
                dtype = _concrete_dtype(m.type, dtypes)
                self.register_parameter(m.name, nn.Parameter(torch.empty(shape, dtype=dtype.torch)))
            else:
                args = sub_generics(m, dims, dtypes)
                if m.count is None:
                    self.add_module(m.name, m.block(**args))
                else:
                    n = evaluate(m.count, dims)
                    self.add_module(m.name, nn.ModuleList(m.block(**args) for _ in range(n)))

    def configure(self, **settings: Any) -> Block:
        """Set non-shape hyperparameters (``eps=1e-6``) on every block of the program that declares them."""
        unused = set(settings)
        for m in self.modules():
            if isinstance(m, Block):
                for k, v in settings.items():
                    if k in m.decl().settings:
                        setattr(m, k, v)
                        unused.discard(k)
        if unused:
            raise BindError(f"no block of {type(self).decl().qualname} has a setting {', '.join(sorted(unused))}")
        return self

    def drop_optional(self, path: str) -> None:
        """Remove an optional param (``bias?``) that a checkpoint does not provide."""
        owner_path, _, name = path.rpartition(".")
        owner = self.get_submodule(owner_path) if owner_path else self
        assert isinstance(owner, Block)
        p = next((p for p in owner.decl().params if p.name == name), None)
        if p is None or not p.optional:
            raise KeyError(f"{path} is not an optional parameter")
        owner._parameters[name] = None  # forward sees None, state_dict skips it

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.generics.items())


# ------------------------------------------------------------------------------------ variants

_VARIANTS: dict[tuple, type[Block]] = {}


def variant(cls: type[Block], layout: dict[str, Any] | None = None,
            subs: dict[str, type[Block]] | None = None) -> type[Block]:
    """``cls`` laid out otherwise: a subclass whose ``layout`` entries (see ``Layers`` / ``Runs``) and
    named subs are replaced, each sub by another block (a variant of its own) with the same generic
    arguments. It prints as ``cls`` (same module and name) and stands in its place in its program's
    listing; asking twice for the same variant gives the same class."""
    layout = {k: (v if isinstance(v, str) else tuple(v)) for k, v in (layout or {}).items()}
    subs = dict(subs or {})
    current = getattr(cls, "layout", None) or {}
    layout = {k: v for k, v in layout.items() if current.get(k) != v}
    anns: dict[str, Any] = {}
    for base in block_bases(cls):
        anns.update(class_annotations(base))
    subs = {k: v for k, v in subs.items() if _sub_block(anns.get(k)) is not v}
    if not layout and not subs:
        return cls
    key = (cls, tuple(sorted(layout.items())), tuple(sorted(subs.items(), key=lambda kv: kv[0])))
    if key in _VARIANTS:
        return _VARIANTS[key]
    own: dict[str, Any] = {}
    for name, block in subs.items():
        spec = anns.get(name)
        if isinstance(spec, SubSpec):
            own[name] = SubSpec(block, spec.args)
        elif isinstance(spec, ArraySpec):
            own[name] = ArraySpec(SubSpec(block, spec.sub.args), spec.count)
        else:
            raise BindError(f"{cls.decl().qualname} has no sub {name!r} to lay out otherwise")

    class Laid(cls, module=cls._kestrel_module, abstract=True):  # type: ignore[valid-type, misc]
        pass

    Laid.__name__, Laid.__qualname__, Laid.__module__, Laid.__doc__ = (
        cls.__name__, cls.__qualname__, cls.__module__, cls.__doc__)
    Laid.__annotations__ = own
    if layout:
        Laid.layout = {**current, **layout}  # type: ignore[attr-defined]
    _VARIANTS[key] = Laid
    return Laid


def _sub_block(spec: Any) -> type | None:
    if isinstance(spec, SubSpec):
        return spec.block
    if isinstance(spec, ArraySpec):
        return spec.sub.block
    return None


# ------------------------------------------------------------------------------------ binding


def bind_generics(decl: BlockDecl, given: dict[str, Any]) -> Generics:
    """Check and complete a block's generics: every one given or defaulted, of its kind, ``where`` holds."""
    unknown = [k for k in given if decl.generic(k) is None]
    if unknown:
        names = ", ".join(g.name for g in decl.generics)
        raise BindError(f"{decl.qualname} has no generic {', '.join(unknown)}; its generics are {names}")
    out: Generics = {}
    for g in decl.generics:
        value = given.get(g.name, g.default)
        if value is None:
            raise BindError(f"{decl.qualname}: generic {g.name} is not bound")
        if g.is_dim:
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise BindError(f"{decl.qualname}: generic {g.name} must be a natural number, got {value!r}")
        elif g.is_dtype:
            value = dtype_named(value) if isinstance(value, str) else value
            if isinstance(value, torch.dtype):
                value = from_torch(value)
            if not isinstance(value, DType) or not g.kind.admits(value):
                raise BindError(f"{decl.qualname}: generic {g.name}: {g.kind.name} does not admit {value!r}")
        out[g.name] = value
    dims = {k: v for k, v in out.items() if isinstance(v, int)}
    for fact in decl.block_where():
        if not fact_holds(fact, dims):
            said = ", ".join(f"{s.name} = {dims[s.name]}" for s in (fact.lhs - fact.rhs).symbols())
            raise BindError(f"{decl.qualname}: `where {fact}` does not hold for {said}")
    return out


def fact_holds(fact: Fact, dims: dict[str, int]) -> bool:
    try:
        lhs, rhs = evaluate(fact.lhs, dims), evaluate(fact.rhs, dims)
    except ZeroDivisionError:  # ``D % Heads == 0`` at Heads = 0: the fact does not hold
        return False
    if fact.kind == "eq":
        return lhs == rhs
    if fact.kind == "ge":
        return lhs >= rhs
    return lhs != 0 and rhs % lhs == 0


def concrete_shape(t: TensorType, dims: dict[str, int]) -> tuple[int, ...]:
    return tuple(evaluate(d, dims) for d in t.dims)  # type: ignore[arg-type]


def _concrete_dtype(t: TensorType, dtypes: dict[str, DType]) -> DType:
    return dtypes[t.dtype.name] if isinstance(t.dtype, DTypeVar) else t.dtype


def sub_generics(m: SubDecl, dims: dict[str, int], dtypes: dict[str, DType]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for g, a in zip(m.block.decl().generics, m.args):
        if isinstance(a, Poly):
            out[g.name] = evaluate(a, dims)
        elif isinstance(a, DTypeVar):
            out[g.name] = dtypes[a.name]
        else:
            out[g.name] = a
    return out


ManifestRow = tuple[str, tuple[int, ...], DType, bool]


def parameter_manifest(cls: type[Block], generics: dict[str, Any]) -> Iterator[ManifestRow]:
    """Every parameter path with its bound shape and dtype, without allocating anything."""
    decl = cls.decl()
    bound = bind_generics(decl, generics)
    dims = {k: v for k, v in bound.items() if isinstance(v, int)}
    dtypes = {k: v for k, v in bound.items() if isinstance(v, DType)}
    for m in decl.members:
        if isinstance(m, ParamDecl):
            yield m.name, concrete_shape(m.type, dims), _concrete_dtype(m.type, dtypes), m.optional
        else:
            args = sub_generics(m, dims, dtypes)
            prefixes = [m.name] if m.count is None else [f"{m.name}.{i}" for i in range(evaluate(m.count, dims))]
            inner = list(parameter_manifest(m.block, args))
            for prefix in prefixes:
                for path, shape, dtype, opt in inner:
                    yield f"{prefix}.{path}", shape, dtype, opt


# --------------------------------------------------------------------------------- entry checks


def _signature(args: tuple, kwargs: dict) -> tuple | None:
    """What an entry check depends on: each input's shape and dtype (None when an input is no tensor)."""
    items = [*args, *kwargs.values()]
    if not all(type(a) in (torch.Tensor, torch.nn.Parameter) for a in items):
        return None
    return (tuple((tuple(a.shape), a.dtype) for a in args),
            tuple((k, tuple(v.shape), v.dtype) for k, v in kwargs.items()))


def _checked_entry(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``fn`` as the entry ``name`` (its attribute's name: one function may serve as entries of two
    blocks under different names), its inputs checked at the call."""

    @functools.wraps(fn)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(self, Block) and not torch.compiler.is_compiling():
            # an input signature that passed once passes again: the check depends on nothing else (a
            # block's generics are fixed), and it costs ~0.3 ms, 1% of a SAM decode
            key = _signature(args, kwargs)
            passed = self.__dict__.setdefault("_entry_signatures_passed", set())
            if key is None or (name, key) not in passed:
                decl = type(self).decl().function(name)
                if decl is not None:
                    check_entry_inputs(self, decl, args, kwargs)
                if key is not None:
                    passed.add((name, key))
        if not ENTRY_HOOKS:
            return fn(self, *args, **kwargs)
        after = [hook() for hook in ENTRY_HOOKS]
        out = fn(self, *args, **kwargs)
        for done in after:
            done()
        return out

    return call


def check_entry_inputs(block: Block, fn: FnDecl, args: tuple, kwargs: dict) -> Binding:
    """Match the actual tensors with the declared parameter types; raise EntryError naming the problem."""
    try:
        values = fn.arguments(args, kwargs)
    except ValueError as e:
        raise EntryError(str(e)) from None
    dims = {k: v for k, v in block.generics.items() if isinstance(v, int)}
    dtypes = {k: v for k, v in block.generics.items() if isinstance(v, DType)}
    binding = Binding()
    for name, declared in fn.params:
        value = values[name]
        assert not isinstance(declared, TupleType)
        want = declared.substitute(dims, dtypes)  # type: ignore[arg-type]
        if not isinstance(value, torch.Tensor):
            raise EntryError(f"{fn.name}: input {name} must be a torch.Tensor {want}, got {type(value).__name__}")
        actual = [Poly.const(s) for s in value.shape]
        try:
            dtype = from_torch(value.dtype)
        except TypeError:
            raise EntryError(
                f"{block.decl().qualname}.{fn.name}: input {name} has shape {tuple(value.shape)} and dtype "
                f"{value.dtype}, which no declared type can have; declared {declared} = "
                f"{_show_declared(want, binding)} (convert it first, e.g. x.float())") from None
        problems = match(want, actual, dtype, binding, fn.free_dims)
        if problems:
            shown = _show_declared(want, binding)
            raise EntryError(
                f"{block.decl().qualname}.{fn.name}: input {name} has shape {tuple(value.shape)} and dtype "
                f"{from_torch(value.dtype)}, declared {declared} = {shown}: " + "; ".join(map(str, problems)))
    # what the checker assumed of the entry's own dims: positive, and the where facts that name them
    bound = {**dims, **{k: v.value for k, v in binding.dims.items() if v.is_const}}
    for n, _ in fn.generics:
        if n in fn.free_dims and bound.get(n, 1) < 1:
            raise EntryError(f"{block.decl().qualname}.{fn.name}: {n} is {bound[n]}: empty axes are not supported "
                             f"(every function dim is at least 1)")
    for fact in block.decl().preconditions(fn):
        if not fact_holds(fact, bound):
            said = ", ".join(f"{s.name} = {bound[s.name]}" for s in (fact.lhs - fact.rhs).symbols())
            raise EntryError(f"{block.decl().qualname}.{fn.name}: `where {fact}` does not hold for {said}")
    return binding


def _show_declared(t: TensorType, binding: Binding) -> str:
    parts = []
    for d in t.dims:
        parts.append(str(d) if not isinstance(d, Poly) else format_poly(substitute(d, binding.dims)))
    return f"[{', '.join(parts)}; {t.dtype}]"
