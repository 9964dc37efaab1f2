"""Race an entry against its own ONNX export on onnxruntime, and record the winner for this machine.

>>> vit = kestrel.load("vit-base-patch16-224")
>>> race_entry(vit, "forward", example_inputs(vit, "forward", batch=1))
{'kernel': 'eager', 'seconds': {'eager': 0.061, 'onnxruntime': 0.064}, 'rel_diff': 3.1e-07, ...}

The entry is exported once per checkpoint with :func:`kestrel.export.onnx.export_onnx` (its own
generics dynamic, verified at several bindings) into Kestrel's cache folder. The program must give the
eager outputs on the race's inputs within :data:`REL_TOLERANCE` of their largest value, or it is
rejected. Then both run interleaved (:func:`kestrel.runtime.race.best_times`), and onnxruntime is
chosen only when it is at least :data:`MARGIN` faster: a chosen program holds a second copy of the
weights, which a win inside the timing noise does not pay for. The result goes into the calibration
table under the entry's signature; :mod:`kestrel.runtime.onnxruntime_entries` follows it in every
later load on this machine.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any

import torch

from ..blocks import Block
from ..kernels import calibration, settings
from ..kernels.allocator import release_free_memory
from ..runtime import onnxruntime_entries as backend
from ..runtime.race import best_times, call_signature
from .onnx import export_onnx, relative_difference

REL_TOLERANCE = 1e-5  # of the largest eager output value: the f32 contract of every fast path that claims f32
MARGIN = 0.05  # onnxruntime must be this much faster to be chosen: its session holds a second copy of the weights
TRIALS = 5  # rounds at most; fewer where they would take over BUDGET_S (two at least)
BUDGET_S = 20.0
CALLS = 3  # calls of a path in a row per round (the last timed): each runtime's threads spin after a call


def _worst_relative(want: Any, got: Any) -> float:
    want = list(want) if isinstance(want, (tuple, list)) else [want]
    got = list(got) if isinstance(got, (tuple, list)) else [got]
    return max((relative_difference(g, w) for w, g in zip(want, got, strict=True)), default=0.0)


def race_entry(model: Block, entry: str, inputs: tuple[torch.Tensor, ...], *, trials: int = TRIALS,
               progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Time ``model.<entry>(*inputs)`` eager and on onnxruntime; record and return the choice.

    Returns ``{"kernel": "eager" | "onnxruntime", "seconds": {...}, "rel_diff": ..., "file": ...}``, with
    ``"rejected"`` when the program's outputs are not within :data:`REL_TOLERANCE`, or only ``kernel`` and
    ``skipped`` (nothing recorded) when this model or setting rules onnxruntime out.
    """
    mode = settings.onnxruntime_entries()
    why = "KESTREL_ONNXRUNTIME=0" if mode == "0" else backend.ineligible(model)
    if why is not None:
        return {"kernel": "eager", "skipped": why}
    path = backend.program_path(model, entry)
    try:
        program = backend.load_program(path) if path.is_file() else None
    except Exception:  # a cache file onnxruntime cannot read (truncated, corrupt): exported again below
        program = None
    if program is None:
        export_onnx(model, path.parent, entries=[entry], progress=progress)
        program = backend.load_program(path)
    eager = getattr(type(model), entry).__get__(model)
    with torch.inference_mode():
        started = time.perf_counter()
        want = eager(*inputs)
        call_s = time.perf_counter() - started
        rel = _worst_relative(want, program(*inputs))
        del want
        result: dict[str, Any] = {"kernel": "eager", "rel_diff": float(f"{rel:.3g}"), "file": str(path)}
        if rel > REL_TOLERANCE:
            result["rejected"] = f"onnxruntime differs from eager by {rel:.2e} of the largest value"
        else:
            rounds = max(2, min(trials, int(BUDGET_S / (2 * CALLS * call_s + 1e-9))))  # long calls: fewer rounds
            best = best_times({"eager": eager, backend.KERNEL: program}, inputs, {}, rounds, calls=CALLS)
            result["seconds"] = {k: round(v, 6) for k, v in best.items()}
            if mode == "always" or best[backend.KERNEL] < best["eager"] * (1 - MARGIN):
                result["kernel"] = backend.KERNEL
    calibration.table().put_entry(backend.decision_key(model, entry, call_signature(inputs, {})), result)
    # this process follows the new decision too; a program that lost is dropped with its copy of the weights
    backend.wrap(model, entry, program if result["kernel"] == backend.KERNEL else None)
    del program
    gc.collect()
    release_free_memory()
    return result


def format_result(entry: str, signature: str, result: dict[str, Any]) -> str:
    """One line: the entry, its signature, the backend chosen and why."""
    if "skipped" in result:
        return f"  {entry} {signature}: eager (onnxruntime not raced: {result['skipped']})"
    why = result.get("rejected") or calibration.format_seconds(result)
    return f"  {entry} {signature}: {result['kernel']} ({why}; largest difference {result['rel_diff']:.1e})"


__all__ = ["MARGIN", "REL_TOLERANCE", "format_result", "race_entry"]
