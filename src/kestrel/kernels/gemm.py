"""GEMM kernels for ``ops.linear``: the per-shape choice among the installed paths, fused projections,
the transposed 2 x 2 convolution as a GEMM, and opt-in int8.

Which f32 GEMM is fastest depends on the CPU, the libraries, the thread count and the shape: on
one machine oneDNN ran at twice MKL, on the next it lost by 10%. So nothing here names a vendor or
a CPU. Every eager ``linear`` call on CPU asks :func:`choose` for its shape ``(M, N, K)``; the first
time a shape is seen on this machine (this CPU model, thread count and library versions) a short
calibration times every candidate (:mod:`kestrel.kernels.library`) on that call's own data (its
weight streamed from memory, as a forward reads it), interleaved, checks each against ``F.linear``,
keeps the fastest and writes the choice to the user's cache directory
(:mod:`kestrel.kernels.calibration` reads and prints it; ``kestrel doctor``).

Compiled, traced and exported graphs, autograd, other dtypes and devices always take ``F.linear``
(inductor makes its own choice there). ``KESTREL_LINEAR=torch|onednn|mkl-packed`` forces one path;
``KESTREL_CALIBRATE=0`` turns calibration off (unseen shapes then take ``torch``). Everything derived
from a weight (decisions, packed layouts, fused concatenations, int8 copies) is kept in
:data:`kestrel.kernels.weights.WEIGHTS` under its one invalidation rule.
"""

from __future__ import annotations

import contextlib
import functools
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from . import allocator, calibration, settings
from .activations import gelu_tanh_
from .contention import note_load, others_share
from .library import DEFAULT, KERNELS, Kernel, eager_ok, kernels_for, packed, packs_in_place, plain_inference
from .library import hand_back as _hand_back
from .pages import release_file_pages
from .settings import SettingError
from .weights import WEIGHTS

__all__ = ["DEFAULT", "GELU_WAYS", "KERNELS", "Kernel", "choose", "choose_int8", "conv_transpose2x2", "eager_ok",
           "forced", "fused_linear", "int8_available", "int8_marked", "linear", "linear_gelu", "mark_int8", "measure",
           "measure_gelu", "measure_int8", "packs_in_place", "plain_inference"]
# shapes under this many FLOPs are not worth timing: they run torch's default
MIN_CALIBRATED_FLOPS = 2e6
# calibration of one shape: at most this many rows of the call's input, about settings.calibration_budget()
# seconds (KESTREL_CALIBRATION_BUDGET, 0.4 by default) in CAL_ROUNDS rounds. 4096 rows is
# SAM's and SAM 2.1's decoders at batch 1 (a 64 x 64 grid of image tokens): timed at 2048 rows (2 MB of input
# for a 256-wide shape, an L2's worth) the kernels ranked differently from the 4096 rows a decode runs (one AMD
# EPYC, 4096 x 256 -> 128: MKL packed and oneDNN packed level at 2048 rows, oneDNN packed 1.3x at 4096)
CAL_ROWS = 4096
CAL_ROUNDS = (3, 12)  # at least, at most
# Where the two fastest candidates stand within CLOSE_MARGIN of each other after the budget, the race goes on, up
# to CLOSE_BUDGET times the budget (and CAL_ROUNDS' most): on a virtual machine one round's noise (10-30% seen)
# otherwise decides between two kernels whose difference in the model is real (a SAM decode: 4 ms of 48)
CLOSE_MARGIN = 0.05
CLOSE_BUDGET = 3.0
# a candidate replaces torch's default only when it is this much faster (noise on shared machines)
MARGIN = 0.03
# a candidate must match F.linear to this relative error (max |diff| / max |ref|) to be eligible; in bf16,
# where every output is rounded to 8 bits of mantissa, to one rounding of the largest output
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


# -------------------------------------------------------------------------------- the choice


def check_tol(dtype: torch.dtype) -> float:
    """The largest relative difference from ``F.linear`` a candidate kernel may show in ``dtype``."""
    return max(CHECK_TOL, torch.finfo(dtype).eps)


def forced() -> str | None:
    """The kernel ``KESTREL_LINEAR`` forces, or None (``KESTREL_ONEDNN=0`` still means torch)."""
    name = settings.linear_kernel()
    if name is not None and name not in KERNELS:
        raise SettingError(f"KESTREL_LINEAR={name!r}: not a kernel here; available: {', '.join(KERNELS)} or auto")
    return name


def choose(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> str:
    """The kernel for this call's shape: forced, cached, calibrated now, or torch's default.

    A calibrated choice that runs on a packed copy of the weight stands only where packing this weight
    costs no memory (:func:`packs_in_place`); elsewhere the fastest kernel that reads it in place runs.
    """
    m, k = x2d.shape
    n = weight.shape[0]
    dtype = x2d.dtype
    calibration.note(calibration.shape_key(m, n, k, bias is not None, dtype))
    name = forced()
    if name is not None:
        return name if dtype in KERNELS[name].dtypes else DEFAULT
    table = calibration.table()
    entry = table.entry(m, n, k, bias is not None, dtype)
    if (entry is None or entry.get("kernel") not in KERNELS) and m > CAL_ROWS:
        # measure() times CAL_ROWS rows of any taller input: a shape measured at another height above
        # CAL_ROWS was the same experiment. Taken over, not repeated: a model whose row count grows
        # call by call (SAM 2's memory attention, F memory frames x E x E rows) measures once
        entry = table.capped(n, k, bias is not None, CAL_ROWS, dtype)
        if entry is not None and entry.get("kernel") in KERNELS:
            table.put(m, n, k, bias is not None, entry, dtype)
    if entry is None or entry.get("kernel") not in KERNELS:
        if not settings.calibrate() or 2.0 * m * n * k < MIN_CALIBRATED_FLOPS or len(kernels_for(dtype)) == 1:
            return DEFAULT
        entry = measure(x2d, weight, bias)
        table.put(m, n, k, bias is not None, entry, dtype)
    name = entry["kernel"]
    if KERNELS[name].copies_weight and not packs_in_place(weight):
        fallback = entry.get("in_place", DEFAULT)
        return fallback if fallback in KERNELS else DEFAULT
    return name


def measure(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            kernels: Sequence[str] | None = None, budget_s: float | None = None) -> dict[str, Any]:
    """Time every candidate on (up to CAL_ROWS rows of) this input, interleaved; check each against F.linear.

    Each timing is a pass over enough copies of the weight (COLD_BYTES) that none is in cache when it
    is read, as in a model's forward; the copies live only while measuring. The candidates are the
    kernels of the input's dtype (f32 or bf16).

    Returns ``{"kernel": chosen, "in_place": the fastest that reads the weight in place (for weights that
    cannot be packed at no memory cost), "gflops": {name: best rate}, "rejected": {name: why},
    "rows": timed rows, "others": the share of the machine other processes took meanwhile}``, with
    ``"disturbed": True`` where that share exceeded ``contention.DISTURBED``: such a choice serves this
    process, and the next one measures the shape again.
    """
    budget_s = _start_race(budget_s)
    names = list(kernels or kernels_for(x2d.dtype))
    x = x2d[:CAL_ROWS]
    m, k = x.shape
    n = weight.shape[0]
    flops = 2.0 * m * n * k
    ref = F.linear(x, weight, bias).float()
    scale = float(ref.abs().max()) or 1.0
    tol = check_tol(x.dtype)
    rejected: dict[str, str] = {}
    live: list[str] = []
    for name in names:
        try:
            out = KERNELS[name].run(x, weight, bias)
            err = float((out.float() - ref).abs().max()) / scale
        except Exception as e:  # a library that refuses this shape is simply not a candidate
            rejected[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}"
            continue
        if not err <= tol:
            rejected[name] = f"differs from F.linear by {err:.1e}"
            continue
        live.append(name)
    copies = _pass_copies(weight, flops, budget_s) if live else 1
    with _copies(weight, copies) as weights:
        runs = {name: functools.partial(_run_on, KERNELS[name].run, x, weights, bias) for name in live}
        # a weight keeps one packed layout, so two packing kernels on the same copies repack them in turn:
        # each packs its layouts untimed before its pass, or it would be timed clean in one round of three
        prepare = {name: functools.partial(_pack_all, KERNELS[name], weights, m)
                   for name in live if KERNELS[name].copies_weight}
        best, others = _race(runs, len(weights), budget_s, prepare)
    gflops = {name: flops / t / 1e9 for name, t in best.items()}
    in_place = _pick({nm: r for nm, r in gflops.items() if not KERNELS[nm].copies_weight})
    out = {"kernel": _pick(gflops), "in_place": in_place, "gflops": {nm: round(v, 2) for nm, v in gflops.items()},
           "rejected": rejected, "rows": m}
    return note_load(out, others)


def _pass_copies(weight: torch.Tensor, flops: float, budget_s: float) -> int:
    """How many copies of ``weight`` one timed pass runs over: enough that none is in cache when it is read
    (COLD_BYTES), fewer for a long GEMM (PASS_FLOPS), whose first read of the weight hardly shows. A budget
    below the default (``KESTREL_CALIBRATION_BUDGET``) shrinks the pass in proportion, down to the weight alone
    at 0 (the test suite's): a cheaper race on warmer weights, the default's unchanged."""
    cold = max(1, min(MAX_COPIES, -(-COLD_BYTES // max(1, weight.numel() * weight.element_size())),
                      int(PASS_FLOPS // max(flops, 1.0))))
    return max(1, int(cold * min(1.0, budget_s / settings.DEFAULT_CALIBRATION_BUDGET_S)))


@contextlib.contextmanager
def _copies(weight: torch.Tensor, copies: int) -> Iterator[list[torch.Tensor]]:
    """``weight`` and ``copies - 1`` copies of it, for the time of a measurement; the packed layouts made of them
    for timing are dropped with them (the chosen kernel packs its own).

    One allocation for all copies, mapped apart from the heap and handed back to the system when freed:
    from the heap they would stay resident, among the activations of the forward that is calibrating, and
    steer where its later calls' activations land (README: the peaks measured)."""
    weights = [weight]
    if copies > 1:
        with allocator.mapped_apart():
            weights += weight.expand(copies - 1, *weight.shape).clone().unbind(0)
    try:
        yield weights
    finally:
        for w in weights:
            WEIGHTS.pop("packed", (w,))
        del weights
        allocator.note_burst()  # the entry running this forward hands the copies' pages back when it returns


def _run_on(run: Any, x: torch.Tensor, weights: Sequence[Any], bias: torch.Tensor | None, i: int) -> None:
    run(x, weights[i], bias)


def _pack_all(kernel: Kernel, weights: Sequence[torch.Tensor], rows: int) -> None:
    """Every copy packed for ``kernel`` at ``rows`` (a no-op where they already are)."""
    for w in weights:
        packed(w, rows, kernel)


def _race(runs: dict[str, Any], copies: int, budget_s: float,
          prepare: dict[str, Any] | None = None) -> tuple[dict[str, float], float | None]:
    """Time every ``runs[name](i)`` as passes over ``i in range(copies)``, interleaved, alternating the order
    (no seat is favoured), CAL_ROUNDS rounds within about ``budget_s``; the best seconds per call of each, and
    the share of the machine other processes took meanwhile. ``prepare[name]()``, where given, runs untimed
    before each of that candidate's passes."""
    prepare = prepare or {}
    best = dict.fromkeys(runs, float("inf"))
    names = list(runs)
    lo, hi = CAL_ROUNDS

    def rounds() -> None:
        start = time.perf_counter()
        for r in range(hi):
            for name in (names if r % 2 == 0 else names[::-1]):
                run = runs[name]
                if name in prepare:
                    prepare[name]()
                t = time.perf_counter()
                for i in range(copies):  # one pass over cold weights, as a forward reads them
                    run(i)
                best[name] = min(best[name], (time.perf_counter() - t) / copies)
            if r + 1 >= lo and time.perf_counter() - start > budget_s * (CLOSE_BUDGET if _close(best) else 1.0):
                break

    _, others = others_share(rounds)
    return best, others


def _start_race(budget_s: float | None) -> float:
    """A race's budget (the caller's, else ``KESTREL_CALIBRATION_BUDGET``'s), read before the race is announced to
    the open watches (``calibration.measuring``): a bad setting is refused before anything is said or timed."""
    budget = settings.calibration_budget() if budget_s is None else budget_s
    calibration.measuring()
    return budget


def _close(best: dict[str, float]) -> bool:
    """Whether the two fastest times so far are within CLOSE_MARGIN of each other."""
    times = sorted(best.values())
    return len(times) > 1 and times[1] < times[0] * (1 + CLOSE_MARGIN)


def _pick(gflops: dict[str, float]) -> str:
    """The fastest kernel; torch's default unless beaten by MARGIN."""
    if not gflops:
        return DEFAULT
    chosen = max(gflops, key=lambda n: gflops[n])
    if DEFAULT in gflops and gflops[chosen] < gflops[DEFAULT] * (1 + MARGIN):
        chosen = DEFAULT
    return chosen


# ---------------------------------------------------------------------------------- the kernels


# A linear's decision, kept per (weight, rows, bias or not, thread count) so that a forward's steady state costs one
# lookup: each Python call in a forward runs on caches the GEMMs just flushed, where the full decision
# (settings, table, memory verdict) cost ~25 us a call, 3% of SigLIP's text tower at batch 1. A weight
# written to (its version moves) is decided again; calibration.forget_decisions() drops them all (the
# calibration's forget and reset call it), so settings changed mid-process apply to new weights, or
# after a forget.
def _decide(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> str:
    extra = (x2d.shape[0], bias is not None, torch.get_num_threads())
    name = WEIGHTS.get("decision", (weight,), extra)
    return name if name is not None else WEIGHTS.put("decision", (weight,), choose(x2d, weight, bias), extra)


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
    if x2d.dtype == torch.float32 and _marked_int8(weight):
        int8 = _decide_int8(x2d, weight, bias)
        if int8 is not None:
            y = torch.ops.quantized.linear_dynamic(x2d, _int8_packed(weight, bias, int8), True)
            return y.view(*x.shape[:-1], weight.shape[0])
    name = _decide(x2d, weight, bias)
    if name == DEFAULT:
        return F.linear(x, weight, bias)
    return KERNELS[name].run(x2d, weight, bias).view(*x.shape[:-1], weight.shape[0])


def linear_gelu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                approximate: str = "none") -> torch.Tensor:
    """``gelu(x @ weight.T + bias)``, an MLP's first half. With the tanh approximation, where the GELU runs is
    measured per shape and kernel (:data:`GELU_WAYS`, :func:`measure_gelu`): as oneDNN's post-op on each output
    tile before it is stored (the hidden activation, an MLP's largest tensor, written once and not read back),
    or in place after the GEMM in one of two forms. Elsewhere (int8, the exact GELU, whose separate pass costs
    next to nothing) the GEMM, then the GELU in place on its fresh output. Graphs see ``F.linear`` +
    ``F.gelu``."""
    if not eager_ok(x, weight) or x.numel() == 0:
        return F.gelu(F.linear(x, weight, bias), approximate=approximate)
    if approximate == "tanh" and not _marked_int8(weight):
        x2d = _rows(x)
        name = _decide(x2d, weight, bias)
        run = _gelu_run(KERNELS[name], _gelu_way(x2d, weight, bias, name))
        return run(x2d, weight, bias).view(*x.shape[:-1], weight.shape[0])
    y = linear(x, weight, bias)
    if approximate == "tanh":
        return gelu_tanh_(y)
    return torch.ops.aten.gelu_(y)


def _torch_gelu_tanh_(y: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten.gelu_(y, approximate="tanh")


# The tanh-GELU placements linear_gelu races per shape and kernel, the first that applies being the default:
#   post-op  the kernel's own (oneDNN's, applied to each output tile before it is stored)
#   sigmoid  the GEMM, then gelu_tanh_ in place (x * sigmoid(2u) in cache-sized steps)
#   torch    the GEMM, then torch's tanh GELU in place
# Which wins depends on the CPU: SigLIP's 1568-row MLP GEMM on an AMD EPYC with AVX2 took 57 ms alone, 87 with
# oneDNN's post-op and 63 with a separate pass, where on an AVX-512 EPYC the post-op saved 5% (README,
# "Measurements behind the kernels").
GELU_WAYS = ("post-op", "sigmoid", "torch")
_TANH_PASSES = {"sigmoid": gelu_tanh_, "torch": _torch_gelu_tanh_}


def _gelu_way(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, name: str) -> str:
    """Where this linear's tanh GELU runs (:data:`GELU_WAYS`): measured once per shape and kernel, kept beside the
    shape's kernel choice in the calibration table. Unmeasured (a forced kernel, a shape too small to calibrate,
    ``KESTREL_CALIBRATE=0``): the kernel's post-op where it has one, else the sigmoid form."""
    extra = (x2d.shape[0], bias is not None, torch.get_num_threads(), name)
    way = WEIGHTS.get("gelu-way", (weight,), extra)
    if way is None:
        way = WEIGHTS.put("gelu-way", (weight,), _gelu_verdict(x2d, weight, bias, name), extra)
    return way


def _gelu_ways(name: str) -> list[str]:
    return [w for w in GELU_WAYS if w != "post-op" or KERNELS[name].run_gelu_tanh is not None]


def _gelu_verdict(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, name: str) -> str:
    m, k = x2d.shape
    n = weight.shape[0]
    table = calibration.table()
    entry = table.entry(m, n, k, bias is not None, x2d.dtype)
    default = _gelu_ways(name)[0]
    if entry is None or entry.get("kernel") != name:  # forced, not calibrated, or an in-place fallback
        return default
    known = entry.get("gelu_tanh", {}).get(name, {}).get("way")
    if known in _gelu_ways(name):
        return known
    if not settings.calibrate():
        return default
    result = measure_gelu(x2d, weight, bias, name)
    if not result.get("disturbed"):  # as a kernel choice: one measured while others took the cores serves this
        entry.setdefault("gelu_tanh", {})[name] = result  # process only, the next measures again
        table.save()
    return result["way"]


def measure_gelu(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, name: str,
                 budget_s: float | None = None) -> dict[str, Any]:
    """Race the tanh-GELU placements of :data:`GELU_WAYS` that ``name`` allows after its GEMM, on (up to
    CAL_ROWS rows of) this input and cold copies of the weight, as :func:`measure` races kernels.
    ``{"way": the chosen, "ms": {way: best milliseconds}, "rows": timed rows, "others": the share of the machine
    other processes took meanwhile}`` (``"disturbed"`` as in :func:`measure`): another way replaces the default
    (the first) only where it wins by MARGIN."""
    budget_s = _start_race(budget_s)
    kernel = KERNELS[name]
    ways = _gelu_ways(name)
    x = x2d[:CAL_ROWS]
    m = x.shape[0]
    copies = _pass_copies(weight, 2.0 * m * weight.shape[0] * x.shape[1], budget_s)
    with _copies(weight, copies) as weights:
        if kernel.copies_weight:
            _pack_all(kernel, weights, m)
        runs = {way: functools.partial(_run_on, _gelu_run(kernel, way), x, weights, bias) for way in ways}
        best, others = _race(runs, copies, budget_s / 2)  # one GEMM, two or three epilogues: half a kernel race
    fastest = min(best, key=best.__getitem__)
    way = fastest if best[fastest] * (1 + MARGIN) < best[ways[0]] else ways[0]
    return note_load({"way": way, "ms": {label: round(t * 1e3, 3) for label, t in best.items()}, "rows": m},
                     others)


def _gelu_run(kernel: Kernel, way: str) -> Any:
    """``kernel``'s GEMM with the tanh GELU placed ``way``: what linear_gelu runs and measure_gelu times."""
    if way == "post-op":
        return kernel.run_gelu_tanh
    gelu_pass = _TANH_PASSES[way]

    def run(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        return gelu_pass(kernel.run(x, w, b))
    return run


# ------------------------------------------------------------------------- transposed 2x2 convolution


def conv_transpose2x2(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Stride-2 transposed 2 x 2 convolution, ``[B, Cin, H, W] -> [B, Cout, 2H, 2W]``.

    Each input pixel becomes its own 2 x 2 block, so in eager f32 inference on CPU it runs as one
    GEMM over pixels (``[B*H*W, Cin] @ [Cin, Cout*4]``, the bias added in the GEMM) through the kernel
    calibrated for its shape, like any linear, and a single copy that interleaves the blocks. The result is
    laid out channels-last (strides, not shape): a channel norm, an activation or a second such convolution
    after it then reads it with the grain, and an input that is already channels-last (SAM's decoder hands
    over its image tokens that way) is read without a copy (SAM's decoder, against oneDNN's deconvolution:
    README, "Measurements behind the kernels").
    """
    if not (eager_ok(x, weight) and x.dim() == 4 and weight.shape[2:] == (2, 2)) or x.numel() == 0:
        return F.conv_transpose2d(x, weight, bias, stride=2)
    b, cin, h, w = x.shape
    cout = weight.shape[1]
    pixels = x.permute(0, 2, 3, 1).reshape(b * h * w, cin)  # a view when x is channels-last
    rows, bias4 = WEIGHTS.get_or_make("deconv-rows", (weight,) if bias is None else (weight, bias),
                                      lambda: _deconv_rows(weight, bias))
    if _marked_int8(weight):
        mark_int8(rows)  # int8 asked for the convolution: its GEMM races the int8 kernels like a linear's
    blocks = linear(pixels, rows, bias4).view(b, h, w, 2, 2 * cout)
    out = torch.empty(b, h, 2, w, 2 * cout, dtype=x.dtype)
    out.copy_(blocks.transpose(2, 3))  # out[b, h, i, w, (j, c)] = blocks[b, h, w, i, (j, c)]
    return out.view(b, 2 * h, 2 * w, cout).permute(0, 3, 1, 2)


def _deconv_rows(weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A 2 x 2 transposed convolution's weight ``[Cin, Cout, 2, 2]`` as a linear's ``[4 * Cout, Cin]``, its rows
    ordered (i, j, c) so that each pixel's 2 x 2 block comes out as two runs of 2 * Cout numbers, and the bias
    once per row (kept as derived state of the weight: made once, not per call). Through the calibrated kernel,
    the bias in the GEMM rather than in the interleaving pass: SAM's decode on an AMD EPYC, one process,
    interleaved, 37.3 -> 35.8 ms at batch 1 and 273 -> 256 ms at batch 8."""
    rows = weight.permute(2, 3, 1, 0).reshape(4 * weight.shape[1], weight.shape[0]).contiguous()
    return rows, (bias.repeat(4) if bias is not None else None)


# ------------------------------------------------------------------------- int8 (opt-in, not exact)

# int8 is a request on the weight itself (an attribute, kept by the object whatever its version); the
# quantised copy is derived state, kept in WEIGHTS and made again when the weight or bias is written to
_INT8_FLAG = "_kestrel_int8"
_INT8_MARKED = [False]  # whether any weight was ever marked: the common path skips the attribute lookup


def mark_int8(weight: torch.Tensor) -> None:
    """Run this weight's products as int8 dynamic quantisation (opt-in: ``kestrel.load(..., quantize="int8")``).

    Weights are quantised per output channel to int8 at their first call; activations per call, per
    tensor (reduce_range, so AVX2's 16-bit intermediate sums cannot saturate). Not exact: the
    accuracy against f32 is in the README.
    """
    setattr(weight, _INT8_FLAG, True)
    _INT8_MARKED[0] = True


def _marked_int8(weight: torch.Tensor) -> bool:
    """Whether int8 was asked for this weight (one flag test on the common path, where nothing was marked)."""
    return _INT8_MARKED[0] and getattr(weight, _INT8_FLAG, False)


def int8_marked(weight: torch.Tensor) -> bool:
    """Whether int8 was asked for this weight (:func:`mark_int8`)."""
    return bool(_marked_int8(weight))


def int8_available() -> bool:
    return hasattr(torch.ops.quantized, "linear_dynamic") and bool(torch.backends.quantized.supported_engines)


def _int8_engines() -> dict[str, str]:
    """The int8 kernels, each torch's dynamic int8 linear under one quantized engine: ``int8`` under the
    engine torch picks for this CPU (``x86``: FBGEMM), ``int8-onednn`` under oneDNN's, where it is another
    (on CPUs with AMX it ran 1.3-2x FBGEMM's rate; elsewhere it may lose: each shape races them)."""
    default = torch.backends.quantized.engine
    engines = {"int8": default}
    if "onednn" in torch.backends.quantized.supported_engines and default != "onednn":
        engines["int8-onednn"] = "onednn"
    return engines


INT8_KERNELS: dict[str, str] = _int8_engines()


@contextlib.contextmanager
def _quantized_engine(engine: str) -> Iterator[None]:
    """torch's quantized engine set to ``engine`` (a global setting) for the prepacking inside."""
    before = torch.backends.quantized.engine
    torch.backends.quantized.engine = engine
    try:
        yield
    finally:
        torch.backends.quantized.engine = before


def _decide_int8(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> str | None:
    """The int8 kernel this marked weight runs at this row count, or None where f32 is faster: remembered
    per weight like :func:`_decide`."""
    extra = (x2d.shape[0], bias is not None, torch.get_num_threads())
    hit = WEIGHTS.get("int8-decision", (weight,), extra)
    if hit is None:  # "" for f32: a kept decision, where None is a miss
        chosen = choose_int8(x2d, weight, bias)
        hit = WEIGHTS.put("int8-decision", (weight,), chosen if chosen in INT8_KERNELS else "", extra)
    return hit or None


def int8_key(m: int, n: int, k: int, bias: bool) -> str:
    return "int8 " + calibration.shape_key(m, n, k, bias)


def choose_int8(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> str:
    """An int8 kernel (:data:`INT8_KERNELS`), or the f32 kernel where int8 is not faster for this shape:
    cached, or measured now.

    int8 is asked for per model, but it does not win everywhere (a small GEMM is dominated by quantising
    its input; a CPU without 8-bit dot products gains less), and which engine's int8 is faster depends on
    the CPU: each shape races the int8 kernels against the f32 kernel its own calibration chose, on the
    call's data, as :func:`measure` does, and keeps the fastest. Forced kernels and ``KESTREL_CALIBRATE=0``
    keep int8, under torch's default engine, everywhere it was asked for.
    """
    m, k = x2d.shape
    n = weight.shape[0]
    key = int8_key(m, n, k, bias is not None)
    calibration.note(key)
    if forced() is not None or not settings.calibrate() or 2.0 * m * n * k < MIN_CALIBRATED_FLOPS:
        return "int8"
    table = calibration.table()
    entry = table.shapes.get(key)
    if entry is None:
        entry = measure_int8(x2d, weight, bias, choose(x2d, weight, bias))
        table.put_entry(key, entry)
    return entry["kernel"]


def measure_int8(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, f32: str,
                 budget_s: float | None = None) -> dict[str, Any]:
    """Race the int8 kernels against the f32 kernel ``f32`` on (up to CAL_ROWS rows of) this input, each over
    cold copies of its own weight; ``{"kernel": the fastest, "gflops": {...}, "rows", "others"}``. int8 must
    beat f32 by MARGIN: it is not exact, so a tie goes to f32."""
    budget_s = _start_race(budget_s)
    x = x2d[:CAL_ROWS]
    m, k = x.shape
    flops = 2.0 * m * weight.shape[0] * k
    copies = _pass_copies(weight, flops, budget_s)
    with _copies(weight, copies) as weights:
        runs: dict[str, Any] = {}
        for name, engine in INT8_KERNELS.items():
            packs = [_quantize(w, bias, engine) for w in weights]
            runs[name] = functools.partial(_run_int8, x, packs)
        runs[f32] = functools.partial(_run_on, KERNELS[f32].run, x, weights, bias)  # what choose() gave it
        prepare = {f32: functools.partial(_pack_all, KERNELS[f32], weights, m)} if KERNELS[f32].copies_weight else {}
        best, others = _race(runs, copies, budget_s, prepare)
        del runs
    gflops = {name: flops / t / 1e9 for name, t in best.items()}
    fastest = max(INT8_KERNELS, key=gflops.__getitem__)
    chosen = fastest if gflops[fastest] > gflops[f32] * (1 + MARGIN) else f32
    return note_load({"kernel": chosen, "gflops": {nm: round(v, 2) for nm, v in gflops.items()}, "rows": m},
                     others)


def _run_int8(x: torch.Tensor, packs: Sequence[Any], i: int) -> None:
    torch.ops.quantized.linear_dynamic(x, packs[i], True)


def _int8_packed(weight: torch.Tensor, bias: torch.Tensor | None, kernel: str) -> Any:
    """The weight quantised and packed for ``kernel``'s engine. A weight whose row counts chose different
    engines keeps a pack for each (a quarter of its f32 size apiece) rather than repacking per call."""
    owners = (weight,) if bias is None else (weight, bias)
    return WEIGHTS.get_or_make("int8", owners, lambda: _quantize(weight, bias, INT8_KERNELS[kernel]), kernel)


def _quantize(weight: torch.Tensor, bias: torch.Tensor | None, engine: str) -> Any:
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1).clamp_min(1e-12) / 127).double()
    zeros = torch.zeros(w.shape[0], dtype=torch.long)
    with warnings.catch_warnings(), _quantized_engine(engine):  # torch deprecates quantised tensors; the
        warnings.simplefilter("ignore")  # packed kernels stay
        q = torch.quantize_per_channel(w, scales, zeros, 0, torch.qint8)
        return torch.ops.quantized.linear_prepack(q, None if bias is None else bias.detach().float())


# --------------------------------------------------------------------------- fused projections


def fuse_in_place(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The parts' concatenation along axis 0, each part made a view of it (:meth:`WeightCache.fuse`: the
    one place a parameter's storage moves). The parts' checkpoint pages, then read by nothing, are
    handed back."""
    whole = WEIGHTS.fuse(parts, release=release_file_pages)
    if any(getattr(p, _INT8_FLAG, False) for p in parts):
        mark_int8(whole)
    return whole


@dataclass
class _Group:
    """Several projections packed as one GEMM (a packing kernel's layout of their concatenation): the packed
    copy takes the parts' file pages' place; the parts stay parameters of their own."""

    kernel: Kernel
    rows: int
    packed: torch.Tensor
    bias: torch.Tensor | None
    shape: torch.Tensor  # [sum(Out), In] without storage: the packed GEMMs read only its sizes


def _packed_group(x: torch.Tensor, x2d: torch.Tensor, weights: Sequence[torch.Tensor],
                  biases: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    """``x @ cat(weights).T + cat(biases)`` as one packed GEMM where the fused shape calibrated to a packing
    kernel and every part packs at no memory cost; None where it does not (the caller goes on).
    ``x2d`` is ``_rows(x)``."""
    if any(w.shape[1:] != weights[0].shape[1:] for w in weights):
        return None
    rows = x2d.shape[0]
    group = WEIGHTS.get("packed-group", weights)  # one layout per group: a new row count replaces the old
    if group is not None and group.kernel.fits((group.kernel.name, group.rows), rows):
        return _run_group(x, x2d, group)
    kernel = KERNELS[_decide_group(x2d, weights, biases)]
    if kernel.pack is None or not all(packs_in_place(w) for w in weights):
        return None
    WEIGHTS.pop("packed-group", weights)  # the old layout goes before the new one is made
    del group
    whole = torch.cat(list(weights), dim=0)
    with allocator.mapped_apart():
        packed = kernel.pack(whole, rows)
    del whole
    for w in weights:
        WEIGHTS.pop("packed", (w,))  # a part's own packed copy, from another row count, is not needed now
        _hand_back(w)
    bias = _cat_biases(weights, biases)
    n = sum(w.shape[0] for w in weights)
    group = WEIGHTS.put("packed-group", weights, _Group(
        kernel, rows, packed, bias, torch.empty(1, dtype=weights[0].dtype).expand(n, weights[0].shape[1])))
    return _run_group(x, x2d, group)


def _run_group(x: torch.Tensor, x2d: torch.Tensor, group: _Group) -> torch.Tensor:
    assert group.kernel.run_packed is not None
    out = group.kernel.run_packed(x2d, group.packed, group.shape, group.bias, x2d.shape[0])
    return out.view(*x.shape[:-1], group.shape.shape[0])


def _decide_group(x2d: torch.Tensor, weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None]) -> str:
    """The kernel calibrated (or forced) for the fused shape ``rows x sum(Out) x In``; measured on a
    temporary concatenation the first time (remembered like a single weight's decision)."""
    has_bias = any(b is not None for b in biases)
    extra = (x2d.shape[0], has_bias, torch.get_num_threads())
    hit = WEIGHTS.get("decision", weights, extra)
    if hit is not None:
        return hit
    whole = torch.cat(list(weights), dim=0)
    name = choose(x2d, whole, _cat_biases(weights, biases))  # measures the fused shape if new; recorders see it
    del whole
    if forced() is None:  # the measured choice, not choose()'s fallback for the temporary concatenation
        m, k = x2d.shape
        measured = calibration.table().get(m, sum(w.shape[0] for w in weights), k, has_bias, x2d.dtype)
        name = measured if measured in KERNELS else DEFAULT
    return WEIGHTS.put("decision", weights, name, extra)


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
        int8 = x2d.dtype == torch.float32 and any(_marked_int8(w) for w in weights)
        out = None if int8 else _packed_group(x, x2d, weights, biases)  # int8 runs on the fused buffer below
        if out is not None:
            return tuple(torch.split(out, sizes, dim=-1))
        if not int8 and _packs_parts(x2d, weights, biases):
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
