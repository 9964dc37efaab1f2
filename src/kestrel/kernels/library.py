"""The GEMM paths installed here, each a real library path torch ships, and the packing one of them needs.

    torch        ``F.linear``: torch's default (addmm, MKL's sgemm on x86 builds)
    onednn       oneDNN's matmul primitive (``torch.ops.mkldnn._linear_pointwise``)
    mkl-packed   MKL's packed GEMM (``torch.ops.mkl._mkl_linear``): the weight packed once into the
                 layout MKL's kernel reads (per weight and row count, as inductor's freezing and
                 onnxruntime's prepacking do)
    onednn-packed  oneDNN's matmul on the weight reordered once into its blocked layout
                 (``torch.ops.mkldnn._reorder_linear_weight``, as inductor's freezing does for bf16):
                 f32 and bf16, one layout for every row count

A packed copy replaces the weight in memory: a checkpoint weight is clean pages of its file mapping,
which are handed back once it is packed (:mod:`kestrel.kernels.pages`; read again from the file if
anything reads the parameter). A weight that is not (built in memory, written to) runs the fastest
other kernel instead, unless ``KESTREL_WEIGHT_COPIES=1`` allows the copy. Half-precision weights are
the exception (:func:`packs_in_place`).

f32 and bf16 each have their own kernels and calibrated choices (:data:`DTYPES`).

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
# the dtypes whose eager linears take a calibrated kernel
DTYPES = (torch.float32, torch.bfloat16)
F32_ONLY = (torch.float32,)

Linear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
PackedLinear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, int], torch.Tensor]


@dataclass(frozen=True)
class Kernel:
    """One GEMM path: ``run(x2d, weight, bias)`` computes ``x2d @ weight.T + bias``.

    A packing kernel (``pack`` given) runs on a re-laid-out copy of each weight (see
    :func:`packs_in_place`): ``pack(weight, rows)`` makes it, ``run_packed(x2d, layout, weight_or_shape,
    bias, rows)`` runs on it; ``any_rows``: one layout serves every row count."""

    name: str
    library: str
    run: Linear
    dtypes: tuple[torch.dtype, ...] = F32_ONLY
    pack: Callable[[torch.Tensor, int], torch.Tensor] | None = None
    run_packed: PackedLinear | None = None
    any_rows: bool = False
    # ``run`` with the tanh-approximate GELU applied to the output in the same call (oneDNN's post-op on each
    # output tile, before it is stored), where the library has one
    run_gelu_tanh: Linear | None = None

    @property
    def copies_weight(self) -> bool:
        return self.pack is not None

    def fits(self, tag: tuple[str, int] | None, rows: int) -> bool:
        """Whether a layout packed under ``tag`` (kernel, rows) serves this kernel at ``rows``."""
        return tag is not None and tag[0] == self.name and (self.any_rows or tag[1] == rows)


def _torch(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, w, b)


def _onednn(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


def _onednn_gelu_tanh(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "gelu", [], "tanh")


def packed(w: torch.Tensor, rows: int, kernel: Kernel) -> torch.Tensor:
    """``w`` packed for ``kernel`` at ``rows`` rows. One layout per weight: another kernel's layout, or one
    for another row count, is replaced rather than kept as a second copy."""
    hit = WEIGHTS.get("packed", (w,))
    if hit is not None and kernel.fits(hit[0], rows):
        return hit[1]
    WEIGHTS.pop("packed", (w,))  # the old layout goes before the new one is made
    del hit
    assert kernel.pack is not None
    with allocator.mapped_apart():
        layout = kernel.pack(w, rows)
    WEIGHTS.put("packed", (w,), ((kernel.name, rows), layout))
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
    A half-precision parameter converted at load (anonymous memory) may be packed too: with its copy the
    model holds as much as its f32 weights would, and a bf16 GEMM on packed weights is what bf16 is
    asked for (README, "bf16 and int8").
    """
    if type(w) is not torch.nn.Parameter:
        return False
    if settings.weight_copies() or _in_place_verdict(w) or w.dtype != torch.float32:
        return True
    WEIGHTS.pop("packed", (w,))  # a weight written to since it was packed: its stale copy goes
    return False


def _mkl_pack(w: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.ops.mkl._mkl_reorder_linear_weight(w, rows)


def _mkl_run_packed(x: torch.Tensor, layout: torch.Tensor, shape: torch.Tensor, b: torch.Tensor | None,
                    rows: int) -> torch.Tensor:
    return torch.ops.mkl._mkl_linear(x, layout, shape, b, rows)  # reads only the sizes of ``shape``


def _onednn_pack(w: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), rows)


def _onednn_run_packed(x: torch.Tensor, layout: torch.Tensor, shape: torch.Tensor, b: torch.Tensor | None,
                       rows: int) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, layout, b, "none", [], "")


def _packing(name: str) -> Linear:
    def run(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        kernel = KERNELS[name]
        assert kernel.run_packed is not None
        rows = x.shape[0]
        return kernel.run_packed(x, packed(w, rows, kernel), w, b, rows)
    return run


def _onednn_packed_gelu_tanh(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    layout = packed(w, x.shape[0], KERNELS["onednn-packed"])
    return torch.ops.mkldnn._linear_pointwise(x, layout, b, "gelu", [], "tanh")


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
    out = {"torch": Kernel("torch", "torch default (addmm)", _torch, DTYPES)}
    if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        out["onednn"] = Kernel("onednn", f"oneDNN {onednn_version()}", _onednn, DTYPES,
                               run_gelu_tanh=_onednn_gelu_tanh)
        if hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
            out["onednn-packed"] = Kernel("onednn-packed", f"oneDNN {onednn_version()} reordered weights",
                                          _packing("onednn-packed"), DTYPES, _onednn_pack, _onednn_run_packed,
                                          any_rows=True, run_gelu_tanh=_onednn_packed_gelu_tanh)
    if torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear"):
        out["mkl-packed"] = Kernel("mkl-packed", f"MKL {mkl_version()} packed GEMM", _packing("mkl-packed"),
                                   F32_ONLY, _mkl_pack, _mkl_run_packed)
    return out


KERNELS: dict[str, Kernel] = _available()


def kernels_for(dtype: torch.dtype) -> list[str]:
    """The kernels that compute in ``dtype``."""
    return [name for name, kernel in KERNELS.items() if dtype in kernel.dtypes]


def plain_inference(*tensors: torch.Tensor) -> bool:
    """Eager calls on plain tensors (or parameters) that autograd does not record: no compiler, tracer,
    fake or subclass tensor in sight, so a kernel may pick its own path, reuse buffers, work in place."""
    # dynamo models type(x) as torch.Tensor, hence the explicit is_compiling()
    return (not torch.compiler.is_compiling()
            and all(type(t) in (torch.Tensor, torch.nn.Parameter) for t in tensors)
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)))


_WEIGHT_TYPES = (torch.Tensor, torch.nn.Parameter)


def eager_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Plain eager f32 or bf16 inference on CPU: the calls that may take a calibrated kernel (compiled graphs
    keep F.linear, which inductor lowers and may hand to oneDNN itself with frozen weights)."""
    # plain_inference(x, weight), unrolled: this runs before every linear of a forward
    return (type(x) is torch.Tensor and type(weight) in _WEIGHT_TYPES
            and x.dtype == weight.dtype and x.dtype in DTYPES and x.is_cpu
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
            and not torch.compiler.is_compiling())
