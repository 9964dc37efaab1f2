"""The GEMM paths installed here, each a real library path torch ships, and the packing one of them needs.

    torch        ``F.linear``: torch's default (addmm, MKL's sgemm on x86 builds)
    onednn       oneDNN's matmul primitive (``torch.ops.mkldnn._linear_pointwise``)
    mkl-packed   MKL's packed GEMM (``torch.ops.mkl._mkl_linear``): the weight packed once into the
                 layout MKL's kernel reads (per weight and row count, as inductor's freezing and
                 onnxruntime's prepacking do). The packed copy replaces the weight in memory: a
                 checkpoint weight is clean pages of its file mapping, which are handed back once it
                 is packed (:mod:`kestrel.kernels.pages`; read again from the file if anything reads
                 the parameter). A weight that is not (built in memory, converted, written to) runs
                 the fastest other kernel instead, unless ``KESTREL_WEIGHT_COPIES=1`` allows the copy

Packed layouts and memory verdicts are kept in :data:`kestrel.kernels.weights.WEIGHTS`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import allocator, settings
from .pages import file_pages, release_file_pages
from .weights import WEIGHTS

DEFAULT = "torch"


@dataclass(frozen=True)
class Kernel:
    """One GEMM path: ``run(x2d, weight, bias)`` computes ``x2d @ weight.T + bias``."""

    name: str
    library: str
    run: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
    copies_weight: bool = False  # runs on a re-laid-out copy of each weight (see packs_in_place)


def _torch(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, w, b)


def _onednn(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


def packed(w: torch.Tensor, rows: int) -> torch.Tensor:
    """``w`` packed for MKL's GEMM at ``rows`` rows. One layout per weight: a new row count replaces the
    old layout rather than keeping a second copy."""
    hit = WEIGHTS.get("packed", (w,))
    if hit is not None and hit[0] == rows:
        return hit[1]
    WEIGHTS.pop("packed", (w,))  # the old layout goes before the new one is made
    del hit
    with allocator.mapped_apart():
        layout = torch.ops.mkl._mkl_reorder_linear_weight(w, rows)
    WEIGHTS.put("packed", (w,), (rows, layout))
    hand_back(w)
    return layout


def hand_back(w: torch.Tensor) -> None:
    """A packed copy now does the reading of ``w``: a parameter's clean file pages need not stay resident."""
    if type(w) is torch.nn.Parameter and _in_place_verdict(w):
        release_file_pages(w)


def _in_place_verdict(w: torch.Tensor) -> bool:
    return WEIGHTS.get_or_make("in-place", (w,), lambda: file_pages(w))


def packs_in_place(w: torch.Tensor) -> bool:
    """Whether a kernel that runs on a re-laid-out copy of ``w`` may take it: the copy costs no memory
    (``w`` is a parameter held in clean pages of a checkpoint's file mapping, handed back once it is
    packed), or ``KESTREL_WEIGHT_COPIES=1`` allows a second copy.

    Only parameters qualify: a view made per call (``w[:D]``) would be packed again on every call.
    """
    if type(w) is not torch.nn.Parameter:
        return False
    if settings.weight_copies() or _in_place_verdict(w):
        return True
    WEIGHTS.pop("packed", (w,))  # a weight written to since it was packed: its stale copy goes
    return False


def _mkl_packed(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    rows = x.shape[0]
    return torch.ops.mkl._mkl_linear(x, packed(w, rows), w, b, rows)


def _config_line(prefix: str) -> str:
    for line in torch.__config__.show().splitlines():
        if prefix in line:
            return line
    return ""


@functools.lru_cache(maxsize=1)
def onednn_version() -> str:
    line = _config_line("MKL-DNN v") or _config_line("oneDNN v")
    return line.split(" v", 1)[1].split()[0] if " v" in line else "?"


@functools.lru_cache(maxsize=1)
def mkl_version() -> str:
    line = _config_line("Math Kernel Library Version")
    return line.split("Version", 1)[1].split()[0] if "Version" in line else "?"


def _available() -> dict[str, Kernel]:
    out = {"torch": Kernel("torch", "torch default (addmm)", _torch)}
    if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        out["onednn"] = Kernel("onednn", f"oneDNN {onednn_version()}", _onednn)
    if torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear"):
        out["mkl-packed"] = Kernel("mkl-packed", f"MKL {mkl_version()} packed GEMM", _mkl_packed, copies_weight=True)
    return out


KERNELS: dict[str, Kernel] = _available()


def plain_inference(*tensors: torch.Tensor) -> bool:
    """Eager calls on plain tensors (or parameters) that autograd does not record: no compiler, tracer,
    fake or subclass tensor in sight, so a kernel may pick its own path, reuse buffers, work in place."""
    # dynamo models type(x) as torch.Tensor, hence the explicit is_compiling()
    return (not torch.compiler.is_compiling()
            and all(type(t) in (torch.Tensor, torch.nn.Parameter) for t in tensors)
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)))


_WEIGHT_TYPES = (torch.Tensor, torch.nn.Parameter)


def eager_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Plain eager f32 inference on CPU: the calls that may take a calibrated kernel (compiled graphs
    keep F.linear, which inductor lowers and may hand to oneDNN itself with frozen weights)."""
    # plain_inference(x, weight), unrolled: this runs before every linear of a forward
    return (type(x) is torch.Tensor and type(weight) in _WEIGHT_TYPES
            and x.dtype == torch.float32 and weight.dtype == torch.float32 and x.is_cpu
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
            and not torch.compiler.is_compiling())
