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

import contextlib
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from . import manifest as mf
from . import validation as val
from .executorch import API, PARTITIONERS, ExecuTorchError, Lowered, lower

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


class Recipe:
    """What an edge export writes and how it is checked; subclasses fill the model-specific parts."""

    model: str = ""
    model_code: str = ""
    differences: list[str]
    preprocessing: str = "none"
    dtype: str = "float32"
    quantization: str = "none (fp32)"

    def programs(self) -> list[mf.Program]:
        raise NotImplementedError

    def upstream(self) -> dict[str, Any]:
        raise NotImplementedError

    def prompt_tables(self) -> dict[str, tuple[torch.Tensor, str]]:
        """File name -> (table, where it comes from): written as little-endian f32 ``.bin``."""
        return {}

    def model_rewrites(self) -> list[str]:
        """Rewrites already applied to the programs' modules (the exporter adds its own)."""
        return []

    @contextlib.contextmanager
    def exporting(self) -> Iterator[None]:
        """The state the modules are traced in (e.g. a constant position table); default: as they are."""
        yield

    def validate(self, runners: dict[str, val.Runner], runtime: str, files: dict[str, str],
                 out_dir: Path) -> list[dict[str, Any]]:
        """Rows of ``validation.json``: ``runners`` by program stem, ``files`` the stem's file name,
        ``out_dir`` where the files (prompt tables included) are written."""
        raise NotImplementedError

    def samples(self) -> list[str]:
        return []


class EntryRecipe(Recipe):
    """One program per entry of a bound Kestrel model, at batch 1 (``dims`` binds other free axes)."""

    def __init__(self, model: Any, entries: Sequence[str] | None = None, dims: dict[str, int] | None = None) -> None:
        from ..blocks import Block

        if not isinstance(model, Block):
            raise ExecuTorchError(f"the edge export takes a Kestrel model (a Block), got {type(model).__name__}")
        self.bound = model
        decl = type(model).decl()
        available = {f.pyname: f for f in decl.entries}
        names = list(entries) if entries is not None else list(available)
        unknown = [n for n in names if n not in available]
        if unknown:
            raise ExecuTorchError(f"{decl.qualname} has no entry {', '.join(map(repr, unknown))}; "
                                  f"its entries are {', '.join(available) or 'none'}")
        self.entries = [available[n] for n in names]
        self.dims = dict(dims or {})
        self.model = decl.qualname
        self.model_code = f"Kestrel {decl.qualname} (kestrel.{type(model).__module__.split('kestrel.', 1)[-1]})"
        self.differences = []
        self._programs: list[mf.Program] | None = None

    def programs(self) -> list[mf.Program]:
        if self._programs is None:
            from .onnx import ExportError, _Entry, entry_inputs, fixed_signature

            progs = []
            for fn in self.entries:
                try:
                    specs, examples = entry_inputs(self.bound, fn, 1, self.dims)
                except ExportError as e:
                    raise ExecuTorchError(str(e)) from None
                module = _Entry(self.bound, fn.pyname).eval()
                ports = [mf.Port(s.name, tuple(int(d) for d in s.shape), mf.FLOAT_NAMES[s.dtype.torch])
                         for s in specs]
                n_out = len(fn.result.items) if hasattr(fn.result, "items") else 1
                names = ["output"] if n_out == 1 else [f"output{i}" for i in range(n_out)]
                outputs = mf.program_outputs(module, examples, names)
                signature = fixed_signature(self.bound, fn, 1, self.dims).to_json()  # kestrel.exported.load reads it
                progs.append(mf.Program(fn.pyname, module, ports, outputs, examples, signature=signature))
            self._programs = progs
        return self._programs

    def upstream(self) -> dict[str, Any]:
        return upstream_of(self.bound)

    def validate(self, runners: dict[str, val.Runner], runtime: str, files: dict[str, str],
                 out_dir: Path) -> list[dict[str, Any]]:
        rows = []
        for p in self.programs():
            with torch.no_grad():
                expected = p.module(*p.examples)
            expected = list(expected) if isinstance(expected, (tuple, list)) else [expected]
            actual = runners[p.stem](p.examples)
            rows.append(val.case(files[p.stem], runtime, "seeded normal inputs", "kestrel eager",
                                 [o.name for o in p.outputs], actual, expected))
        return rows

    def samples(self) -> list[str]:
        return ["seeded normal inputs (torch.Generator seed 0), batch 1"]


def upstream_of(model: Any) -> dict[str, Any]:
    """The manifest's ``upstream``: the card's repo and pinned revision, or the local directory, and
    the sha256 of every safetensors file the weights were read from."""
    loaded = getattr(model, "loaded", None)
    card = getattr(loaded, "card", None)
    directory = getattr(loaded, "directory", None)
    files: dict[str, dict[str, str]] = {}
    if directory is not None:
        for path in sorted(Path(directory).glob("*.safetensors")):
            files[path.name] = {"sha256": mf.sha256_file(path)}
    config = getattr(loaded, "config", {}) or {}
    if card is not None:
        return {"model": card.repo, "revision": card.revision, "official": True,
                "license": config.get("license", "see the upstream model card"), "files": files,
                "note": f"Kestrel card {card.name}, weights read from {directory}"}
    return {"model": str(directory) if directory else "unknown", "revision": "local directory (no pinned revision)",
            "official": False, "license": "unknown (local checkpoint)", "files": files,
            "note": f"save_pretrained directory, config model_type {config.get('model_type')!r}"}


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


def recipe_for(model: Any) -> Recipe:
    """The SAM 2.1 split for a SAM 2.1 model, one program per entry otherwise."""
    from .edge_sam2 import is_sam2, sam2_recipe

    return sam2_recipe(model) if is_sam2(model) else EntryRecipe(model)


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


def read_table(path: Path, shape: Sequence[int]) -> torch.Tensor:
    import numpy as np

    return torch.from_numpy(np.fromfile(path, dtype="<f4").astype("float32")).reshape(tuple(shape))


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

