"""``validation.json``: the exported programs run on this CPU, every output compared with a reference.

A *runner* turns a written program into a callable (``executorch.runtime`` for ``.pte`` files,
onnxruntime for ``.onnx``); :func:`compare` measures one output against its reference: the largest
absolute difference, the largest reference value and their ratio (the relative error the tests
bound by 1e-4), and for mask logits the IoU of the masks thresholded at 0.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

REL_TOLERANCE = 1e-4
IOU_TOLERANCE = 0.99

Runner = Callable[[Sequence[torch.Tensor]], list[torch.Tensor]]


def pte_runner(path: Path, threads: int | None = None) -> Runner:
    """A ``.pte`` program's ``forward`` through ``executorch.runtime`` (portable or XNNPACK kernels)."""
    from executorch.runtime import Runtime

    method = Runtime.get().load_program(str(path)).load_method("forward")

    def run(inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return [torch.as_tensor(o).clone() for o in method.execute([t.contiguous() for t in inputs])]

    return run


def onnx_runner(path: Path, input_names: Sequence[str], threads: int | None = None) -> Runner:
    """An ``.onnx`` program through onnxruntime's CPU provider."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    if threads:
        opts.intra_op_num_threads = threads
    session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])

    def run(inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        feed = {n: t.detach().contiguous().numpy() for n, t in zip(input_names, inputs)}
        return [torch.from_numpy(np.asarray(o)) for o in session.run(None, feed)]

    return run


def compare(actual: torch.Tensor, reference: torch.Tensor, mask: bool = False) -> dict[str, Any]:
    """``max_abs_diff``, ``max_abs_reference``, ``relative`` (their ratio) and, for mask logits, ``mask_iou``."""
    a = actual.detach().to(torch.float64)
    r = reference.detach().to(torch.float64)
    if tuple(a.shape) != tuple(r.shape):
        return {"shape": list(a.shape), "reference_shape": list(r.shape), "error": "shapes differ"}
    diff = float((a - r).abs().max()) if a.numel() else 0.0
    scale = float(r.abs().max()) if r.numel() else 0.0
    row: dict[str, Any] = {"max_abs_diff": diff, "max_abs_reference": scale,
                           "relative": diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))}
    if mask:
        row["mask_iou"] = mask_iou(a, r)
    return row


def mask_iou(actual: torch.Tensor, reference: torch.Tensor) -> float:
    """IoU of the two masks thresholded at logit 0 (1.0 when both are empty)."""
    x, y = actual > 0, reference > 0
    union = int((x | y).sum())
    return 1.0 if union == 0 else int((x & y).sum()) / union


def case(program: str, runtime: str, sample: str, reference: str, names: Sequence[str],
         actual: Sequence[torch.Tensor], expected: Sequence[torch.Tensor],
         masks: Sequence[str] = ()) -> dict[str, Any]:
    """One row of ``validation.json``: one program on one sample against one reference."""
    if len(actual) != len(expected):
        raise ValueError(f"{program}: {len(actual)} outputs against {len(expected)} reference outputs")
    return {"program": program, "runtime": runtime, "sample": sample, "reference": reference,
            "outputs": {n: compare(a, e, mask=n in masks) for n, a, e in zip(names, actual, expected)}}


def summarize(cases: Sequence[dict[str, Any]], gated: Callable[[dict[str, Any]], bool] | None = None
              ) -> dict[str, Any]:
    """The worst relative error and the lowest mask IoU over the cases, and whether they pass.

    ``gated`` picks the cases the tolerances apply to (all by default); the others are reported.
    """
    picked = [c for c in cases if gated is None or gated(c)]
    rel = [o["relative"] for c in picked for o in c["outputs"].values() if "relative" in o]
    ious = [o["mask_iou"] for c in picked for o in c["outputs"].values() if "mask_iou" in o]
    errors = [f"{c['program']}:{n}" for c in picked for n, o in c["outputs"].items() if "error" in o]
    worst = max(rel) if rel else None
    lowest = min(ious) if ious else None
    passed = not errors and (worst is None or worst <= REL_TOLERANCE) and (lowest is None or lowest >= IOU_TOLERANCE)
    return {"tolerance": {"relative": REL_TOLERANCE, "mask_iou": IOU_TOLERANCE}, "cases": len(picked),
            "worst_relative": worst, "lowest_mask_iou": lowest, "errors": errors, "passed": passed}
