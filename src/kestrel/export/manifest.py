"""The edge export's ``manifest.json``: what a site ships, in the structure of seed 002.

The manifest says which upstream checkpoint the programs came from (repo, pinned revision, license,
the weights' sha256), the versions that made them, how they were exported (api, partitioner,
model code, programs with named inputs and outputs, prompt tables and their sources, the graph
rewrites actually applied, differences from upstream, preprocessing outside the graph, dtype,
quantization), every written file's size and sha256, and per program the summary read back from
the lowered program (delegates' op counts, non-delegated kernels, io), then the command.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import platform
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

FLOAT_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
               torch.int32: "int32", torch.int64: "int64", torch.bool: "bool", torch.uint8: "uint8"}
# ExecuTorch's ScalarType names, as the program stores its io
SCALAR_TYPES = {"float32": "FLOAT", "float16": "HALF", "bfloat16": "BFLOAT16", "int32": "INT", "int64": "LONG",
                "bool": "BOOL", "uint8": "BYTE"}


@dataclass(frozen=True)
class Port:
    """A named program input or output: shape, dtype, and an optional note for the manifest."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"
    note: str | None = None

    def row(self) -> dict[str, Any]:
        row: dict[str, Any] = {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}
        if self.note:
            row["note"] = self.note
        return row


@dataclass
class Program:
    """One program to export: a module whose ``forward(*examples)`` returns its outputs in order."""

    stem: str  # file name without suffix: "sam2_encoder"
    module: nn.Module
    inputs: list[Port]
    outputs: list[Port]
    examples: list[torch.Tensor]
    extra: dict[str, Any] = field(default_factory=dict)  # more keys of the manifest's program row
    # the typed signature the program carries (kestrel.runtime.signature): the entry in the seeds'
    # notation, generics bound, where facts, each port's type; what kestrel.exported.load checks with
    signature: dict[str, Any] | None = None

    def row(self) -> dict[str, Any]:
        row = {"method": "forward", **self.extra, "inputs": [p.row() for p in self.inputs],
               "outputs": [p.row() for p in self.outputs]}
        if self.signature is not None:
            row["signature"] = self.signature
        return row


def program_outputs(module: nn.Module, examples: Sequence[torch.Tensor], names: Sequence[str],
                    notes: dict[str, str] | None = None) -> list[Port]:
    """Run ``module`` once on the examples and name its outputs (shapes and dtypes as computed)."""
    with torch.no_grad():
        out = module(*examples)
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    if len(outs) != len(names):
        raise ValueError(f"the program returns {len(outs)} outputs, but {len(names)} names were given: {list(names)}")
    notes = notes or {}
    return [Port(n, tuple(t.shape), FLOAT_NAMES.get(t.dtype, str(t.dtype)), notes.get(n)) for n, t in zip(names, outs)]


@contextlib.contextmanager
def quiet(loggers: Sequence[str], level: int) -> Iterator[None]:
    """Exporters' progress lines, notices and warnings are noise for a library call: the named
    loggers (``""`` is the root) raised to ``level``, warnings ignored and stdout swallowed."""
    handles = [logging.getLogger(n) for n in loggers]
    levels = [lg.level for lg in handles]
    for lg in handles:
        lg.setLevel(level)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, old in zip(handles, levels):
            lg.setLevel(old)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def file_rows(out: Path, names: Sequence[str], notes: dict[str, str] | None = None) -> dict[str, dict[str, Any]]:
    """``files``: every written file, sorted by name, with its bytes and sha256 (and a note)."""
    rows: dict[str, dict[str, Any]] = {}
    for name in sorted(names):
        path = out / name
        row: dict[str, Any] = {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
        if notes and name in notes:
            row["note"] = notes[name]
        rows[name] = row
    return rows


def versions() -> dict[str, str]:
    """The versions that made the programs (``"not installed"`` for an optional package that is absent)."""
    from importlib.metadata import PackageNotFoundError, version

    def v(dist: str) -> str:
        try:
            return version(dist)
        except PackageNotFoundError:
            return "not installed"

    git = "unknown"
    try:
        from executorch.version import git_version  # type: ignore[import-not-found]

        git = git_version or "unknown"
    except ImportError:
        pass
    return {"python": platform.python_version(),
            "torch": torch.__version__, "torchao": v("torchao"), "executorch": _executorch_version(v),
            "executorch_git": git, "transformers": v("transformers"), "huggingface_hub": v("huggingface_hub"),
            "kestrel": _kestrel_version()}


def _executorch_version(v: Any) -> str:
    try:
        from executorch.version import __version__  # type: ignore[import-not-found]

        return str(__version__)
    except ImportError:
        return v("executorch")


def _kestrel_version() -> str:
    from .. import __version__

    return __version__


def io_contract(program: Program, io: dict[str, Any]) -> str:
    """Whether the lowered program's stored io is the declared one (shapes, dtypes, contiguous dim
    order, one ``forward`` method); names what differs otherwise."""
    problems: list[str] = []
    if io.get("methods") != ["forward"]:
        problems.append(f"methods {io.get('methods')}")
    for kind, ports in (("inputs", program.inputs), ("outputs", program.outputs)):
        stored = io.get(kind, [])
        if len(stored) != len(ports):
            problems.append(f"{len(stored)} {kind}, declared {len(ports)}")
            continue
        for port, s in zip(ports, stored):
            if s.get("shape") != list(port.shape):
                problems.append(f"{port.name} shape {s.get('shape')}, declared {list(port.shape)}")
            if s.get("dtype") != SCALAR_TYPES.get(port.dtype, port.dtype):
                problems.append(f"{port.name} dtype {s.get('dtype')}, declared {port.dtype}")
            if s.get("dim_order") != list(range(len(port.shape))):
                problems.append(f"{port.name} dim order {s.get('dim_order')} is not contiguous")
    if problems:
        return "differs from the declared programs: " + "; ".join(problems)
    dtypes = sorted({p.dtype for p in [*program.inputs, *program.outputs]})
    return (f"matches the declared program (shapes, {', '.join(dtypes)}, contiguous dim order, "
            "single forward method)")


# the seed's manifest, key by key: tests compare a written manifest's structure with the seed's
TOP_KEYS = ("model", "upstream", "versions", "export", "files", "graph", "command")
EXPORT_KEYS = ("api", "partitioner", "model_code", "programs", "prompt_tables", "prompt_table_sources",
               "graph_rewrites", "differences_from_upstream_pipeline", "preprocessing_outside_graph", "dtype",
               "quantization")


def build(*, model: str, upstream: dict[str, Any], export: dict[str, Any], files: dict[str, Any],
          graph: dict[str, Any], command: str) -> dict[str, Any]:
    """The manifest dict in the seed's key order (``export`` must carry every key of :data:`EXPORT_KEYS`)."""
    missing = [k for k in EXPORT_KEYS if k not in export]
    if missing:
        raise ValueError(f"manifest export section lacks {', '.join(missing)}")
    ordered = {k: export[k] for k in EXPORT_KEYS}
    ordered.update({k: v for k, v in export.items() if k not in ordered})
    return {"model": model, "upstream": upstream, "versions": versions(), "export": ordered, "files": files,
            "graph": graph, "command": command}
