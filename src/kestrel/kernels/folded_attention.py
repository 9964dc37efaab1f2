"""Multi-head attention with its projections folded into the short side, where one side has few tokens.

SAM's mask decoder (and SAM 2.1's) attends between 4096 image tokens and about seven prompt tokens, five times
a decode. Projected the usual way, each of those attentions runs two GEMMs over all 4096 image tokens (a
256 -> 128 projection each: keys and values, or queries and the output), and the attention itself is small.
Associativity moves that work to the few tokens' side. Per head ``h`` (widths: ``D`` in, ``dh`` per head):

  few queries   ``softmax(q_h (X W_k,h^T + b_k,h)^T) (Y W_v,h^T + b_v,h)``
                ``= softmax((q_h W_k,h) X^T) (Y W_v,h^T) + b_v,h``: the key bias adds one constant to a query's
                every score, which the soft-max cancels, and the weights of a soft-max sum to one, so the value
                bias passes through. Scores and weighted sum are two GEMMs of ``heads x Nq`` rows against the
                raw ``[Nk, D]`` tokens; the value projection then runs on ``heads x Nq`` rows.
  few keys      ``softmax((X W_q,h^T + b_q,h) k_h^T) v_h W_o,h^T``
                ``= softmax(X (k_h W_q,h)^T + b_q,h k_h^T) (v_h W_o,h^T)``: the query projection folds into the
                keys and the output projection into the values, so both large GEMMs have ``heads x Nk`` on
                their short side.

That is ``2 heads N D`` operations per large GEMM where the projections cost ``2 N D width``: fewer whenever
``heads x tokens`` on the short side is well under the projected width. The numbers are the same to rounding
(relative differences ~4e-7 in f32, as the projected path's own against float64). Which path runs is measured
per problem on the machine at hand, as plain attention's kernels are (:mod:`kestrel.kernels.attention`), and
kept in the calibration table; compiled, exported and autograd graphs always project (the ``std`` op's
composition), and so does any problem where folding would not save work.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from . import calibration, settings
from .attention import race_paths
from .contention import note_load
from .gemm import MIN_CALIBRATED_FLOPS, int8_marked
from .library import plain_inference

# a projection: its weight [Out, In] and bias [Out] or None
Projection = tuple[torch.Tensor, torch.Tensor | None]

# The fold is raced only where it does at most this share of the projected path's multiply-adds: the large GEMMs
# of the folded path have a short side of heads x tokens, and short GEMMs run below the library's best rate
# (SAM's decoder on an AMD EPYC: 56 rows 1.6-2.9x faster than projecting; at 20 prompt tokens, 160 rows, work
# 1.16x the projected path's and slower)
MAX_WORK = 0.75
# the fold must match the projected path computed by torch to this relative error (max |diff| / max |ref|)
TOL = 1e-5
ROUNDS = 3


def work(nq: int, nk: int, dq: int, dk: int, dv: int, width: int, vwidth: int, dout: int,
         heads: int) -> tuple[float, float]:
    """Multiply-adds of one problem (per batch item): projected, and folded into the short side."""
    projected = nq * dq * width + nk * dk * width + nk * dv * vwidth + nq * nk * (width + vwidth) + nq * vwidth * dout
    if nq <= nk:
        folded = nq * dq * width + heads * nq * (width // heads * dk + nk * (dk + dv) + dv * vwidth // heads) \
            + nq * vwidth * dout
    else:
        folded = nk * dk * width + heads * nk * (width // heads * dq + nq * (dq + dout) + vwidth // heads * dout) \
            + nk * dv * vwidth
    return float(projected), float(folded)


def folded_key(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, heads: int,
               projections: Sequence[Projection], key_bias: bool) -> str:
    """The calibration table's key for one problem: batch, token counts, widths, heads, and whether the projected
    path it races runs int8 (a different competitor)."""
    wq, wv, wo = projections[0][0], projections[2][0], projections[3][0]
    b = query.numel() // (query.shape[-2] * query.shape[-1])
    dims = (b, query.shape[-2], key.shape[-2], query.shape[-1], key.shape[-1], value.shape[-1], wq.shape[0],
            wv.shape[0], wo.shape[0], heads)
    int8 = any(int8_marked(w) for w, _ in projections)
    tail = ("+kb" if key_bias else "") + (" int8" if int8 else "")
    return f"folded {calibration.DTYPE_PREFIX[query.dtype]}" + "x".join(map(str, dims)) + tail


def applies(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, heads: int,
            projections: Sequence[Projection], key_bias: torch.Tensor | None) -> bool:
    """Eager f32 inference on CPU where folding does at most MAX_WORK of the projected path's work, in a problem
    large enough to time (``gemm.MIN_CALIBRATED_FLOPS``). ``KESTREL_FOLD=0``: never; ``always``: wherever the fold
    can run, whatever its work."""
    mode = settings.fold_attention()
    if mode == "0":
        return False
    tensors = [query, key, value, *(t for p in projections for t in p if t is not None)]
    if key_bias is not None:
        tensors.append(key_bias)
    if not (plain_inference(*tensors) and all(t.dtype == torch.float32 and t.is_cpu for t in tensors)):
        return False
    (wq, _), _, (wv, _), (wo, _) = projections
    if not (query.numel() and key.numel() and value.numel() and wq.numel() and wv.numel() and wo.numel()):
        return False  # nothing to fold (and nothing to time)
    if wq.shape[0] % heads or wv.shape[0] % heads:
        return False
    if mode == "always":
        return True
    projected, folded = work(query.shape[-2], key.shape[-2], query.shape[-1], key.shape[-1], value.shape[-1],
                             wq.shape[0], wv.shape[0], wo.shape[0], heads)
    batch = query.numel() // (query.shape[-2] * query.shape[-1])
    # a problem too small to be worth timing projects, as a GEMM that small takes torch's default
    return folded <= MAX_WORK * projected and 2 * batch * projected >= MIN_CALIBRATED_FLOPS


def choose(name: str, folded: Callable[[], torch.Tensor], projected: Callable[[], torch.Tensor],
           reference: Callable[[], torch.Tensor]) -> str:
    """``"folded"`` or ``"projected"`` for the problem keyed ``name``: remembered, read from the table, or
    measured now (both paths interleaved, the fold checked against ``reference``). Calibration off: projected.
    ``KESTREL_FOLD=always``: folded, nothing measured or recorded."""
    if settings.fold_attention() == "always":
        return "folded"
    choice = calibration.DECIDED.get(name)
    if choice is not None:
        return choice
    calibration.note(name)
    hit = calibration.table().shapes.get(name)
    if hit is not None and hit.get("kernel") in ("folded", "projected"):
        choice = hit["kernel"]
    elif not settings.calibrate():
        return "projected"  # not remembered: a setting changed later applies
    else:
        choice = _measure(name, folded, projected, reference)
    calibration.DECIDED[name] = choice
    return choice


def _measure(name: str, folded: Callable[[], torch.Tensor], projected: Callable[[], torch.Tensor],
             reference: Callable[[], torch.Tensor]) -> str:
    calibration.measuring()
    projected()  # its GEMM shapes calibrate now, untimed
    ref = reference().float()
    err = float((folded().float() - ref).abs().max()) / (float(ref.abs().max()) or 1.0)
    runs = {"projected": projected, "folded": folded}
    if not err <= TOL:
        runs.pop("folded")
    best, others = race_paths(runs, ROUNDS)
    chosen = min(best, key=lambda c: best[c])
    entry = {"kernel": chosen, "seconds": {c: round(t, 6) for c, t in best.items()}, "error": float(f"{err:.2g}")}
    calibration.table().put_entry(name, note_load(entry, others))
    return chosen


def projected_reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, heads: int,
                        projections: Sequence[Projection], key_bias: torch.Tensor | None) -> torch.Tensor:
    """The projected path in torch's own functions: what the fold is checked against."""
    (wq, bq), (wk, bk), (wv, bv), (wo, bo) = projections
    q, k, v = F.linear(query, wq, bq), F.linear(key, wk, bk), F.linear(value, wv, bv)
    *lead, nq, _ = q.shape
    nk = k.shape[-2]

    def split(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(-1, t.shape[-2], heads, t.shape[-1] // heads).transpose(1, 2)

    mask = None if key_bias is None else key_bias.reshape(-1, 1, 1, nk)
    y = F.scaled_dot_product_attention(split(q), split(k), split(v), attn_mask=mask)
    return F.linear(y.transpose(1, 2).reshape(*lead, nq, v.shape[-1]), wo, bo)


def folded_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, heads: int,
                     projections: Sequence[Projection], key_bias: torch.Tensor | None = None) -> torch.Tensor:
    """``out_proj(attention(q_proj(query), k_proj(key), v_proj(value)))`` over ``heads`` heads, with the
    projections folded into the side with fewer tokens (see the module's notes). ``key_bias`` ``[..., 1, Nk]``
    is added to each key's score."""
    *lead, nq, dq = query.shape
    nk, dk = key.shape[-2:]
    q3, k3 = query.reshape(-1, nq, dq), key.reshape(-1, nk, dk)
    v3 = value.reshape(-1, nk, value.shape[-1])
    bias = None if key_bias is None else key_bias.reshape(-1, 1, nk)
    fold = _few_queries if nq <= nk else _few_keys
    return fold(q3, k3, v3, heads, projections, bias).view(*lead, nq, projections[3][0].shape[0])


def _few_queries(q3: torch.Tensor, k3: torch.Tensor, v3: torch.Tensor, heads: int,
                 projections: Sequence[Projection], bias: torch.Tensor | None) -> torch.Tensor:
    (wq, bq), (wk, _), (wv, bv), (wo, bo) = projections  # the key bias cancels in the soft-max
    b, nq, _ = q3.shape
    dk, dv_in = k3.shape[-1], v3.shape[-1]
    dh, dv = wq.shape[0] // heads, wv.shape[0] // heads
    qh = F.linear(q3, wq, bq).view(b, nq, heads, dh).transpose(1, 2) * dh ** -0.5  # [b, H, Nq, dh], scaled
    qk = torch.matmul(qh, wk.reshape(heads, dh, dk)).reshape(b, heads * nq, dk)  # each query in key-token space
    scores = torch.bmm(qk, k3.transpose(1, 2))  # [b, H * Nq, Nk]
    if bias is not None:
        scores.add_(bias)
    torch.ops.aten._softmax.out(scores, 2, False, out=scores)
    mixed = torch.bmm(scores, v3).view(b, heads, nq, dv_in)  # the value tokens, weighted per head and query
    heads_out = torch.matmul(mixed, wv.reshape(heads, dv, dv_in).transpose(1, 2))  # [b, H, Nq, dv]
    if bv is not None:
        heads_out.add_(bv.reshape(heads, 1, dv))
    return F.linear(heads_out.transpose(1, 2).reshape(b, nq, heads * dv), wo, bo)


def _few_keys(q3: torch.Tensor, k3: torch.Tensor, v3: torch.Tensor, heads: int,
              projections: Sequence[Projection], bias: torch.Tensor | None) -> torch.Tensor:
    (wq, bq), (wk, bk), (wv, bv), (wo, bo) = projections
    b, nq, dq = q3.shape
    nk = k3.shape[1]
    dh, dv, dout = wq.shape[0] // heads, wv.shape[0] // heads, wo.shape[0]
    kh = F.linear(k3, wk, bk).view(b, nk, heads, dh).transpose(1, 2) * dh ** -0.5  # [b, H, Nk, dh], scaled
    keys = torch.matmul(kh, wq.reshape(heads, dh, dq)).reshape(b, heads * nk, dq)  # each key in query-token space
    # laid out [b, H, Nk, Nq]: the soft-max over a handful of keys runs across rows of contiguous queries
    scores = torch.bmm(keys, q3.transpose(1, 2))
    per_key = scores.view(b, heads, nk, nq)
    if bq is not None:
        per_key.add_(torch.matmul(kh, bq.reshape(heads, dh, 1)))  # the query bias against each key, [b, H, Nk, 1]
    if bias is not None:
        per_key.add_(bias.view(b, 1, nk, 1))
    torch.ops.aten._softmax.out(per_key, 2, False, out=per_key)
    vh = F.linear(v3, wv, bv).view(b, nk, heads, dv).transpose(1, 2)  # [b, H, Nk, dv]
    values = torch.matmul(vh, wo.reshape(dout, heads, dv).permute(1, 2, 0)).reshape(b, heads * nk, dout)
    out = torch.bmm(scores.transpose(1, 2), values)  # [b, Nq, Dout]
    if bo is not None:
        out.add_(bo)
    return out
