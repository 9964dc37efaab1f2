"""ONNX export: one ``.onnx`` file per entry of a bound model, and a ``manifest.json`` that lists them.

>>> vit = kestrel.load("vit-base-patch16-224")
>>> export_onnx(vit, "out/")                    # out/forward.onnx, out/features.onnx, out/manifest.json

Each entry's inputs are built from its declared parameter types with the model's generics bound;
the batch ``B`` is a dynamic axis by default (``batch=None``) or fixed (``batch=8``). Other free
dimensions of an entry (a number of prompt points) are given with ``dims={"P": 1}``.

The exporter is ``torch.onnx.export(..., dynamo=True)`` (``torch.export`` then onnxscript): on this
stack it exports every entry with a dynamic batch axis, where the legacy TorchScript exporter
fails on ``layer_norm``'s ``x.shape[-1]`` once the batch is dynamic. Files are written to a temporary
folder beside the destination and renamed into place, so a failed or interrupted export never
leaves a truncated model behind; models over 2 GB keep their weights in ``<entry>.onnx.data``.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..blocks import Block
from ..blocks.decl import FnDecl
from ..errors import KestrelError
from ..runtime.output import prepare_output, prepare_output_dir, write_bytes
from ..shapes.poly import Poly, format_poly, substitute
from ..types.dtypes import DType, DTypeVar
from ..types.tensor import TensorType, TupleType, Variadic

MANIFEST = "manifest.json"
MANIFEST_FORMAT = "kestrel-onnx/1"
EXAMPLE_BATCH = 2  # traced batch when B is dynamic: 0 and 1 would be specialised by torch.export


class ExportError(KestrelError, RuntimeError):
    """An entry that could not be exported, naming the entry and the cause."""


@dataclass(frozen=True)
class InputSpec:
    name: str
    shape: tuple[int | str, ...]  # a str is a dynamic axis ("B")
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
                opset: int | None = None) -> list[Path]:
    """Write ``<entry>.onnx`` for each entry (all of the model's, or ``entries``) and ``manifest.json``.

    ``batch=None`` exports ``B`` as a dynamic axis (traced at batch 2); an int fixes it. Returns
    the ``.onnx`` paths in entry order. Raises :class:`ExportError` naming the entry and the cause.
    """
    if not isinstance(model, Block):
        raise ExportError(f"export_onnx takes a Kestrel model (a Block), got {type(model).__name__}")
    if batch is not None and (isinstance(batch, bool) or not isinstance(batch, int) or batch < 1):
        raise ExportError(f"batch must be a positive int or None (dynamic), got {batch!r}")
    decl = type(model).decl()
    available = {f.pyname: f for f in decl.entries}
    names = list(entries) if entries is not None else list(available)
    unknown = [n for n in names if n not in available]
    if unknown:
        raise ExportError(f"{decl.qualname} has no entry {', '.join(map(repr, unknown))}; "
                          f"its entries are {', '.join(available) or 'none'}")
    if not names:
        raise ExportError(f"{decl.qualname}: no entries to export")

    out = prepare_output_dir(out_dir)
    for target in [*(out / f"{n}.onnx" for n in names), out / MANIFEST]:
        prepare_output(target)  # before the work: no symlink, device or folder in the way
    was_training = model.training
    model.eval()
    rows: list[dict[str, Any]] = []
    paths: list[Path] = []
    try:
        for name in names:
            path, row = _export_entry(model, available[name], out, batch, dict(dims or {}), opset)
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
        "files": rows,
    }
    write_bytes(out / MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode())
    return paths


# --------------------------------------------------------------------------------------- inputs


def entry_inputs(model: Block, fn: FnDecl, batch: int | None, dims: dict[str, int]
                 ) -> tuple[list[InputSpec], list[torch.Tensor]]:
    """The entry's inputs: declared types bound with the model's generics, ``B`` and ``dims``.

    Returns the specs (dynamic ``B`` as the string ``"B"``) and example tensors (seeded normal
    for floats, zeros for integers, at batch ``EXAMPLE_BATCH`` when ``B`` is dynamic).
    """
    generic_dims = {k: v for k, v in model.generics.items() if isinstance(v, int)}
    generic_dtypes = {k: v for k, v in model.generics.items() if isinstance(v, DType)}
    free = {**dims, "B": batch if batch is not None else EXAMPLE_BATCH}
    specs: list[InputSpec] = []
    tensors: list[torch.Tensor] = []
    gen = torch.Generator().manual_seed(0)
    for pname, declared in fn.params:
        if isinstance(declared, TupleType):
            raise ExportError(f"{fn.name}: input {pname} is a tuple type; entries take tensors")
        bound = declared.substitute(generic_dims, generic_dtypes)  # type: ignore[arg-type]
        if any(isinstance(d, Variadic) for d in bound.dims):
            raise ExportError(f"{fn.name}: input {pname} {declared} has a variadic shape; cannot build an example")
        if isinstance(bound.dtype, DTypeVar):
            raise ExportError(f"{fn.name}: input {pname} {declared}: dtype generic {bound.dtype} is not bound")
        shape: list[int | str] = []
        example: list[int] = []
        for d in bound.dims:
            assert isinstance(d, Poly)
            concrete = substitute(d, free)
            if not concrete.is_const:
                missing = ", ".join(sorted(s.name for s in concrete.symbols()))
                raise ExportError(f"{fn.name}: input {pname} {declared} has free dimension {missing}; "
                                  f"give it with dims={{{missing.split(', ')[0]!r}: ...}}")
            example.append(concrete.value)
            dynamic = batch is None and any(s.name == "B" for s in d.symbols())
            if dynamic and d != Poly.sym("B"):
                raise ExportError(f"{fn.name}: input {pname} axis {format_poly(d)} depends on B; only a plain B "
                                  f"axis can be dynamic (export with a fixed batch)")
            shape.append("B" if dynamic else concrete.value)
        dt = bound.dtype
        specs.append(InputSpec(pname, tuple(shape), dt))
        if dt.kind == "Float":
            tensors.append(torch.randn(example, generator=gen).to(dt.torch))
        else:
            tensors.append(torch.zeros(example, dtype=dt.torch))
    return specs, tensors


def _result_items(fn: FnDecl) -> list[TensorType]:
    return list(fn.result.items) if isinstance(fn.result, TupleType) else [fn.result]  # type: ignore[list-item]


# -------------------------------------------------------------------------------------- export


def _export_entry(model: Block, fn: FnDecl, out: Path, batch: int | None, dims: dict[str, int],
                  opset: int | None) -> tuple[Path, dict[str, Any]]:
    name = fn.pyname
    qual = f"{type(model).decl().qualname}.{name}"
    specs, inputs = entry_inputs(model, fn, batch, dims)
    outputs = _result_items(fn)
    output_names = ["output"] if len(outputs) == 1 else [f"output{i}" for i in range(len(outputs))]
    dynamic_shapes = None
    if batch is None:
        bdim = torch.export.Dim("B", min=1)
        dynamic_shapes = (tuple({i: bdim for i, d in enumerate(s.shape) if d == "B"} or None for s in specs),)
    try:
        with torch.no_grad():
            getattr(model, name)(*inputs)  # the run-time input check, with a clear error, before tracing
    except Exception as e:
        raise ExportError(f"{qual}: the example inputs {[s.shape for s in specs]} do not run: {e}") from e

    try:
        with torch.no_grad(), _quiet():
            program = torch.onnx.export(
                _Entry(model, name), tuple(inputs), None, input_names=[s.name for s in specs],
                output_names=output_names, dynamic_shapes=dynamic_shapes, opset_version=opset, dynamo=True,
                verbose=False, report=False)
    except Exception as e:
        cause = str(e).strip().splitlines()
        raise ExportError(f"{qual}: torch.onnx.export failed: {type(e).__name__}: "
                          f"{cause[0] if cause else ''}") from e
    if program is None:
        raise ExportError(f"{qual}: torch.onnx.export returned no program")

    filename = f"{name}.onnx"
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=out))
    try:
        try:
            program.save(tmp / filename)
        except Exception as e:
            raise ExportError(f"{qual}: writing {filename} failed: {e}") from e
        written = sorted(p.name for p in tmp.iterdir())
        data_files = [n for n in written if n != filename]
        row = _describe(tmp / filename, name, specs, output_names, data_files)
        for n in [*data_files, filename]:  # the model last: it is what readers look for
            os.replace(tmp / n, prepare_output(out / n))  # never through a symlink or over a device
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out / filename, row


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
        "sha256": _sha256(path),
        "bytes": path.stat().st_size,
    }
    if data_files:
        row["external_data"] = [{"file": n, "sha256": _sha256(path.parent / n),
                                 "bytes": (path.parent / n).stat().st_size} for n in data_files]
    return row


_ONNX_DTYPES = {1: "f32", 2: "u8", 3: "i8", 5: "i16", 6: "i32", 7: "i64", 9: "bool", 10: "f16", 11: "f64",
                16: "bf16"}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """The exporter's progress lines and its torchvision notices are noise for a library call."""
    loggers = [logging.getLogger(n) for n in ("torch.onnx", "torch.export", "torch._export", "onnxscript")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
