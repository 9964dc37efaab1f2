"""Entries that run on onnxruntime where a race on this machine chose it, per input signature.

onnxruntime is a backend like any GEMM kernel: ``kestrel doctor --model DIR --onnxruntime`` (or
:func:`kestrel.export.onnxruntime_race.race_entry`) exports an entry with Kestrel's own typed ONNX
export, checks its outputs against eager f32 (within 1e-5 of the largest value), times both on the
same inputs and records the winner in the calibration table under
``onnxruntime <model> <generics> <entry> <signature>``. This module is the run-time half: at load, an
entry with a recorded onnxruntime win is wrapped, and each call whose signature won runs the cached
program (inputs still checked against the declared types first); every other call runs eager.

What it costs: a program keeps its own copy of the weights (as large as the model's f32 weights),
held from the first call that uses it, and the exported file sits in Kestrel's cache folder
(``onnxruntime/``). Only f32 models loaded from a checkpoint on the CPU take part; bf16, int8 and
compiled models stay on their own paths. ``KESTREL_ONNXRUNTIME=0`` switches it off.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..blocks import Block
from ..blocks.block import check_entry_inputs
from ..errors import KestrelWarning
from ..kernels import calibration, settings
from ..types.dtypes import DType
from .examples import entry_names
from .race import call_signature

KERNEL = "onnxruntime"
PREFIX = "onnxruntime "  # of every decision's key in the calibration table


def _generics_digest(model: Block) -> str:
    shown = {k: str(v) if isinstance(v, DType) else v for k, v in model.generics.items()}
    return hashlib.sha256(json.dumps(shown, sort_keys=True).encode()).hexdigest()[:8]


def decision_key(model: Block, entry: str, signature: str) -> str:
    """The calibration-table key of one entry at one input signature of this architecture."""
    return f"{PREFIX}{type(model).decl().qualname}@{_generics_digest(model)} {entry} {signature}"


def program_path(model: Block, entry: str) -> Path:
    """Where the entry's exported program is cached: one folder per checkpoint (its weight files' names,
    sizes and modification times), generics and torch version."""
    loaded = getattr(model, "loaded", None)
    if loaded is None:
        raise ValueError("only a model loaded from a checkpoint has a cached program")
    files = sorted(Path(loaded.directory).glob("*.safetensors"))
    identity = {"model": type(model).decl().qualname, "generics": _generics_digest(model),
                "directory": str(Path(loaded.directory).resolve()), "torch": torch.__version__,
                "files": [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]}
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    return settings.cache_dir("onnxruntime", digest, entry, f"{entry}.onnx")


def ineligible(model: Block) -> str | None:
    """Why this model's entries cannot run on onnxruntime, or None when they can."""
    if importlib.util.find_spec("onnxruntime") is None:
        return "onnxruntime is not installed (pip install 'kestrel[export]')"
    if getattr(model, "loaded", None) is None:
        return "the model was not loaded from a checkpoint"
    if str(model.generics.get("T")) != "f32":
        return f"the model is {model.generics.get('T')}, not f32"
    if getattr(model, "quantized", None) or getattr(model, "compiled", False):
        return "the model is quantized or compiled"
    if any(p.device.type != "cpu" for p in model.parameters()):
        return "the model is not on the CPU"
    return None


def chosen_signatures(model: Block, entry: str) -> list[str]:
    """The input signatures of ``entry`` for which this machine's table chose onnxruntime."""
    head = decision_key(model, entry, "")
    return [k[len(head):] for k, v in calibration.table().shapes.items()
            if k.startswith(head) and isinstance(v, dict) and v.get("kernel") == KERNEL]


def attach(model: Block) -> list[str]:
    """At load: wrap each entry that a race here chose onnxruntime for (at some signature) and whose program
    is cached. Returns the wrapped entries' names."""
    if settings.onnxruntime_entries() == "0" or ineligible(model) is not None:
        return []
    wrapped = []
    for entry in entry_names(model):
        if chosen_signatures(model, entry) and program_path(model, entry).is_file():
            wrap(model, entry)
            wrapped.append(entry)
    return wrapped


def _plain_tensors(args: tuple[Any, ...]) -> bool:
    # traced, exported and compiled calls see tensor subclasses (fake, functional), a model moved to a device
    # sees tensors there, and autograd wants a graph: all of those stay eager
    return all(type(a) is torch.Tensor and a.device.type == "cpu" and not a.requires_grad for a in args)


def wrap(model: Block, entry: str, program: Any = None) -> None:
    """Replace ``model.<entry>`` (on the instance) with a call that runs onnxruntime for the signatures the
    table chose it for, eager for the others; ``program``: the entry's program, if already loaded (else it is
    loaded at the first call that needs it). Wrapping again starts over from the table."""
    eager: Callable[..., Any] = getattr(type(model), entry).__get__(model)
    fn = type(model).decl().function(entry)
    state: dict[str, Any] = {"decided": {}, "program": program}

    @functools.wraps(eager)
    def call(*args: Any, **kwargs: Any) -> Any:
        if kwargs or not _plain_tensors(args) or settings.onnxruntime_entries() == "0":
            return eager(*args, **kwargs)
        signature = call_signature(args, kwargs)
        choice = state["decided"].get(signature)
        if choice is None:
            choice = state["decided"][signature] = _table_choice(model, entry, signature)
        if choice != KERNEL or (torch.is_grad_enabled() and any(p.requires_grad for p in model.parameters())):
            return eager(*args)  # not chosen here, or a model being trained: its gradients need eager
        check_entry_inputs(model, fn, args, kwargs)  # the same errors as eager, before onnxruntime sees them
        if state["program"] is None:
            try:
                state["program"] = load_program(program_path(model, entry))
            except Exception as e:  # a cache file that onnxruntime cannot read (truncated, corrupt): eager
                state["decided"][signature] = "eager"
                warnings.warn(f"the cached onnxruntime program of {entry} ({program_path(model, entry)}) cannot be "
                              f"loaded ({type(e).__name__}: {str(e).strip()[:200]}); running eager. `kestrel doctor "
                              "--model ... --onnxruntime` exports it again", KestrelWarning, stacklevel=2)
                return eager(*args)
        return state["program"](*args)

    call.onnxruntime_state = state  # type: ignore[attr-defined]
    setattr(model, entry, call)


def _table_choice(model: Block, entry: str, signature: str) -> str:
    hit = calibration.table().shapes.get(decision_key(model, entry, signature))
    won = isinstance(hit, dict) and hit.get("kernel") == KERNEL
    return KERNEL if won and program_path(model, entry).is_file() else "eager"


def load_program(path: Path) -> Any:
    """The cached program as an onnxruntime session at torch's thread count (calls checked against its
    carried signature)."""
    from .exported import load

    return load(path, threads=torch.get_num_threads())


def remove_programs() -> list[Path]:
    """Delete every cached program (``kestrel doctor --reset``); returns the ``.onnx`` files removed."""
    root = settings.cache_dir("onnxruntime")
    gone = sorted(root.glob("*/*/*.onnx")) if root.is_dir() else []
    if root.is_dir():
        shutil.rmtree(root, ignore_errors=True)
    return gone


def runs_on(model: Block, entry: str, *args: torch.Tensor) -> str:
    """Which backend a call of ``model.<entry>(*args)`` takes now: ``onnxruntime`` or ``eager``."""
    state = getattr(getattr(model, entry), "onnxruntime_state", None)
    if state is None:
        return "eager"
    if settings.onnxruntime_entries() == "0" or not _plain_tensors(args):
        return "eager"
    signature = call_signature(args, {})
    return state["decided"].get(signature) or _table_choice(model, entry, signature)


__all__ = ["KERNEL", "attach", "chosen_signatures", "decision_key", "ineligible", "program_path", "remove_programs",
           "runs_on", "wrap"]
