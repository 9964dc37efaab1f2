"""The edge export: programs for a target, prompt tables, ``manifest.json`` and ``validation.json``.

>>> model = kestrel.load("sam2-dir/", E=32)                    # SAM 2.1 at 512
>>> export_edge(model, "out/", target="executorch-webgpu")     # seed 002's file set

What is exported is a :class:`Recipe`: its programs (one module each, named inputs and outputs),
its prompt tables, the text the manifest carries, and how to validate the written programs.
:class:`EntryRecipe` makes one program per entry of any bound Kestrel model whose entries have
fixed shapes; ``kestrel.export.edge_sam2`` is the SAM 2.1 encoder/decoder split of seed 002.

Targets: ``executorch-webgpu`` (the WebGPU programs and, beside them, portable ``*_portable.pte``
validation artifacts that run here), ``executorch-portable``, ``executorch-xnnpack`` and ``onnx``.
Everything is written to a temporary folder beside ``out`` and moved in at the end, so a failed
export never leaves a half-written set behind.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..models import capabilities
from . import manifest as mf
from . import validation as val
from .edge_sam2 import Sam2Recipe
from .executorch import API, PARTITIONERS, ExecuTorchError, Lowered, lower
from .recipe import EntryRecipe, Recipe

TARGETS = {
    "executorch-webgpu": ("webgpu", "portable"),
    "executorch-portable": ("portable",),
    "executorch-xnnpack": ("xnnpack",),
    "onnx": ("onnx",),
}
SUFFIX = {"webgpu": ".pte", "portable": "_portable.pte", "xnnpack": "_xnnpack.pte", "onnx": ".onnx"}
RUNTIMES = {"portable": "executorch.runtime (portable kernels)", "xnnpack": "executorch.runtime (XNNPACK delegate)",
            "onnx": "onnxruntime (CPUExecutionProvider)"}
PORTABLE_NOTE = ("CPU-only validation artifact (portable kernels, no delegate; torch SDPA instead of et_vk.sdpa); "
                 "not for release")
MANIFEST = "manifest.json"
VALIDATION = "validation.json"
ONNX_API = "torch.onnx.export(dynamo=True) of torch.export.export(strict=False), one program per module"


# ------------------------------------------------------------------------------------------ export


def export_edge(recipe: Recipe | Any, out_dir: str | os.PathLike[str], target: str = "executorch-webgpu", *,
                command: str | None = None, validate: bool = True,
                progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Write the recipe's programs for ``target``, its prompt tables, ``validation.json`` and
    ``manifest.json`` into ``out_dir``; return the manifest. A Kestrel model is wrapped in an
    :class:`EntryRecipe` (or the SAM 2.1 split, for a SAM 2.1 model)."""
    if target not in TARGETS:
        raise ExecuTorchError(f"unknown target {target!r}; expected one of {', '.join(TARGETS)}")
    if not isinstance(recipe, Recipe):
        recipe = recipe_for(recipe)
    say = progress or (lambda msg: None)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".kestrel-export-", dir=out))
    try:
        result = _export(recipe, tmp, target, say, validate)
        result_manifest = mf.build(
            model=recipe.model, upstream=recipe.upstream(), export=result["export"], files=result["files"],
            graph=result["graph"], command=command or _command())
        (tmp / MANIFEST).write_text(json.dumps(result_manifest, indent=1) + "\n")
        for name in [*result["written"], *([VALIDATION] if validate else []), MANIFEST]:
            os.replace(tmp / name, out / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return result_manifest


# capabilities.recipe -> the recipe that splits such a model into programs
RECIPES: dict[str, Callable[[Any], Recipe]] = {"entries": EntryRecipe, "sam2-edge": Sam2Recipe}


def recipe_for(model: Any) -> Recipe:
    """The recipe the model's card declares (the SAM 2.1 split for SAM 2.1), one program per entry otherwise."""
    return RECIPES[capabilities.of(model).recipe](model)


def _export(recipe: Recipe, tmp: Path, target: str, say: Callable[[str], None], validate: bool) -> dict[str, Any]:
    backends = TARGETS[target]
    primary = backends[0]
    written: list[str] = []
    notes: dict[str, str] = {}
    graph: dict[str, Any] = {}
    rewrites: dict[str, int] = {}
    files: dict[str, dict[str, str]] = {}  # backend -> stem -> file
    rewrite_cases: list[dict[str, Any]] = []
    programs = recipe.programs()
    with recipe.exporting():
        for backend in backends:
            files[backend] = {}
            for p in programs:
                name = p.stem + SUFFIX[backend]
                t0 = time.perf_counter()
                say(f"{name}: exporting for {backend}")
                if backend == "onnx":
                    summary = _write_onnx(p, tmp / name)
                else:
                    lowered: Lowered = lower(p.module, p.examples, backend, name=name)
                    (tmp / name).write_bytes(lowered.buffer)
                    summary = lowered.graph
                    for r, n in lowered.rewrites.items():
                        rewrites[r] = rewrites.get(r, 0) + n
                    if lowered.rewritten_outputs is not None and lowered.module_outputs is not None:
                        rewrite_cases.append(val.case(
                            name, "torch eager: the WebGPU graph after its rewrites (et_vk.sdpa reference kernel)",
                            "the program's example inputs", "kestrel eager", [o.name for o in p.outputs],
                            lowered.rewritten_outputs, lowered.module_outputs, masks=("masks",)))
                summary["io_contract"] = mf.io_contract(p, summary["io"])
                graph[p.stem if backend == primary else p.stem + SUFFIX[backend].rsplit(".", 1)[0]] = summary
                files[backend][p.stem] = name
                written.append(name)
                if backend == "portable" and primary == "webgpu":
                    notes[name] = PORTABLE_NOTE
                say(f"{name}: {(tmp / name).stat().st_size / 1e6:.1f} MB in {time.perf_counter() - t0:.0f} s")
    tables = recipe.prompt_tables()
    for name, (table, _) in tables.items():
        write_table(tmp / name, table)
        written.append(name)

    if validate:
        cases = list(rewrite_cases)
        for backend in backends:
            if backend not in RUNTIMES:
                continue  # the WebGPU program needs a browser; its portable twin is validated
            say(f"validating {backend} programs")
            runners = {stem: _runner(backend, tmp / f, next(p for p in programs if p.stem == stem))
                       for stem, f in files[backend].items()}
            cases.extend(recipe.validate(runners, RUNTIMES[backend], files[backend], tmp))
        report = {"samples": recipe.samples(), "cases": cases, "summary": val.summarize(cases)}
        (tmp / VALIDATION).write_text(json.dumps(report, indent=1, allow_nan=False) + "\n")

    partitioner = "none (ONNX)" if primary == "onnx" else PARTITIONERS[primary]
    applied = [*recipe.model_rewrites(), *(f"{r} ({n} node{'s' if n != 1 else ''})" for r, n in rewrites.items())]
    export = {
        "api": ONNX_API if primary == "onnx" else API.format(p=_partitioner_call(primary)),
        "partitioner": partitioner,
        "model_code": recipe.model_code,
        "programs": {files[primary][p.stem]: p.row() for p in programs},
        "prompt_tables": {n: {"shape": list(t.shape), "dtype": "float32 little-endian"}
                          for n, (t, _) in tables.items()},
        "prompt_table_sources": {n: src for n, (_, src) in tables.items()},
        "graph_rewrites": applied,
        "differences_from_upstream_pipeline": list(recipe.differences),
        "preprocessing_outside_graph": recipe.preprocessing,
        "dtype": recipe.dtype,
        "quantization": recipe.quantization,
    }
    return {"export": export, "files": mf.file_rows(tmp, written, notes), "graph": graph, "written": written}


def _partitioner_call(backend: str) -> str:
    return {"webgpu": "WebGPUPartitioner()", "xnnpack": "XnnpackPartitioner()", "portable": ""}[backend]


def _runner(backend: str, path: Path, program: mf.Program) -> val.Runner:
    if backend == "onnx":
        return val.onnx_runner(path, [p.name for p in program.inputs])
    return val.pte_runner(path)


def write_table(path: Path, table: torch.Tensor) -> None:
    """A prompt table as raw little-endian float32, C order."""
    data = table.detach().to(torch.float32).contiguous().cpu().numpy().astype("<f4", copy=False)
    path.write_bytes(data.tobytes(order="C"))


def _write_onnx(program: mf.Program, path: Path) -> dict[str, Any]:
    from ..runtime.signature import Signature
    from .onnx import ExportError, _quiet, carry_signature

    try:
        with torch.no_grad(), _quiet():
            onnx_program = torch.onnx.export(
                program.module, tuple(program.examples), None, input_names=[p.name for p in program.inputs],
                output_names=[p.name for p in program.outputs], dynamo=True, verbose=False, report=False)
            if program.signature is not None:  # the program carries its types (kestrel.exported.load)
                carry_signature(onnx_program, Signature.from_json(program.signature))
            onnx_program.save(path, external_data=False)
    except Exception as e:
        lines = str(e).strip().splitlines()
        raise ExportError(f"{path.name}: torch.onnx.export failed: {type(e).__name__}: "
                          f"{lines[0] if lines else ''}") from e
    return onnx_summary(path)


def onnx_summary(path: Path) -> dict[str, Any]:
    """The ``graph`` row of an ONNX program: every node runs in onnxruntime (no delegate), by op type."""
    import onnx

    proto = onnx.load(str(path))
    ops = Counter(n.op_type if n.domain in ("", "ai.onnx") else f"{n.domain}.{n.op_type}" for n in proto.graph.node)
    init = {i.name for i in proto.graph.initializer}

    def io(values: Any) -> list[dict[str, Any]]:
        rows = []
        for v in values:
            if v.name in init:
                continue
            tt = v.type.tensor_type
            rows.append({"shape": [d.dim_value if d.HasField("dim_value") else d.dim_param for d in tt.shape.dim],
                         "dtype": _ONNX_SCALAR.get(tt.elem_type, str(tt.elem_type)),
                         "dim_order": list(range(len(tt.shape.dim)))})
        return rows

    return {"non_delegated_kernels": dict(ops), "delegates": [],
            "io": {"methods": ["forward"], "inputs": io(proto.graph.input), "outputs": io(proto.graph.output)}}


_ONNX_SCALAR = {1: "FLOAT", 6: "INT", 7: "LONG", 9: "BOOL", 10: "HALF", 16: "BFLOAT16"}


def _command() -> str:
    argv = list(sys.argv)
    if argv and argv[0].endswith(("main.py", "__main__.py")):
        argv[0] = "kestrel"
    else:
        argv[0] = Path(argv[0]).name if argv else "python"
    return " ".join(shlex.quote(a) for a in argv)

