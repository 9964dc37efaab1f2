"""ONNX export: one ``.onnx`` file per entry of a bound model, and a ``manifest.json`` that lists them.

>>> vit = kestrel.load("vit-base-patch16-224")
>>> export_onnx(vit, "out/")                    # out/forward.onnx, out/features.onnx, out/manifest.json
>>> export_onnx(sam, "out/", entries=["decode_points"], dynamic=["B", "Pts"])   # N fixed (at 1)

Each entry's inputs are built from its declared parameter types with the model's generics bound.
The entry's own generics (a batch ``B``, prompt counts ``Pts``, ``N``...) stay dynamic by default:
each dynamic axis is named after its generic (``B``, ``Pts``), an axis derived from one (``3 * Pts``)
is named by its expression, and the others are fixed (``dims={"N": 1}``, ``batch=8``; ``dynamic=[]``
fixes them all, at 1 unless given). Every file carries its signature in ``metadata_props``
(:mod:`kestrel.runtime.signature`): the entry in the seeds' notation, the generics bound, the
``where`` facts, which generics are dynamic, and each port's type; ``kestrel.exported.load`` checks
calls against it.

Proved at export: the written program runs in onnxruntime at the traced binding and, for each
dynamic generic, at two other values; every output must have the shape the declared expressions
give, and the numbers must match Kestrel eager (1e-4 of the largest reference value). A program
that does not is an :class:`ExportError` and nothing is written.

The exporter is ``torch.onnx.export(..., dynamo=True)`` (``torch.export`` then onnxscript): on this
stack it exports every entry with dynamic axes, where the legacy TorchScript exporter fails on
``layer_norm``'s ``x.shape[-1]`` once the batch is dynamic. Files are written to a temporary
folder beside the destination and renamed into place, so a failed or interrupted export never
leaves a truncated model behind; models over 2 GB keep their weights in ``<entry>.onnx.data``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ..blocks import Block
from ..blocks.decl import FnDecl
from ..errors import KestrelError
from ..runtime.output import prepare_output, prepare_output_dir, write_bytes
from ..runtime.signature import Signature, SignatureError, check_dynamic, entry_signature, named_entries
from ..shapes.poly import Poly, format_poly, substitute
from ..types.dtypes import DType, DTypeVar
from ..types.tensor import TensorType, TupleType, Variadic
from .manifest import quiet, sha256_file

MANIFEST = "manifest.json"
MANIFEST_FORMAT = "kestrel-onnx/1"
EXAMPLE_BATCH = 2  # traced batch when B is dynamic: 0 and 1 would be specialised by torch.export
# traced values of the dynamic generics, in order of appearance: distinct, so that torch.export never
# takes two generics for one, and none is 0 or 1 (which it would specialise)
EXAMPLE_VALUES = (2, 3, 5, 7, 11, 13, 17, 19)
REL_TOLERANCE = 1e-4


class ExportError(KestrelError, RuntimeError):
    """An entry that could not be exported, naming the entry and the cause."""


@dataclass(frozen=True)
class InputSpec:
    name: str
    shape: tuple[int | str, ...]  # a str is a dynamic axis ("B", "3 * Pts")
    dtype: DType


class _Entry(nn.Module):
    """The model seen through one entry: ``forward(*inputs)`` calls ``model.<entry>(*inputs)``."""

    def __init__(self, model: Block, entry: str) -> None:
        super().__init__()
        self.model = model
        self.entry = entry

    def forward(self, *inputs: torch.Tensor) -> Any:
        return getattr(self.model, self.entry)(*inputs)


def export_onnx(model: Block, out_dir: str | os.PathLike[str], *, batch: int | None = None,
                entries: Sequence[str] | None = None, dims: dict[str, int] | None = None,
                dynamic: Sequence[str] | None = None, opset: int | None = None, verify: bool = True,
                progress: Callable[[str], None] | None = None) -> list[Path]:
    """Write ``<entry>.onnx`` for each entry (all of the model's, or ``entries``) and ``manifest.json``.

    ``dynamic``: the entry generics that stay dynamic (default: every entry's own generics, the
    batch and prompt counts, less those fixed by ``batch`` or ``dims``); the others are fixed at
    ``dims`` (``B`` at ``batch``), 1 where not given. ``verify`` runs each written program at
    several values of each dynamic generic (see the module docstring). Returns the ``.onnx`` paths
    in entry order. Raises :class:`ExportError` naming the entry and the cause.
    """
    if not isinstance(model, Block):
        raise ExportError(f"export_onnx takes a Kestrel model (a Block), got {type(model).__name__}")
    if batch is not None and (isinstance(batch, bool) or not isinstance(batch, int) or batch < 1):
        raise ExportError(f"batch must be a positive int or None (dynamic), got {batch!r}")
    decl = type(model).decl()
    chosen = named_entries(decl, entries, ExportError)
    names = list(chosen)
    if not names:
        raise ExportError(f"{decl.qualname}: no entries to export")
    fixed_given = {**dict(dims or {}), **({"B": batch} if batch is not None else {})}
    if dynamic is not None:
        own = sorted({n for fn in chosen.values() for n in fn.free_dims})
        check_dynamic(f"--dynamic, the exported entries of {decl.qualname}", own, dynamic, dynamic, fixed_given,
                      ExportError)
    plans = [plan_entry(model, fn, dynamic, fixed_given) for fn in chosen.values()]

    out = prepare_output_dir(out_dir)
    for target in [*(out / f"{n}.onnx" for n in names), out / MANIFEST]:
        prepare_output(target)  # before the work: no symlink, device or folder in the way
    say = progress or (lambda msg: None)
    was_training = model.training
    model.eval()
    rows: list[dict[str, Any]] = []
    paths: list[Path] = []
    try:
        for plan in plans:
            say(f"{plan.fn.pyname}.onnx: exporting ({_dynamic_text(plan.signature)})")
            path, row = _export_entry(model, plan, out, opset, verify, say)
            paths.append(path)
            rows.append(row)
    finally:
        model.train(was_training)
    manifest = {
        "format": MANIFEST_FORMAT,
        "model": decl.qualname,
        "generics": {k: str(v) if isinstance(v, DType) else v for k, v in model.generics.items()},
        "exporter": f"torch.onnx.export(dynamo=True), torch {torch.__version__}",
        "batch": batch if batch is not None else "dynamic",
        "dynamic": sorted({g for p in plans for g in p.signature.dynamic}),
        "files": rows,
    }
    write_bytes(out / MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode())
    return paths


def _dynamic_text(sig: Signature) -> str:
    dyn = ", ".join(sig.dynamic) or "none"
    fixed = ", ".join(f"{k} = {v}" for k, v in sig.fixed.items())
    return f"dynamic {dyn}" + (f"; fixed {fixed}" if fixed else "")


# --------------------------------------------------------------------------------------- inputs


@dataclass
class EntryPlan:
    """What one entry's export needs: its signature, input specs, traced examples and their binding."""

    fn: FnDecl
    signature: Signature
    specs: list[InputSpec]
    examples: list[torch.Tensor]
    binding: dict[str, int]  # the traced values of the dynamic generics
    dynamic_shapes: tuple[Any, ...] | None


def plan_entry(model: Block, fn: FnDecl, dynamic: Sequence[str] | None, fixed: dict[str, int]) -> EntryPlan:
    """The signature and traced inputs of one entry: ``dynamic`` generics (None: all of the entry's
    not in ``fixed``) traced at :data:`EXAMPLE_VALUES`, the others at ``fixed`` or 1."""
    qual = f"{type(model).decl().qualname}.{fn.pyname}"
    own = [n for n, k in fn.generics if k == "Dim"]
    if dynamic is None:
        dyn = [n for n in own if n not in fixed]
    else:
        dyn = [n for n in own if n in dynamic]
    fix = {n: fixed.get(n, 1) for n in own if n not in dyn}
    try:
        sig = entry_signature(model, fn, dyn, fix)
    except SignatureError as e:
        raise ExportError(f"{qual}: {e}") from None
    binding = dict(zip(dyn, EXAMPLE_VALUES))
    generic_dims = {k: v for k, v in model.generics.items() if isinstance(v, int)}
    generic_dtypes = {k: v for k, v in model.generics.items() if isinstance(v, DType)}
    dims_of = {n: torch.export.Dim(n, min=1) for n in dyn}
    specs: list[InputSpec] = []
    shapes: list[dict[int, Any] | None] = []
    for pname, declared in fn.params:
        if isinstance(declared, TupleType):
            raise ExportError(f"{qual}: input {pname} is a tuple type; entries take tensors")
        bound = declared.substitute({**generic_dims, **fix}, generic_dtypes)  # type: ignore[arg-type]
        if any(isinstance(d, Variadic) for d in bound.dims):
            raise ExportError(f"{qual}: input {pname} {declared} has a variadic shape; cannot build an example")
        if isinstance(bound.dtype, DTypeVar):
            raise ExportError(f"{qual}: input {pname} {declared}: dtype generic {bound.dtype} is not bound")
        shape: list[int | str] = []
        axes: dict[int, Any] = {}
        for i, d in enumerate(bound.dims):
            assert isinstance(d, Poly)
            if d.is_const:
                shape.append(d.value)
                continue
            axes[i] = _torch_dim(d, dims_of, qual, pname)
            shape.append(format_poly(d, type(model).decl().order))
        specs.append(InputSpec(pname, tuple(shape), bound.dtype))
        shapes.append(axes or None)
    examples = example_inputs(specs, binding)
    try:
        sig.bind([tuple(t.shape) for t in examples], [str(s.dtype) for s in specs])
    except SignatureError as e:
        raise ExportError(f"{qual}: the traced binding {binding} does not fit: {e}") from None
    return EntryPlan(fn, sig, specs, examples, binding, (tuple(shapes),) if dyn else None)


def _torch_dim(d: Poly, dims_of: dict[str, Any], qual: str, pname: str) -> Any:
    """``torch.export.Dim`` for an axis that is a dynamic generic ``X`` or ``a * X + b``."""
    syms = d.symbols()
    if len(syms) == 1:
        x = syms[0].name
        b = substitute(d, {x: 0})
        a = substitute(d, {x: 1}) - b
        if a.is_const and b.is_const and a.value >= 1 and Poly.sym(x) * a.value + b.value == d:
            return dims_of[x] if (a.value, b.value) == (1, 0) else dims_of[x] * a.value + b.value
    raise ExportError(f"{qual}: input {pname} has an axis {format_poly(d)} that is not linear in one dynamic "
                      f"generic; fix {', '.join(s.name for s in syms)} (e.g. --dynamic without it)")


def example_inputs(specs: Sequence[InputSpec], binding: dict[str, int], seed: int = 0) -> list[torch.Tensor]:
    """Inputs at a binding of the dynamic generics: seeded normal floats, zero integers."""
    from ..shapes.parse import parse_dim
    from ..shapes.poly import evaluate

    gen = torch.Generator().manual_seed(seed)
    out = []
    for s in specs:
        shape = [d if isinstance(d, int) else evaluate(parse_dim(d), binding) for d in s.shape]
        if s.dtype.kind == "Float":
            out.append(torch.randn(shape, generator=gen).to(s.dtype.torch))
        else:
            out.append(torch.zeros(shape, dtype=s.dtype.torch))
    return out


def entry_inputs(model: Block, fn: FnDecl, batch: int | None, dims: dict[str, int]
                 ) -> tuple[list[InputSpec], list[torch.Tensor]]:
    """The entry's inputs with ``B`` dynamic (``batch=None``) or fixed and the other generics at ``dims``.

    Returns the specs (dynamic ``B`` as the string ``"B"``) and example tensors (seeded normal
    for floats, zeros for integers, at batch ``EXAMPLE_BATCH`` when ``B`` is dynamic).
    """
    missing = [n for n, k in fn.generics if k == "Dim" and n != "B" and n not in dims]
    if missing:
        raise ExportError(f"{fn.name}: free dimension {', '.join(missing)}; give it with dims={{{missing[0]!r}: ...}}")
    plan = plan_entry(model, fn, [] if batch is not None else ["B"],
                      {**{k: v for k, v in dims.items() if k in fn.free_dims},
                       **({"B": batch} if batch is not None else {})})
    return plan.specs, plan.examples


def fixed_signature(model: Block, fn: FnDecl, batch: int, dims: dict[str, int]) -> Signature:
    """The signature of a program of ``fn`` with every generic fixed (``B`` at ``batch``, the others
    at ``dims``): what an ExecuTorch program carries in its manifest."""
    fixed = {**{k: v for k, v in dims.items() if k in fn.free_dims}, "B": batch}
    return entry_signature(model, fn, (), {k: v for k, v in fixed.items() if k in fn.free_dims})


def _result_items(fn: FnDecl) -> list[TensorType]:
    return list(fn.result.items) if isinstance(fn.result, TupleType) else [fn.result]  # type: ignore[list-item]


# -------------------------------------------------------------------------------------- export


def _export_entry(model: Block, plan: EntryPlan, out: Path, opset: int | None, verify: bool,
                  say: Callable[[str], None]) -> tuple[Path, dict[str, Any]]:
    fn, sig = plan.fn, plan.signature
    name = fn.pyname
    qual = f"{type(model).decl().qualname}.{name}"
    specs, inputs = plan.specs, plan.examples
    output_names = [p.name for p in sig.outputs]
    try:
        with torch.no_grad():
            getattr(model, name)(*inputs)  # the run-time input check, with a clear error, before tracing
    except Exception as e:
        raise ExportError(f"{qual}: the example inputs {[s.shape for s in specs]} do not run: {e}") from e

    try:
        # torch.export first, here: torch.onnx.export would fall back to strategies that quietly fix a
        # dynamic axis the program specialises; torch.export refuses that, and names the generic
        with torch.no_grad(), _quiet():
            traced = torch.export.export(_Entry(model, name), tuple(inputs), dynamic_shapes=plan.dynamic_shapes,
                                         strict=False)
    except Exception as e:
        raise ExportError(f"{qual}: {_export_failure(e, plan)}") from e
    try:
        with torch.no_grad(), _quiet():
            program = torch.onnx.export(
                traced, tuple(inputs), None, input_names=[s.name for s in specs],
                output_names=output_names, opset_version=opset, dynamo=True, verbose=False, report=False)
    except Exception as e:
        cause = str(e).strip().splitlines()
        raise ExportError(f"{qual}: torch.onnx.export failed: {type(e).__name__}: "
                          f"{cause[0] if cause else ''}") from e
    if program is None:
        raise ExportError(f"{qual}: torch.onnx.export returned no program")
    carry_signature(program, sig)

    filename = f"{name}.onnx"
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=out))
    try:
        try:
            program.save(tmp / filename)
        except Exception as e:
            raise ExportError(f"{qual}: writing {filename} failed: {e}") from e
        checked = verify_program(tmp / filename, sig, _Entry(model, name), plan.binding, say) if verify else []
        written = sorted(p.name for p in tmp.iterdir())
        data_files = [n for n in written if n != filename]
        row = _describe(tmp / filename, name, specs, output_names, data_files)
        row["signature"] = sig.to_json()
        if verify:
            row["verified"] = checked
        for n in [*data_files, filename]:  # the model last: it is what readers look for
            os.replace(tmp / n, prepare_output(out / n))  # never through a symlink or over a device
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out / filename, row


def _export_failure(e: BaseException, plan: EntryPlan) -> str:
    """Why torch.export refused: a dynamic generic the program specialises is named, with the fix."""
    text = str(e)
    fixed = [g for g in plan.signature.dynamic
             if f"Constraints violated ({g})" in text or f"marked {g} as dynamic" in text]
    if fixed:
        g = fixed[0]
        return (f"{g} cannot stay dynamic: the program's code fixes it at the traced value {plan.binding[g]} "
                f"(torch.export: {_first_line(text)}); export with {g} fixed (--dynamic without {g}"
                f"{', or --batch N' if g == 'B' else ''})")
    return f"torch.export failed: {type(e).__name__}: {_first_line(text)}"


def _first_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[0] if lines else ""


def carry_signature(program: Any, sig: Signature) -> None:
    """Stamp an ``ONNXProgram`` (before saving) with ``sig``: ``metadata_props``, and every graph input
    and output axis named as the signature's bound shape has it (``B``, ``3 * Pts``, or fixed)."""
    import onnx_ir as ir

    model = program.model
    model.metadata_props.update(sig.metadata())
    graph = model.graph
    for values, ports in ((graph.inputs, sig.inputs), (graph.outputs, sig.outputs)):
        for value, port in zip(values, ports):
            value.shape = ir.Shape(list(port.shape))


def verify_program(path: Path, sig: Signature, reference: Callable[..., Any], traced: dict[str, int],
                   say: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Run the written program at the traced binding and, per dynamic generic, at two other values
    (the others held at their traced values): output shapes as declared, numbers as ``reference``'s
    (the eager entry). Returns one row per binding; raises :class:`ExportError` otherwise."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    specs = [InputSpec(p.name, p.shape, _dtype(p.dtype)) for p in sig.inputs]
    rows = []
    for binding in verification_bindings(sig, traced, specs):
        shown = ", ".join(f"{k} = {v}" for k, v in binding.items()) or "its fixed shapes"
        if say is not None:
            say(f"{path.name}: checking at {shown}")
        inputs = example_inputs(specs, binding, seed=1)
        try:
            got = session.run(None, {s.name: t.numpy() for s, t in zip(specs, inputs)})
        except Exception as e:  # a size the traced program fixed where the signature says dynamic
            raise ExportError(f"{sig.qualname} ({path.name}) at {shown}: onnxruntime cannot run the exported "
                              f"program ({_first_line(str(e))[:300]}): it does not hold at every value of "
                              f"{', '.join(sig.dynamic)}") from e
        with torch.no_grad():
            want = reference(*inputs)
        want = list(want) if isinstance(want, (tuple, list)) else [want]
        worst = 0.0
        for port, g, w, shape in zip(sig.outputs, got, want, sig.output_shapes(binding)):
            if tuple(g.shape) != shape:
                raise ExportError(f"{sig.qualname} ({path.name}) at {shown}: output {port.name} has shape "
                                  f"{tuple(g.shape)}, declared {port.type} = {list(shape)}: the exported program "
                                  "does not follow the declared expressions")
            rel = relative_difference(g, w)
            if rel > REL_TOLERANCE:
                raise ExportError(f"{sig.qualname} ({path.name}) at {shown}: output {port.name} differs from Kestrel "
                                  f"eager by {rel:.2e} of its largest value (tolerance {REL_TOLERANCE})")
            worst = max(worst, rel)
        rows.append({"binding": binding, "outputs": [list(map(int, g.shape)) for g in got], "worst_relative": worst})
    return rows


def relative_difference(got: Any, want: torch.Tensor) -> float:
    """``max |got - want| / max |want|`` in float64 (the difference itself where ``want`` is all zeros, 0 where
    empty): how far an exported program's output is from Kestrel eager's."""
    ref = want.detach().to(torch.float64).numpy()
    if ref.size == 0:
        return 0.0
    diff = float(np.abs(np.asarray(got, dtype=np.float64) - ref).max())
    scale = float(np.abs(ref).max())
    return diff / scale if scale > 0 else diff


def verification_bindings(sig: Signature, traced: dict[str, int], specs: Sequence[InputSpec]) -> list[dict[str, int]]:
    """The traced binding, then for each dynamic generic two other values that the ``where`` facts allow."""
    out = [dict(traced)]
    for g in sig.dynamic:
        found = 0
        for v in range(1, traced[g] + 8):
            if v == traced[g]:
                continue
            b = {**traced, g: v}
            try:
                sig.bind([tuple(t.shape) for t in example_inputs(specs, b)], [str(s.dtype) for s in specs])
            except SignatureError:
                continue
            out.append(b)
            found += 1
            if found == 2:
                break
    return out


def _dtype(name: str) -> DType:
    from ..types.dtypes import DTYPES

    return DTYPES[name]


def _describe(path: Path, entry: str, specs: list[InputSpec], output_names: list[str],
              data_files: list[str]) -> dict[str, Any]:
    """The manifest row of one file: inputs as declared, outputs as the ONNX graph states them."""
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    graph = proto.graph
    outs = {o.name: o for o in graph.output}
    outputs = []
    for n in output_names:
        o = outs.get(n)
        if o is None:
            outputs.append({"name": n, "shape": None, "dtype": None})
            continue
        tt = o.type.tensor_type
        shape = [d.dim_param if d.HasField("dim_param") else d.dim_value for d in tt.shape.dim]
        outputs.append({"name": n, "shape": shape, "dtype": _ONNX_DTYPES.get(tt.elem_type, str(tt.elem_type))})
    row: dict[str, Any] = {
        "entry": entry,
        "file": path.name,
        "inputs": [{"name": s.name, "shape": list(s.shape), "dtype": str(s.dtype)} for s in specs],
        "outputs": outputs,
        "opset": next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), None),
        "sha256": sha256_file(path),
        "bytes": path.stat().st_size,
    }
    if data_files:
        row["external_data"] = [{"file": n, "sha256": sha256_file(path.parent / n),
                                 "bytes": (path.parent / n).stat().st_size} for n in data_files]
    return row


_ONNX_DTYPES = {1: "f32", 2: "u8", 3: "i8", 5: "i16", 6: "i32", 7: "i64", 9: "bool", 10: "f16", 11: "f64",
                16: "bf16"}


def _quiet() -> AbstractContextManager[None]:
    """The exporter's progress lines and its torchvision notices are noise for a library call."""
    return quiet(("torch.onnx", "torch.export", "torch._export", "onnxscript"), logging.ERROR)
