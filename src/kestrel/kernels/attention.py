"""Attention kernels: plain scaled dot-product attention by measured choice, and attention with decomposed
relative positions without materialising every score at once.

Plain attention (:func:`sdpa`) in bf16 has two paths on CPU: torch's fused kernel, which never holds all the
scores, and two batched GEMMs around a soft-max in place. Which is faster depends on the shape and the
machine (on one AMD EPYC, bf16 at 8 x 12 heads x 257 tokens: 16.4 ms fused, 8.8 ms as GEMMs, whose bf16
products run on the CPU's bf16 dot products; at 1370 tokens the fused kernel won). So the first call of a
shape times both, interleaved, and the calibration table keeps the faster.

SAM's image encoder (after MViTv2) adds to the score of query ``n`` against key ``(i, j)`` of a
``Kh x Kw`` grid two small terms, ``rel_h[n, i] + rel_w[n, j]``. Building that bias for every head of
a global layer at 1024 px is ``Heads x 4096 x 4096`` floats (about 800 MB for ViT-B); this kernel
instead takes the two terms as they are and works through the scores in slices that fit a budget:
whole heads at a time when they are small (the windowed layers), else chunks of query rows of one
head, the slice size measured per machine and shape. Per slice, in one scores buffer reused from
slice to slice: the two terms broadcast into it (``rel_h + rel_w``, one pass), ``q k^T * scale``
accumulated onto them by the GEMM (``baddbmm``), the softmax in place, times ``v``. Against the
reference's order (``(q k^T + rel_h) + rel_w``) that is a rounding-level difference (~5e-7 relative)
and three fewer passes over each slice (measured figures: README, "Measurements behind the kernels").
Compiled, exported and autograd graphs take the plain out-of-place form.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from . import allocator, calibration, settings
from .contention import note_load, others_share
from .library import plain_inference

# Bytes of scores one slice may hold. The slice size trades cache reuse against per-slice overhead
# and which one is fastest depends on the machine's caches (README: one machine's figures). So the first
# call of a shape on a machine times these candidates on its own data and the calibration table keeps
# the choice; KESTREL_ATTENTION_BUDGET fixes it (bytes) instead.
SLICE_CANDIDATES = (4 << 20, 16 << 20, 64 << 20)
DEFAULT_BUDGET = 16 << 20  # when calibration is off, or for traced graphs
ROUNDS = 2
MIN_CALIBRATED_SCORES = 1 << 22  # smaller problems take the default: not worth timing


# the two-GEMM path holds every score: above this many bytes of them only the fused kernel is considered
SDPA_GEMM_MAX_BYTES = 64 << 20
# The dtypes whose plain attention is a measured choice, and how far the two-GEMM path may stand from the
# fused kernel to be a candidate, relative to the largest output (the probabilities are rounded to bf16
# before the second product). f32 always takes the fused kernel: there the GEMMs won by ~1% at best, and
# their rounding, ~5e-7 a call, compounds over SAM 2.1's frames to 1.75e-5 from transformers' (which runs
# the fused kernel), past the tracking parity tests' 1e-5
SDPA_TOL = {torch.bfloat16: 4 * torch.finfo(torch.bfloat16).eps}


def sdpa_key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str:
    """The calibration table's key for one plain attention problem."""
    b, h, n, d = q.shape
    return f"sdpa {calibration.DTYPE_PREFIX[q.dtype]}{b * h}x{n}x{k.shape[-2]}x{d}x{v.shape[-1]}"


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """``softmax(q k^T * scale) v`` over 4-D ``[B, H, N, d]``: torch's fused kernel, or (bf16, eager CPU
    inference) two GEMMs around a soft-max in place, whichever this machine measured faster for the shape;
    f32, graphs and other cases take the fused kernel."""
    if not (q.dim() == 4 and q.is_cpu and q.dtype in SDPA_TOL and plain_inference(q, k, v)
            and k.dtype == q.dtype and v.dtype == q.dtype and settings.calibrate()):
        return F.scaled_dot_product_attention(q, k, v, scale=scale)
    key = sdpa_key(q, k, v)
    choice = calibration.DECIDED.get(key)
    if choice is None:
        calibration.note(key)
        choice = _sdpa_choice(key, q, k, v, scale)
    if choice == "gemm":
        return _two_gemms(q, k, v, scale)
    return F.scaled_dot_product_attention(q, k, v, scale=scale)


def _two_gemms(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
    b, h, n, d = q.shape
    m, dv = k.shape[-2], v.shape[-1]
    q3, k3, v3 = q.reshape(b * h, n, d), k.reshape(b * h, m, d), v.reshape(b * h, m, dv)
    alpha = scale if scale is not None else d ** -0.5
    s = torch.baddbmm(q.new_zeros(()), q3, k3.transpose(1, 2), beta=0, alpha=alpha)
    torch.ops.aten._softmax.out(s, -1, False, out=s)
    return torch.bmm(s, v3).view(b, h, n, dv)


def race_paths(runs: dict[str, Callable[[], object]], rounds: int = ROUNDS) -> tuple[dict[str, float], float | None]:
    """Time each of ``runs`` (whole calls of one problem), interleaved, the order alternating round by round (no seat
    is favoured): the best seconds of each, and the share of the machine other processes took meanwhile."""
    best = dict.fromkeys(runs, float("inf"))

    def timed() -> None:
        for r in range(2 * rounds):
            for name in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
                t = time.perf_counter()
                runs[name]()
                best[name] = min(best[name], time.perf_counter() - t)

    _, others = others_share(timed)
    return best, others


def _sdpa_choice(key: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> str:
    """The cached choice for ``key``; or measure both paths now, interleaved, and keep the faster."""
    hit = calibration.table().shapes.get(key)
    if hit is not None and hit.get("kernel") in ("fused", "gemm"):
        calibration.DECIDED[key] = hit["kernel"]
        return hit["kernel"]
    count = q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2]
    if count * q.element_size() > SDPA_GEMM_MAX_BYTES or count < MIN_CALIBRATED_SCORES // 16:
        calibration.DECIDED[key] = "fused"  # too large to hold, or too small to be worth timing: not recorded
        return "fused"
    calibration.measuring()
    ref = F.scaled_dot_product_attention(q, k, v, scale=scale).float()
    err = float((_two_gemms(q, k, v, scale).float() - ref).abs().max()) / (float(ref.abs().max()) or 1.0)
    runs = {"fused": lambda: F.scaled_dot_product_attention(q, k, v, scale=scale),
            "gemm": lambda: _two_gemms(q, k, v, scale)}
    if not err <= SDPA_TOL[q.dtype]:
        runs.pop("gemm")
    best, others = race_paths(runs)
    chosen = min(best, key=lambda c: best[c])
    calibration.table().put_entry(key, note_load(
        {"kernel": chosen, "seconds": {c: round(t, 6) for c, t in best.items()}, "error": float(f"{err:.2g}")},
        others))
    calibration.DECIDED[key] = chosen
    return chosen


def budget_key(b: int, n: int, m: int, d: int, dtype: torch.dtype = torch.float32) -> str:
    """The calibration table's key for one attention problem (bf16 problems are measured apart)."""
    return f"attention {calibration.DTYPE_PREFIX.get(dtype, str(dtype) + ' ')}{b}x{n}x{m}x{d}"


def decomposed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rel_h: torch.Tensor,
                         rel_w: torch.Tensor, budget: int | None = None) -> torch.Tensor:
    """``softmax(q k^T / sqrt(d) + rel_h[..., :, None] + rel_w[..., None, :]) v`` over ``[..., N, d]``.

    ``rel_h`` is ``[..., N, Kh]`` and ``rel_w`` ``[..., N, Kw]`` with ``Kh * Kw`` keys (row-major).
    ``budget`` (bytes of scores per slice) defaults to the calibrated choice for this shape.
    """
    lead = q.shape[:-2]
    n, d = q.shape[-2:]
    m, kh, kw = k.shape[-2], rel_h.shape[-1], rel_w.shape[-1]
    q3, k3, v3 = q.reshape(-1, n, d), k.reshape(-1, m, d), v.reshape(-1, m, v.shape[-1])
    rh, rw = rel_h.reshape(-1, n, kh, 1), rel_w.reshape(-1, n, 1, kw)
    out = q.new_empty(q3.shape[0], n, v.shape[-1])
    fast = plain_inference(q, k, v, rel_h, rel_w)  # may reuse a buffer and soft-max in place
    budget = budget if budget is not None else settings.attention_budget()
    if budget is None and fast and q3.shape[0] * n * m >= MIN_CALIBRATED_SCORES and settings.calibrate():
        budget = _calibrated_budget(q3, k3, v3, rh, rw, out)
        if budget is None:  # measured just now: ``out`` holds the result
            return out.reshape(*lead, n, v.shape[-1])
    _attend(q3, k3, v3, rh, rw, out, budget or DEFAULT_BUDGET, fast)
    return out.reshape(*lead, n, v.shape[-1])


def _calibrated_budget(q3: torch.Tensor, k3: torch.Tensor, v3: torch.Tensor, rh: torch.Tensor,
                       rw: torch.Tensor, out: torch.Tensor) -> int | None:
    """The cached slice budget for this shape; or time every candidate now (then None: ``out`` is filled)."""
    b, n, d = q3.shape
    key = budget_key(b, n, k3.shape[1], d, q3.dtype)
    calibration.note(key)
    table = calibration.table()
    hit = table.shapes.get(key)
    if hit is not None:
        return int(hit["kernel"])
    calibration.measuring()
    best = dict.fromkeys(SLICE_CANDIDATES, float("inf"))

    def rounds() -> None:
        for r in range(ROUNDS):
            for budget in (SLICE_CANDIDATES if r % 2 == 0 else SLICE_CANDIDATES[::-1]):
                t = time.perf_counter()
                _attend(q3, k3, v3, rh, rw, out, budget, True)
                best[budget] = min(best[budget], time.perf_counter() - t)

    _, others = others_share(rounds)
    chosen = min(best, key=lambda c: best[c])
    allocator.note_burst()  # the entry running this forward hands the freed scores' pages back when it returns
    table.put_entry(key, note_load(
        {"kernel": str(chosen), "seconds": {f"{c >> 20} MB": round(t, 5) for c, t in best.items()}}, others))
    return None


def _attend(q3: torch.Tensor, k3: torch.Tensor, v3: torch.Tensor, rh: torch.Tensor, rw: torch.Tensor,
            out: torch.Tensor, budget: int, fast: bool) -> None:
    """Every slice of the problem within ``budget`` bytes of scores, written into ``out``."""
    n, m = q3.shape[1], k3.shape[1]
    scale = q3.shape[-1] ** -0.5
    per_head = n * m * q3.element_size()
    if not fast:  # traced, compiled or differentiated: row slices across every batch and head at once, so
        # that no size of the graph depends on the leading axis (a batch torch.export keeps dynamic)
        rows = max(1, budget // (m * q3.element_size()))
        for r0 in range(0, n, rows):
            r = slice(r0, r0 + rows)
            _slice(q3[:, r], k3, v3, rh[:, r], rw[:, r], scale, out[:, r], None)
        return
    if per_head <= budget:  # several whole heads per slice
        step = min(q3.shape[0], max(1, budget // per_head))
        scores = q3.new_empty(step, n, m) if fast else None
        for b0 in range(0, q3.shape[0], step):
            b = slice(b0, b0 + step)
            _slice(q3[b], k3[b], v3[b], rh[b], rw[b], scale, out[b], scores)
    else:  # rows of one head per slice
        rows = max(1, budget // (m * q3.element_size()))
        scores = q3.new_empty(1, rows, m) if fast else None
        for b in range(q3.shape[0]):
            for r0 in range(0, n, rows):
                r = slice(r0, r0 + rows)
                one = slice(b, b + 1)
                _slice(q3[one, r], k3[one], v3[one], rh[one, r], rw[one, r], scale, out[one, r], scores)


def _slice(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rh: torch.Tensor, rw: torch.Tensor, scale: float,
           out: torch.Tensor, buffer: torch.Tensor | None) -> None:
    """One slice ``[b, rows, d]`` of queries against all keys, written into ``out`` ``[b, rows, dv]``."""
    kh, kw = rh.shape[-2], rw.shape[-1]
    if buffer is None:  # traced, compiled or differentiated: out-of-place, the reference's order
        s = torch.matmul(q * scale, k.transpose(-1, -2))
        s = (s.view(*s.shape[:-1], kh, kw) + rh + rw).view(s.shape)
        out.copy_(torch.matmul(torch.softmax(s, dim=-1), v))
        return
    s = buffer[:q.shape[0], :q.shape[1]]
    torch.add(rh, rw, out=s.view(*s.shape[:-1], kh, kw))
    s.baddbmm_(q * scale, k.transpose(-1, -2))
    torch.ops.aten._softmax.out(s, -1, False, out=s)
    torch.bmm(s, v, out=out)
