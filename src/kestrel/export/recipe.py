"""What an edge export writes and how it is checked: the :class:`Recipe` interface, the one-program-per-entry
recipe every family gets, and the helpers recipes share (the manifest's ``upstream``, reading a table back)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from ..runtime.signature import named_entries
from . import manifest as mf
from . import validation as val
from .executorch import ExecuTorchError


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
        self.entries = list(named_entries(decl, entries, ExecuTorchError).values())
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


def read_table(path: Path, shape: Sequence[int]) -> torch.Tensor:
    import numpy as np

    return torch.from_numpy(np.fromfile(path, dtype="<f4").astype("float32")).reshape(tuple(shape))
