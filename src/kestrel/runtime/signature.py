"""The signature an exported program carries: its entry in the seeds' notation, the generics bound, the
``where`` facts, which generics stay dynamic, and each input's and output's type.

>>> sig = entry_signature(sam, sam.decl().function("decode_points"), dynamic=["B", "Pts"], fixed={"N": 1})
>>> sig.text
'decode_points<B: Dim, Pts: Dim, N: Dim>(image_embeddings: Tensor[B, Hd, 64, 64; T], ...) -> (...)'
>>> sig.bind([(1, 256, 64, 64), (1, 2, 1, 2), (1, 3, 1)], ["f32", "f32", "i32"])
SignatureError: sam::Model.decode_points: input_labels has Pts = 3, input_points has Pts = 2: ...

The same document travels in an ONNX file's ``metadata_props`` (:meth:`Signature.metadata`), in a
``.pte`` export's ``manifest.json`` (``signature`` of each program) and in ``kestrel-onnx`` manifests.
:meth:`Signature.bind` checks a call's concrete inputs against it with the eager entries' matching rule
(:func:`kestrel.types.unify.match`): it binds the dynamic generics from the inputs and names the
generic that differs, and the input that bound it first. ``web/static/signature.js`` is the same check
for the page, on the same document (``shape``/``dtype`` of each port, expressions in the dynamic
generics only).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..blocks.block import fact_holds
from ..blocks.decl import BlockDecl, FnDecl, format_signature
from ..errors import KestrelError
from ..shapes.facts import Fact
from ..shapes.parse import parse_facts
from ..shapes.poly import Poly, evaluate, format_poly, substitute
from ..types.dtypes import DTYPES, DType, DTypeVar
from ..types.tensor import Scope, TensorType, TupleType, parse_type
from ..types.unify import Binding, match

FORMAT = "kestrel-signature/1"
# ONNX metadata_props keys: the JSON document, and the same facts as text for people and other tools
KEY = "kestrel.signature.json"
TEXT_KEYS = ("kestrel.signature", "kestrel.generics", "kestrel.dynamic", "kestrel.where")
EXPORTED = "the export"  # who bound a fixed generic


class SignatureError(KestrelError, ValueError):
    """A call whose inputs do not fit the exported program's signature, or an unreadable signature."""


@dataclass(frozen=True)
class Port:
    """One input or output: its declared type (``Tensor[B, Pts, N, 2; T]``) and, bound, its ``shape``
    (ints, or expressions in the dynamic generics: ``"B"``, ``"3 * Pts"``) and ``dtype``."""

    name: str
    type: str
    shape: tuple[int | str, ...]
    dtype: str

    def row(self) -> dict[str, Any]:
        return {"name": self.name, "type": self.type, "shape": list(self.shape), "dtype": self.dtype}


@dataclass(frozen=True)
class Signature:
    """What an exported program is: see the module docstring."""

    model: str  # "sam::Model"
    entry: str  # the program's name as printed ("decode_points")
    text: str  # the signature in the seeds' notation
    generics: tuple[tuple[str, str], ...]  # the entry's own generics, (name, "Dim")
    bound: dict[str, int | str]  # the model's generics as bound (dtype generics by dtype name)
    dynamic: tuple[str, ...]  # entry generics left dynamic in the program
    fixed: dict[str, int]  # entry generics bound at export
    where: tuple[str, ...]  # the model's where facts, seeds notation
    inputs: tuple[Port, ...]
    outputs: tuple[Port, ...]

    # ---------------------------------------------------------------------------- serialised forms

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "model": self.model, "entry": self.entry, "signature": self.text,
                "generics": [list(g) for g in self.generics], "bound": dict(self.bound),
                "dynamic": list(self.dynamic), "fixed": dict(self.fixed), "where": list(self.where),
                "inputs": [p.row() for p in self.inputs], "outputs": [p.row() for p in self.outputs]}

    @classmethod
    def from_json(cls, doc: Any, source: str = "the signature") -> Signature:
        """Read :meth:`to_json`'s document back; a clear :class:`SignatureError` if it is not one."""
        if isinstance(doc, str):
            try:
                doc = json.loads(doc)
            except json.JSONDecodeError as e:
                raise SignatureError(f"{source}: the carried signature is not JSON: {e}") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
            raise SignatureError(f"{source}: not a Kestrel signature (format {got!r}, expected {FORMAT!r})")
        try:
            def ports(rows: list[dict[str, Any]]) -> tuple[Port, ...]:
                return tuple(Port(r["name"], r["type"], tuple(r["shape"]), r["dtype"]) for r in rows)

            sig = cls(model=doc["model"], entry=doc["entry"], text=doc["signature"],
                      generics=tuple((n, k) for n, k in doc["generics"]), bound=dict(doc["bound"]),
                      dynamic=tuple(doc["dynamic"]), fixed={k: int(v) for k, v in doc["fixed"].items()},
                      where=tuple(doc["where"]), inputs=ports(doc["inputs"]), outputs=ports(doc["outputs"]))
        except (KeyError, TypeError, ValueError) as e:
            raise SignatureError(f"{source}: the carried signature lacks or garbles {e}") from None
        sig.declared_inputs()  # every type parses, or a clear error now rather than at the first call
        return sig

    def metadata(self) -> dict[str, str]:
        """ONNX ``metadata_props``: the JSON document and the same facts as text."""
        return {KEY: json.dumps(self.to_json(), separators=(",", ":")), "kestrel.signature": self.text,
                "kestrel.generics": self.generics_text(), "kestrel.dynamic": ", ".join(self.dynamic) or "none",
                "kestrel.where": ", ".join(self.where)}

    def generics_text(self) -> str:
        """``D = 768, ..., T = f32, N = 1``: the model's generics, then the entry's fixed ones."""
        return ", ".join(f"{k} = {v}" for k, v in [*self.bound.items(), *self.fixed.items()])

    @property
    def qualname(self) -> str:
        return f"{self.model}.{self.entry}"

    # ------------------------------------------------------------------------------------- types

    def _scope(self) -> Scope:
        dtypes = {k: DTypeVar(k, DTYPES[v].kind) for k, v in self.bound.items() if isinstance(v, str) and v in DTYPES}
        dims = {k for k, v in self.bound.items() if isinstance(v, int)} | {n for n, _ in self.generics}
        return Scope(dims=dims, dtypes=dtypes)

    def _parse(self, port: Port) -> TensorType:
        try:
            t = parse_type(port.type, self._scope())
        except KestrelError as e:
            raise SignatureError(f"{self.qualname}: {port.name}: cannot read the carried type {port.type!r}: {e}") \
                from None
        if not isinstance(t, TensorType):
            raise SignatureError(f"{self.qualname}: {port.name}: {port.type!r} is not one tensor type")
        return t

    def _model_bound(self, t: TensorType) -> TensorType:
        dims = {k: v for k, v in self.bound.items() if isinstance(v, int)}
        dtypes = {k: DTYPES[v] for k, v in self.bound.items() if isinstance(v, str) and v in DTYPES}
        return t.substitute(dims, dtypes)  # type: ignore[arg-type]

    def declared_inputs(self) -> list[TensorType]:
        return [self._parse(p) for p in self.inputs]

    def declared_outputs(self) -> list[TensorType]:
        return [self._parse(p) for p in self.outputs]

    def facts(self) -> list[Fact]:
        return [f for text in self.where for f in parse_facts(text)]

    # ------------------------------------------------------------------------------------- calls

    def bind(self, shapes: Sequence[Sequence[int]], dtypes: Sequence[str | DType], where: str = "") -> dict[str, int]:
        """Check one call's inputs (in signature order) and return the entry's generics they bind.

        Raises :class:`SignatureError` naming the input, the generic that differs and the input (or
        the export) that bound it: ``input_labels has Pts = 3, input_points has Pts = 2``.
        """
        prefix = f"{self.qualname}{f' ({where})' if where else ''}: "
        if len(shapes) != len(self.inputs):
            names = ", ".join(p.name for p in self.inputs)
            raise SignatureError(f"{prefix}takes {len(self.inputs)} inputs ({names}), given {len(shapes)}")
        binding = Binding(dims={k: Poly.const(v) for k, v in self.fixed.items()})
        source = dict.fromkeys(self.fixed, EXPORTED)
        free = set(self.dynamic)
        for port, raw, shape, dtype in zip(self.inputs, self.declared_inputs(), shapes, dtypes):
            dt = DTYPES.get(str(dtype))
            if dt is None:
                raise SignatureError(f"{prefix}input {port.name} has dtype {dtype}, which no declared type can have; "
                                     f"declared {port.type} = [{', '.join(map(str, port.shape))}; {port.dtype}]")
            declared = self._model_bound(raw)
            before = set(binding.dims)
            problems = match(declared, [Poly.const(int(s)) for s in shape], dt, binding, free)
            for name in set(binding.dims) - before:
                source[name] = port.name
            if problems:
                why = _explain(port, raw, declared, tuple(int(s) for s in shape), dt, problems[0], binding, source,
                               self.bound)
                shown = ", ".join(format_poly(substitute(d, binding.dims)) for d in declared.dims)  # type: ignore[arg-type]
                raise SignatureError(f"{prefix}{why}: input {port.name} has shape {tuple(int(s) for s in shape)} and "
                                     f"dtype {dt}, declared {port.type} = [{shown}; {declared.dtype}]")
        values = {k: v.value for k, v in binding.dims.items() if v.is_const}
        for name in self.dynamic:
            if values.get(name, 1) < 1:
                raise SignatureError(f"{prefix}{name} is {values[name]} (from {source[name]}): empty axes are not "
                                     "supported (every entry dim is at least 1)")
        known = {**{k: v for k, v in self.bound.items() if isinstance(v, int)}, **values}
        for fact in self.facts():
            names = {s.name for s in (fact.lhs - fact.rhs).symbols()} | {s.name for s in fact.lhs.symbols()}
            if names & free and names <= set(known) and not fact_holds(fact, known):
                said = ", ".join(f"{n} = {known[n]}" for n in sorted(names))
                raise SignatureError(f"{prefix}`where {fact}` does not hold for {said}")
        return {n: values[n] for n, _ in self.generics if n in values}

    def output_shapes(self, binding: Mapping[str, int]) -> list[tuple[int, ...]]:
        """Each output's shape at a binding of the entry's generics (the declared expressions evaluated)."""
        dims = {**{k: v for k, v in self.bound.items() if isinstance(v, int)}, **self.fixed, **binding}
        return [tuple(evaluate(d, dims) for d in t.dims) for t in self.declared_outputs()]  # type: ignore[arg-type]


def _explain(port: Port, raw: TensorType, declared: TensorType, shape: tuple[int, ...], dtype: DType, problem: Any,
             binding: Binding, source: dict[str, str], bound: Mapping[str, int | str]) -> str:
    """The first problem in the issue's words: the generic, both values, and who bound it."""
    if problem.axis is None:
        if len(shape) != len(raw.dims):
            return f"{port.name} has {len(shape)} axes, declared {len(raw.dims)}"
        want = declared.dtype
        return f"{port.name} has dtype {dtype}, declared {raw.dtype}" + (f" = {want}" if str(want) != str(raw.dtype)
                                                                           else "")
    axis = problem.axis
    got = shape[axis]
    expr = raw.dims[axis]
    assert isinstance(expr, Poly)
    sym = expr.as_atom()
    name = getattr(sym, "name", None)
    if name is not None and name in source:
        value = binding.dims[name].value
        if source[name] == EXPORTED:
            return (f"{port.name} has {name} = {got}, but the program was exported with {name} = {value} "
                    f"(fixed at export; an ONNX export with --dynamic {name} keeps it dynamic)")
        return f"{port.name} has {name} = {got}, {source[name]} has {name} = {value}"
    if name is not None and name in bound:
        return f"{port.name} has {name} = {got}, the model binds {name} = {bound[name]}"
    want = substitute(declared.dims[axis], binding.dims)  # type: ignore[arg-type]
    if not want.is_const:
        return f"{port.name} axis {axis}: cannot infer {', '.join(s.name for s in want.symbols())} from {got}"
    said = [f"{s.name} = {binding.dims[s.name].value} from {source.get(s.name, 'the model')}"
            for s in expr.symbols() if s.name in binding.dims]
    said += [f"{s.name} = {bound[s.name]} from the model" for s in expr.symbols() if s.name in bound]
    text = f"{port.name} axis {axis} is {got}, declared {format_poly(expr)}"
    if want.is_const:
        text += f" = {want.value}"
    return text + (f" ({', '.join(said)})" if said else "")


# ----------------------------------------------------------------------------------------- building


def named_entries(decl: BlockDecl, entries: Sequence[str] | None, error: type[Exception]) -> dict[str, FnDecl]:
    """The entries of ``decl`` that ``entries`` names (every one when None), by name in that order;
    ``error`` names those it does not have."""
    available = {f.pyname: f for f in decl.entries}
    names = list(entries) if entries is not None else list(available)
    unknown = [n for n in names if n not in available]
    if unknown:
        raise error(f"{decl.qualname} has no entry {', '.join(map(repr, unknown))}; "
                    f"its entries are {', '.join(available) or 'none'}")
    return {n: available[n] for n in names}


def check_dynamic(what: str, own: Sequence[str], named: Sequence[str], dynamic: Sequence[str],
                  fixed: Collection[str], error: type[Exception]) -> None:
    """Refuse a ``named`` generic that ``what`` does not have, and one both ``dynamic`` and ``fixed``."""
    unknown = [n for n in named if n not in own]
    if unknown:
        raise error(f"{what}: no generic {', '.join(unknown)}; the generics are {', '.join(own) or 'none'}")
    both = [n for n in dynamic if n in fixed]
    if both:
        raise error(f"{what}: {', '.join(both)} is both dynamic and given a fixed value")


def entry_signature(model: Any, fn: FnDecl, dynamic: Sequence[str] = (), fixed: Mapping[str, int] | None = None, *,
                    name: str | None = None, input_names: Sequence[str] | None = None,
                    output_names: Sequence[str] | None = None,
                    results: Sequence[str | TensorType] | None = None) -> Signature:
    """The signature of a program that runs ``fn`` of the bound ``model`` (a Block).

    ``dynamic``: the entry's generics left dynamic; ``fixed``: values of the others (every entry
    generic must be one or the other). ``name``, ``input_names`` and ``output_names`` rename the
    program and its ports; ``results`` replaces the declared result types (notation in the
    block's and the entry's generics, or types) for a program that reshapes an entry's results.
    """
    decl = type(model).decl()
    fixed = dict(fixed or {})
    own = [n for n, k in fn.generics if k == "Dim"]
    if any(k == "Shape" for _, k in fn.generics):
        raise SignatureError(f"{decl.qualname}.{fn.name}: a variadic shape cannot be exported")
    check_dynamic(f"{decl.qualname}.{fn.name}", own, [*dynamic, *fixed], dynamic, fixed, SignatureError)
    missing = [n for n in own if n not in dynamic and n not in fixed]
    if missing:
        raise SignatureError(f"{decl.qualname}.{fn.name}: give {', '.join(missing)} a value or make it dynamic")
    bad = {k: v for k, v in fixed.items() if isinstance(v, bool) or not isinstance(v, int) or v < 1}
    if bad:
        raise SignatureError(f"{decl.qualname}.{fn.name}: fixed generics must be positive ints, got {bad}")

    params = list(fn.params)
    if input_names is not None:
        if len(input_names) != len(params):
            raise SignatureError(f"{fn.name}: {len(input_names)} input names for {len(params)} inputs")
        params = [(n, t) for n, (_, t) in zip(input_names, params)]
    if results is not None:
        scope = Scope(dims={g.name for g in decl.generics if g.is_dim} | set(own),
                      dtypes={g.name: DTypeVar(g.name, g.kind.name) for g in decl.generics if g.is_dtype})
        parsed = [parse_type(r, scope, decl.order) if isinstance(r, str) else r for r in results]
        result: Any = TupleType(tuple(parsed)) if len(parsed) > 1 else parsed[0]  # type: ignore[arg-type]
    else:
        result = fn.result
    shown = dataclasses.replace(fn, name=name or fn.name, params=tuple(params), result=result)
    items = list(result.items) if isinstance(result, TupleType) else [result]
    if output_names is None:
        output_names = ["output"] if len(items) == 1 else [f"output{i}" for i in range(len(items))]
    if len(output_names) != len(items):
        raise SignatureError(f"{fn.name}: {len(output_names)} output names for {len(items)} outputs")

    generics = dict(model.generics)
    dims = {k: v for k, v in generics.items() if isinstance(v, int)}
    dtypes = {k: v for k, v in generics.items() if isinstance(v, DType)}

    def port(pname: str, t: Any) -> Port:
        if not isinstance(t, TensorType):
            raise SignatureError(f"{fn.name}: {pname} is a tuple type; programs take and return tensors")
        b = t.substitute({**dims, **fixed}, dtypes)  # type: ignore[arg-type]
        shape: list[int | str] = []
        for d in b.dims:
            if not isinstance(d, Poly):
                raise SignatureError(f"{fn.name}: {pname} {t.format(decl.order)} has a variadic shape")
            stray = sorted(s.name for s in d.symbols() if s.name not in dynamic)
            if stray:
                raise SignatureError(f"{fn.name}: {pname} {t.format(decl.order)}: {', '.join(stray)} is not bound")
            shape.append(d.value if d.is_const else format_poly(d, decl.order))
        if isinstance(b.dtype, DTypeVar):
            raise SignatureError(f"{fn.name}: {pname}: dtype generic {b.dtype} is not bound")
        return Port(pname, t.format(decl.order), tuple(shape), str(b.dtype))

    return Signature(
        model=decl.qualname, entry=shown.name, text=format_signature(shown, decl.order),
        generics=tuple((n, "Dim") for n in own),
        bound={k: (str(v) if isinstance(v, DType) else v) for k, v in generics.items()},
        dynamic=tuple(n for n in own if n in dynamic), fixed={n: fixed[n] for n in own if n in fixed},
        where=tuple(str(f) for f in decl.where),
        inputs=tuple(port(n, t) for n, t in params),
        outputs=tuple(port(n, t) for n, t in zip(output_names, items)))
