"""GEMM kernels for ``ops.linear``: the paths installed here, and the per-shape choice among them.

Which f32 GEMM is fastest depends on the CPU, the libraries, the thread count and the shape: on
one machine oneDNN ran at twice MKL, on the next it lost by 10%. So nothing here names a vendor or
a CPU. Every eager ``linear`` call on CPU asks :func:`choose` for its shape ``(M, N, K)``; the first
time a shape is seen on this machine (this CPU model, thread count and library versions) a short
calibration times every candidate on that call's own data (its weight streamed from memory, as a
forward reads it), interleaved, checks each against
``F.linear``, keeps the fastest and writes the choice to the user's cache directory
(:mod:`kestrel.runtime.calibrate` reads and prints it; ``kestrel doctor``).

Candidates (each a real library path torch ships):

    torch        ``F.linear``: torch's default (addmm, MKL's sgemm on x86 builds)
    onednn       oneDNN's matmul primitive (``torch.ops.mkldnn._linear_pointwise``)
    mkl-packed   MKL's packed GEMM (``torch.ops.mkl._mkl_linear``): the weight packed once into the
                 layout MKL's kernel reads (per weight and row count, as inductor's freezing and
                 onnxruntime's prepacking do). The packed copy replaces the weight in memory: a
                 checkpoint weight is clean pages of its file mapping, which are handed back once it
                 is packed (:mod:`kestrel.runtime.pages`; read again from the file if anything reads
                 the parameter). A weight that is not (built in memory, converted, written to) runs
                 the fastest other kernel instead, unless ``KESTREL_WEIGHT_COPIES=1`` allows the copy

Compiled, traced and exported graphs, autograd, other dtypes and devices always take ``F.linear``
(inductor makes its own choice there). ``KESTREL_LINEAR=torch|onednn|mkl-packed`` forces one path;
``KESTREL_CALIBRATE=0`` turns calibration off (unseen shapes then take ``torch``).
"""

from __future__ import annotations

import functools
import math
import os
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import UsageError
from ..runtime import allocator

DEFAULT = "torch"
# shapes under this many FLOPs are not worth timing: they run torch's default
MIN_CALIBRATED_FLOPS = 2e6
# calibration of one shape: at most this many rows of the call's input, about this many seconds
CAL_ROWS = 2048
CAL_BUDGET_S = 0.4
CAL_ROUNDS = (3, 12)  # at least, at most
# a candidate replaces torch's default only when it is this much faster (noise on shared machines)
MARGIN = 0.03
# a candidate must match F.linear to this relative error (max |diff| / max |ref|) to be eligible
CHECK_TOL = 1e-5
# In a model every weight is read once per forward, after all the others: it comes from memory, not
# cache. Timing one weight over and over measures a hot cache instead, and ranks the paths differently
# (measured: at 64 rows oneDNN beat torch's default by 15% on streamed weights and lost on a hot one).
# So each timed pass runs over copies of the weight that together exceed what the caches keep.
# A pass stops at PASS_FLOPS of work: a long GEMM is compute-bound, where the weight's first read
# hardly shows, and its calibration stays within budget.
COLD_BYTES = 128 * 2**20
MAX_COPIES = 64
PASS_FLOPS = 2e10


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


# packed MKL weights: id(weight) -> (weakref, version, rows, packed). One layout per weight: a new
# row count replaces the old layout rather than keeping a second copy
_PACKED: dict[int, tuple[weakref.ref, int, int, torch.Tensor]] = {}


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # an inference tensor has no version counter, and cannot change in place
        return -1


def _packed(w: torch.Tensor, rows: int) -> torch.Tensor:
    key = id(w)
    entry = _PACKED.get(key)
    if entry is not None and entry[0]() is w and entry[2] == rows and entry[1] == _version(w):
        return entry[3]
    _PACKED.pop(key, None)  # the old layout goes before the new one is made
    del entry
    with allocator.mapped_apart():
        packed = torch.ops.mkl._mkl_reorder_linear_weight(w, rows)
    _PACKED[key] = (weakref.ref(w, lambda _r, k=key: _PACKED.pop(k, None)), _version(w), rows, packed)
    _hand_back(w)
    return packed


def _hand_back(w: torch.Tensor) -> None:
    """A packed copy now does the reading of ``w``: a parameter's clean file pages need not stay resident."""
    if type(w) is torch.nn.Parameter and _in_place_verdict(w):
        from ..runtime.pages import release_file_pages

        release_file_pages(w)


# id(weight) -> (weakref, version, whether packing it costs no memory)
_IN_PLACE: dict[int, tuple[weakref.ref, int, bool]] = {}


def _in_place_verdict(w: torch.Tensor) -> bool:
    entry = _IN_PLACE.get(id(w))
    if entry is not None and entry[0]() is w and entry[1] == _version(w):
        return entry[2]
    from ..runtime.pages import file_pages

    verdict = file_pages(w)
    key = id(w)
    _IN_PLACE[key] = (weakref.ref(w, lambda _r, k=key: _IN_PLACE.pop(k, None)), _version(w), verdict)
    return verdict


def packs_in_place(w: torch.Tensor) -> bool:
    """Whether a kernel that runs on a re-laid-out copy of ``w`` may take it: the copy costs no memory
    (``w`` is a parameter held in clean pages of a checkpoint's file mapping, handed back once it is
    packed), or ``KESTREL_WEIGHT_COPIES=1`` allows a second copy.

    Only parameters qualify: a view made per call (``w[:D]``) would be packed again on every call.
    An inference tensor has no version counter, so a write to one in inference mode goes unseen.
    """
    if type(w) is not torch.nn.Parameter:
        return False
    if copies_allowed() or _in_place_verdict(w):
        return True
    _PACKED.pop(id(w), None)  # a weight written to since it was packed: its stale copy goes
    return False


def _mkl_packed(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    rows = x.shape[0]
    return torch.ops.mkl._mkl_linear(x, _packed(w, rows), w, b, rows)


def _available() -> dict[str, Kernel]:
    out = {"torch": Kernel("torch", "torch default (addmm)", _torch)}
    if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        out["onednn"] = Kernel("onednn", f"oneDNN {onednn_version()}", _onednn)
    if torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear"):
        out["mkl-packed"] = Kernel("mkl-packed", f"MKL {mkl_version()} packed GEMM", _mkl_packed, copies_weight=True)
    return out


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


KERNELS: dict[str, Kernel] = _available()


# -------------------------------------------------------------------------------- the choice


def forced() -> str | None:
    """The kernel ``KESTREL_LINEAR`` forces, or None (``KESTREL_ONEDNN=0`` still means torch)."""
    name = os.environ.get("KESTREL_LINEAR", "").strip()
    if not name and os.environ.get("KESTREL_ONEDNN") == "0":
        return "torch"
    if not name or name == "auto":
        return None
    if name not in KERNELS:
        raise UsageError(f"KESTREL_LINEAR={name!r}: not a kernel here; available: {', '.join(KERNELS)} or auto")
    return name


def copies_allowed() -> bool:
    """``KESTREL_WEIGHT_COPIES=1``: kernels that run on a re-laid-out copy of each weight (``mkl-packed``)
    may take weights whose memory cannot be handed back after packing (built in memory, converted or
    written to), at the cost of a second copy of those weights."""
    return os.environ.get("KESTREL_WEIGHT_COPIES", "0") == "1"


def calibration_enabled() -> bool:
    return os.environ.get("KESTREL_CALIBRATE", "1") != "0"


def choose(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> str:
    """The kernel for this call's shape: forced, cached, calibrated now, or torch's default.

    A calibrated choice that runs on a packed copy of the weight stands only where packing this weight
    costs no memory (:func:`packs_in_place`); elsewhere the fastest kernel that reads it in place runs.
    """
    name = forced()
    if name is not None:
        return name
    from ..runtime import calibrate

    m, k = x2d.shape
    n = weight.shape[0]
    table = calibrate.table()
    entry = table.entry(m, n, k, bias is not None)
    if entry is None or entry.get("kernel") not in KERNELS:
        if not calibration_enabled() or 2.0 * m * n * k < MIN_CALIBRATED_FLOPS or len(KERNELS) == 1:
            return DEFAULT
        entry = measure(x2d, weight, bias)
        table.put(m, n, k, bias is not None, entry)
    name = entry["kernel"]
    if KERNELS[name].copies_weight and not packs_in_place(weight):
        fallback = entry.get("in_place", DEFAULT)
        return fallback if fallback in KERNELS else DEFAULT
    return name


def measure(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            kernels: Sequence[str] | None = None, budget_s: float = CAL_BUDGET_S) -> dict[str, Any]:
    """Time every candidate on (up to CAL_ROWS rows of) this input, interleaved; check each against F.linear.

    Each timing is a pass over enough copies of the weight (COLD_BYTES) that none is in cache when it
    is read, as in a model's forward; the copies live only while measuring.

    Returns ``{"kernel": chosen, "in_place": the fastest that reads the weight in place (for weights that
    cannot be packed at no memory cost), "gflops": {name: best rate}, "rejected": {name: why},
    "rows": timed rows}``.
    """
    names = list(kernels or KERNELS)
    x = x2d[:CAL_ROWS]
    m, k = x.shape
    n = weight.shape[0]
    flops = 2.0 * m * n * k
    ref = F.linear(x, weight, bias)
    scale = float(ref.abs().max()) or 1.0
    rejected: dict[str, str] = {}
    live: list[str] = []
    for name in names:
        try:
            out = KERNELS[name].run(x, weight, bias)
            err = float((out - ref).abs().max()) / scale
        except Exception as e:  # a library that refuses this shape is simply not a candidate
            rejected[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}"
            continue
        if not err <= CHECK_TOL:
            rejected[name] = f"differs from F.linear by {err:.1e}"
            continue
        live.append(name)
    copies = max(1, min(MAX_COPIES, -(-COLD_BYTES // max(1, weight.numel() * weight.element_size())),
                        int(PASS_FLOPS // max(flops, 1.0))))
    weights = [weight]
    if live and copies > 1:
        # one allocation for all copies, mapped apart from the heap and handed back to the system when
        # freed: from the heap they would stay resident, among the activations of the forward that is
        # calibrating, and steer where its later calls' activations land (DINOv2-B 518 batch 8 calibrating
        # in its first call: 877-991 MB peak in the calls after it with heap copies, 753-849 apart)
        with allocator.mapped_apart():
            weights += weight.expand(copies - 1, *weight.shape).clone().unbind(0)
    best = {name: float("inf") for name in live}
    lo, hi = CAL_ROUNDS
    start = time.perf_counter()
    for r in range(hi):
        for name in (live if r % 2 == 0 else live[::-1]):  # alternate the order: no seat is favoured
            run = KERNELS[name].run
            t = time.perf_counter()
            for w in weights:  # one pass over cold weights, as a forward reads them
                run(x, w, bias)
            best[name] = min(best[name], (time.perf_counter() - t) / len(weights))
        if r + 1 >= lo and time.perf_counter() - start > budget_s:
            break
    for w in weights:  # packed copies made for timing: the chosen kernel packs its own
        _PACKED.pop(id(w), None)
    del weights
    allocator.note_burst()  # the entry running this forward hands the freed copies' pages back when it returns
    gflops = {name: flops / t / 1e9 for name, t in best.items()}
    in_place = _pick({nm: r for nm, r in gflops.items() if not KERNELS[nm].copies_weight})
    return {"kernel": _pick(gflops), "in_place": in_place, "gflops": {nm: round(v, 2) for nm, v in gflops.items()},
            "rejected": rejected, "rows": m}


def _pick(gflops: dict[str, float]) -> str:
    """The fastest kernel; torch's default unless beaten by MARGIN."""
    if not gflops:
        return DEFAULT
    chosen = max(gflops, key=lambda n: gflops[n])
    if DEFAULT in gflops and gflops[chosen] < gflops[DEFAULT] * (1 + MARGIN):
        chosen = DEFAULT
    return chosen


# ---------------------------------------------------------------------------------- the kernels


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


# A linear's decision, kept per (weight, rows, bias or not, thread count) so that a forward's steady state costs one
# lookup: each Python call in a forward runs on caches the GEMMs just flushed, where the full decision
# (settings, table, memory verdict) cost ~25 us a call, 3% of SigLIP's text tower at batch 1. A weight
# written to (its version moves) is decided again; :func:`forget_decisions` drops them all (the
# calibration's forget and reset call it), so settings changed mid-process apply to new weights, or
# after a forget.
_DECIDED: dict[tuple[Any, int, bool, int], tuple[weakref.ref, int, str]] = {}


def forget_decisions() -> None:
    _DECIDED.clear()


def _recalled(key: tuple, owner: torch.Tensor) -> str | None:
    """The decision kept under ``key`` while ``owner`` (the weight it belongs to) is unchanged, else None."""
    hit = _DECIDED.get(key)
    if hit is not None and hit[0]() is owner and hit[1] == _version(owner):
        return hit[2]
    return None


def _remember(key: tuple, owner: torch.Tensor, name: str) -> str:
    _DECIDED[key] = (weakref.ref(owner, lambda _r, k=key: _DECIDED.pop(k, None)), _version(owner), name)
    return name


def _decide(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> str:
    key = (id(weight), x2d.shape[0], bias is not None, torch.get_num_threads())
    return _recalled(key, weight) or _remember(key, weight, choose(x2d, weight, bias))


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as contiguous rows ``[*, In]``: what the GEMM kernels take (a view when it can be)."""
    x2d = x.reshape(-1, x.shape[-1])
    return x2d if x2d.is_contiguous() else x2d.contiguous()


def _cat_biases(weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    """The fused projection's bias: the parts' biases end to end, zeros for a part without one."""
    if all(b is None for b in biases):
        return None
    return torch.cat([b if b is not None else w.new_zeros(w.shape[0]) for w, b in zip(weights, biases)])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` over the last axis, through the kernel chosen for this shape."""
    if not eager_ok(x, weight) or x.numel() == 0:
        return F.linear(x, weight, bias)
    x2d = _rows(x)
    if _INT8 and id(weight) in _INT8:
        packed = _int8_packed(weight, bias)
        if packed is not None:
            y = torch.ops.quantized.linear_dynamic(x2d, packed, True)
            return y.view(*x.shape[:-1], weight.shape[0])
    name = _decide(x2d, weight, bias)
    if name == DEFAULT:
        return F.linear(x, weight, bias)
    return KERNELS[name].run(x2d, weight, bias).view(*x.shape[:-1], weight.shape[0])


# ------------------------------------------------------------------------- transposed 2x2 convolution


def conv_transpose2x2(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Stride-2 transposed 2 x 2 convolution, ``[B, Cin, H, W] -> [B, Cout, 2H, 2W]``.

    Each input pixel becomes its own 2 x 2 block, so in eager f32 inference on CPU it runs as one
    GEMM over pixels (``[B*H*W, Cin] @ [Cin, Cout*4]``) and a single pass that interleaves the blocks
    and adds the bias. The result is laid out channels-last (strides, not shape): a channel norm, an
    activation or a second such convolution after it then reads it with the grain, and an input that
    is already channels-last (SAM's decoder hands over its image tokens that way) is read without a
    copy. In SAM's decoder this took a decode from 37 to 30 ms against oneDNN's deconvolution.
    """
    if not (eager_ok(x, weight) and x.dim() == 4 and weight.shape[2:] == (2, 2)) or x.numel() == 0:
        return F.conv_transpose2d(x, weight, bias, stride=2)
    b, cin, h, w = x.shape
    cout = weight.shape[1]
    pixels = x.permute(0, 2, 3, 1).reshape(b * h * w, cin)  # a view when x is channels-last
    # columns ordered (i, j, c): each pixel's 2 x 2 block then lies as two runs of 2 * Cout numbers
    columns = weight.permute(0, 2, 3, 1).reshape(cin, 4 * cout)
    blocks = torch.mm(pixels, columns).view(b, h, w, 2, 2 * cout)
    out = torch.empty(b, h, 2, w, 2 * cout, dtype=x.dtype)
    interleaved = blocks.transpose(2, 3)  # out[b, h, i, w, (j, c)] = blocks[b, h, w, i, (j, c)] (+ bias[c])
    if bias is None:
        out.copy_(interleaved)
    else:
        torch.add(interleaved.view(b, h, 2, w, 2, cout), bias, out=out.view(b, h, 2, w, 2, cout))
    return out.view(b, 2 * h, 2 * w, cout).permute(0, 3, 1, 2)


# ------------------------------------------------------------------------------ tanh-approximate GELU

# 0.5 * (1 + tanh(u)) == sigmoid(2u): gelu_tanh(x) = x * sigmoid(x * (B + A x^2)),
# with u = sqrt(2/pi) * (x + 0.044715 x^3)
_GELU_B = 2 * math.sqrt(2 / math.pi)
_GELU_A = _GELU_B * 0.044715
# elements per step: the temporary stays in cache while four vectorised passes run over it
GELU_CHUNK = 1 << 16


def gelu_tanh_(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation, in place on an eager f32 CPU tensor, as ``x * sigmoid(2u)``.

    Torch's own tanh GELU runs its tanh at ~1 ns an element here; the sigmoid form in cache-sized
    steps took SigLIP's 64 x 3072 MLP activation from 0.27 to 0.16 ms (8 x 1370 x 3072: 32 -> 26 ms),
    within 3.3e-8 relative of float64 (torch's: 2.8e-8).
    """
    if not (x.is_contiguous() and x.dtype == torch.float32 and x.is_cpu) or x.numel() == 0:
        return torch.ops.aten.gelu_(x, approximate="tanh")
    flat = x.view(-1)
    n = flat.numel()
    scratch = torch.empty(min(n, GELU_CHUNK), dtype=x.dtype)
    b = torch.full((), _GELU_B, dtype=x.dtype)
    for start in range(0, n, GELU_CHUNK):
        part = flat[start:start + GELU_CHUNK]
        z = scratch[:part.numel()]
        torch.addcmul(b, part, part, value=_GELU_A, out=z)  # B + A x^2
        z.mul_(part).sigmoid_()
        part.mul_(z)
    return x


# ------------------------------------------------------------------------- int8 (opt-in, not exact)

# weights marked for int8 dynamic quantisation: id -> (weakref, {id(bias): packed})
_INT8: dict[int, tuple[weakref.ref, dict[int, Any]]] = {}


def mark_int8(weight: torch.Tensor) -> None:
    """Run this weight's products as int8 dynamic quantisation (opt-in: ``kestrel.load(..., quantize="int8")``).

    Weights are quantised per output channel to int8 at their first call; activations per call, per
    tensor (reduce_range, so AVX2's 16-bit intermediate sums cannot saturate). Not exact: the
    accuracy against f32 is in the README.
    """
    key = id(weight)
    if key not in _INT8:
        _INT8[key] = (weakref.ref(weight, lambda _r, k=key: _INT8.pop(k, None)), {})


def int8_available() -> bool:
    return hasattr(torch.ops.quantized, "linear_dynamic") and bool(torch.backends.quantized.supported_engines)


def _int8_packed(weight: torch.Tensor, bias: torch.Tensor | None) -> Any:
    ref, table = _INT8[id(weight)]
    if ref() is not weight:
        return None
    key = id(bias) if bias is not None else 0
    if key not in table:
        w = weight.detach().float()
        scales = (w.abs().amax(dim=1).clamp_min(1e-12) / 127).double()
        zeros = torch.zeros(w.shape[0], dtype=torch.long)
        import warnings

        with warnings.catch_warnings():  # torch deprecates quantised tensors; the packed kernels stay
            warnings.simplefilter("ignore")
            q = torch.quantize_per_channel(w, scales, zeros, 0, torch.qint8)
            table[key] = torch.ops.quantized.linear_prepack(q, None if bias is None else bias.detach().float())
    return table[key]


# --------------------------------------------------------------------------- fused projections


def adjacent(parts: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The concatenation along axis 0 as a view, when the parts already lie end to end in one storage."""
    first = parts[0]
    if not all(p.is_contiguous() and p.dtype == first.dtype and p.device == first.device
               and p.shape[1:] == first.shape[1:] for p in parts):
        return None
    try:
        ptr = first.untyped_storage().data_ptr()
        if any(p.untyped_storage().data_ptr() != ptr for p in parts):
            return None
    except (RuntimeError, NotImplementedError):  # fake, meta or functional tensors
        return None
    offset = first.storage_offset()
    for p in parts:
        if p.storage_offset() != offset:
            return None
        offset += p.numel()
    rows = sum(p.shape[0] for p in parts)
    return first.as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())


# the concatenations made by fuse_in_place, one object per group of parts (kernels cache by identity)
_WHOLE: dict[tuple[int, ...], torch.Tensor] = {}


def fuse_in_place(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Concatenate along axis 0 once and make each part a view of the result (same numbers, no extra memory).

    Parameters keep their objects, names and values: only their storage moves. Later calls get the
    same concatenated tensor back without copying, as long as the parts still lie end to end.
    """
    key = tuple(id(p) for p in parts)
    whole = adjacent(parts)
    cached = _WHOLE.get(key)
    if (whole is not None and cached is not None and cached.data_ptr() == whole.data_ptr()
            and cached.shape == whole.shape):
        return cached
    if whole is None:
        from ..runtime.pages import release_file_pages

        with torch.inference_mode(False), torch.no_grad():  # normal tensors, even in inference mode
            old = [p.detach() for p in parts]
            whole = torch.cat(old, dim=0)
            start = 0
            for p in parts:
                p.data = whole[start:start + p.shape[0]]
                start += p.shape[0]
        for t in old:  # the parts' checkpoint pages, now read by nothing, need not stay resident
            release_file_pages(t)
        del old
    if any(id(p) in _INT8 for p in parts):
        mark_int8(whole)
    _WHOLE[key] = whole
    weakref.finalize(parts[0], _WHOLE.pop, key, None)
    return whole


@dataclass
class _Group:
    """Several projections packed as one GEMM (``mkl-packed``): the packed copy of their concatenation
    takes the parts' file pages' place; the parts stay parameters of their own."""

    refs: tuple[weakref.ref, ...]
    versions: tuple[int, ...]
    rows: int
    packed: torch.Tensor
    bias: torch.Tensor | None
    shape: torch.Tensor  # [sum(Out), In] without storage: MKL's op reads only its sizes at the packed rows


# tuple of the parts' ids -> their packed group (one layout: a new row count replaces the old)
_GROUPS: dict[tuple[int, ...], _Group] = {}


def _packed_group(x: torch.Tensor, x2d: torch.Tensor, weights: Sequence[torch.Tensor],
                  biases: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    """``x @ cat(weights).T + cat(biases)`` as one packed GEMM where the fused shape calibrated to
    ``mkl-packed`` and every part packs at no memory cost; None where it does not (the caller goes on).
    ``x2d`` is ``_rows(x)``."""
    if any(w.shape[1:] != weights[0].shape[1:] for w in weights):
        return None
    rows = x2d.shape[0]
    key = tuple(id(w) for w in weights)
    group = _GROUPS.get(key)
    if (group is not None and group.rows == rows and all(r() is w for r, w in zip(group.refs, weights))
            and group.versions == tuple(_version(w) for w in weights)):
        return _mkl_linear_packed(x, x2d, group)
    if _decide_group(x2d, weights, biases) != "mkl-packed" or not all(packs_in_place(w) for w in weights):
        return None
    _GROUPS.pop(key, None)  # the old layout goes before the new one is made
    whole = torch.cat(list(weights), dim=0)
    with allocator.mapped_apart():
        packed = torch.ops.mkl._mkl_reorder_linear_weight(whole, rows)
    del whole
    for w in weights:
        _PACKED.pop(id(w), None)  # a part's own packed copy, from another row count, is not needed now
        _hand_back(w)
    bias = _cat_biases(weights, biases)
    n = sum(w.shape[0] for w in weights)
    group = _Group(tuple(weakref.ref(w) for w in weights), tuple(_version(w) for w in weights), rows, packed,
                   bias, torch.empty(1, dtype=weights[0].dtype).expand(n, weights[0].shape[1]))
    _GROUPS[key] = group
    weakref.finalize(weights[0], _GROUPS.pop, key, None)
    return _mkl_linear_packed(x, x2d, group)


def _mkl_linear_packed(x: torch.Tensor, x2d: torch.Tensor, group: _Group) -> torch.Tensor:
    out = torch.ops.mkl._mkl_linear(x2d, group.packed, group.shape, group.bias, group.rows)
    return out.view(*x.shape[:-1], group.shape.shape[0])


def _decide_group(x2d: torch.Tensor, weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None]) -> str:
    """The kernel calibrated (or forced) for the fused shape ``rows x sum(Out) x In``; measured on a
    temporary concatenation the first time (remembered like a single weight's decision)."""
    has_bias = any(b is not None for b in biases)
    key = (tuple(id(w) for w in weights), x2d.shape[0], has_bias, torch.get_num_threads())
    hit = _recalled(key, weights[0])
    if hit is not None:
        return hit
    from ..runtime import calibrate

    whole = torch.cat(list(weights), dim=0)
    choose(x2d, whole, _cat_biases(weights, biases))  # measures the fused shape if new; calibrate_model sees it
    del whole
    m, k = x2d.shape
    name = forced() or calibrate.table().get(m, sum(w.shape[0] for w in weights), k, has_bias) or DEFAULT
    return _remember(key, weights[0], name)


def _packs_parts(x2d: torch.Tensor, weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None]) -> bool:
    """Whether every part of a fused projection would run on its own packed copy (same-shaped parts
    whose shape calibrated to a packing kernel, each packable at no memory cost)."""
    if any(w.shape != weights[0].shape for w in weights):
        return False
    return all(KERNELS[_decide(x2d, w, b)].copies_weight for w, b in zip(weights, biases))


def fused_linear(x: torch.Tensor, weights: Sequence[torch.Tensor],
                 biases: Sequence[torch.Tensor | None]) -> tuple[torch.Tensor, ...]:
    """Several projections of one input as one GEMM: ``linear(x, cat(weights), cat(biases))``, split."""
    sizes = [w.shape[0] for w in weights]
    params = [*weights, *(b for b in biases if b is not None)]
    eager = (eager_ok(x, weights[0]) and not any(p.requires_grad for p in params)
             and all(type(p) in (torch.Tensor, torch.nn.Parameter) for p in params))
    if eager and x.numel() > 0:
        x2d = _rows(x)
        if "mkl-packed" in KERNELS:
            out = _packed_group(x, x2d, weights, biases)
            if out is not None:
                return tuple(torch.split(out, sizes, dim=-1))
        if _packs_parts(x2d, weights, biases):
            # each part runs packed: the packed copies replace the checkpoint's pages, where a fused
            # buffer would be a second copy in memory (and packed parts outrun any fused in-place GEMM)
            return tuple(linear(x, w, b) for w, b in zip(weights, biases))
    if eager:
        weight = fuse_in_place(weights)
        all_biases = all(b is not None for b in biases)
        bias = fuse_in_place(biases) if all_biases else _cat_biases(weights, biases)  # type: ignore[arg-type]
    else:  # traced, compiled or trained: plain concatenation, which inductor's freezing folds
        weight = torch.cat(list(weights), dim=0)
        bias = _cat_biases(weights, biases)
    return tuple(torch.split(linear(x, weight, bias), sizes, dim=-1))
