"""Attention with decomposed relative positions, without materialising every score at once.

SAM's image encoder (after MViTv2) adds to the score of query ``n`` against key ``(i, j)`` of a
``Kh x Kw`` grid two small terms, ``rel_h[n, i] + rel_w[n, j]``. Building that bias for every head of
a global layer at 1024 px is ``Heads x 4096 x 4096`` floats (about 800 MB for ViT-B); this kernel
instead takes the two terms as they are and works through the scores in slices that fit a budget:
whole heads at a time when they are small (the windowed layers), else chunks of query rows of one
head. Per slice: ``q k^T * scale``, the two terms added in place, softmax, times ``v``: the same
arithmetic as the reference, in the same order, so the same numbers.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ..checker.symbolic import ShapeError, SymTensor, op
from .ops import _t, same, same_dtype

# bytes of scores one slice may hold; KESTREL_ATTENTION_BUDGET overrides (a memory choice, not speed)
BUDGET = int(os.environ.get("KESTREL_ATTENTION_BUDGET", 64 << 20))


@op("decomposed_attention")
def decomposed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rel_h: torch.Tensor,
                         rel_w: torch.Tensor, budget: int | None = None) -> torch.Tensor:
    """``softmax(q k^T / sqrt(d) + rel_h[..., :, None] + rel_w[..., None, :]) v`` over ``[..., N, d]``.

    ``rel_h`` is ``[..., N, Kh]`` and ``rel_w`` ``[..., N, Kw]`` with ``Kh * Kw`` keys (row-major).
    """
    budget = BUDGET if budget is None else budget
    lead = q.shape[:-2]
    n, d = q.shape[-2:]
    m, kh, kw = k.shape[-2], rel_h.shape[-1], rel_w.shape[-1]
    q3, k3, v3 = q.reshape(-1, n, d), k.reshape(-1, m, d), v.reshape(-1, m, v.shape[-1])
    rh, rw = rel_h.reshape(-1, n, kh, 1), rel_w.reshape(-1, n, 1, kw)
    out = q.new_empty(q3.shape[0], n, v.shape[-1])
    scale = d ** -0.5
    per_head = n * m * q.element_size()
    if per_head <= budget:  # several whole heads per slice
        step = max(1, budget // per_head)
        for b0 in range(0, q3.shape[0], step):
            b = slice(b0, b0 + step)
            _slice(q3[b], k3[b], v3[b], rh[b], rw[b], scale, out[b])
    else:  # rows of one head per slice
        rows = max(1, budget // (m * q.element_size()))
        for b in range(q3.shape[0]):
            for r0 in range(0, n, rows):
                r = slice(r0, r0 + rows)
                _slice(q3[b, r], k3[b], v3[b], rh[b, r], rw[b, r], scale, out[b, r])
    return out.reshape(*lead, n, v.shape[-1])


def _slice(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rh: torch.Tensor, rw: torch.Tensor, scale: float,
           out: torch.Tensor) -> None:
    s = torch.matmul(q * scale, k.transpose(-1, -2))
    s.view(*s.shape[:-1], rh.shape[-2], rw.shape[-1]).add_(rh).add_(rw)
    torch.matmul(torch.softmax(s, dim=-1), v, out=out)


@decomposed_attention.rule
def _(q: SymTensor, k: SymTensor, v: SymTensor, rel_h: SymTensor, rel_w: SymTensor,
      budget: Any = None) -> SymTensor:
    dq, dk, dv = (t.fixed_dims("decomposed_attention") for t in (q, k, v))
    dh, dw = rel_h.fixed_dims("decomposed_attention"), rel_w.fixed_dims("decomposed_attention")
    if not (len(dq) == len(dk) == len(dv) == len(dh) == len(dw) and len(dq) >= 2):
        raise ShapeError(f"decomposed_attention needs q, k, v, rel_h, rel_w of one rank >= 2, got {q.show()}, "
                         f"{k.show()}, {v.show()}, {rel_h.show()}, {rel_w.show()}")
    same(dq[-1], dk[-1], "decomposed_attention: query and key head widths differ", q, k)
    same(dk[-2], dv[-2], "decomposed_attention: key and value lengths differ", k, v)
    for a, b in zip(dq[:-2], dk[:-2]):
        same(a, b, "decomposed_attention: batch axes of query and key differ", q, k)
    for t, ds in ((rel_h, dh), (rel_w, dw)):
        for a, b in zip(dq[:-1], ds[:-1]):
            same(a, b, "decomposed_attention: a relative term's batch or query axes differ from the query's", q, t)
    same(dh[-1] * dw[-1], dk[-2], "decomposed_attention: the key grid Kh * Kw is not the key length", rel_h, k)
    for t in (k, v, rel_h, rel_w):
        same_dtype(q, t, "decomposed_attention")
    return _t(q, [*dq[:-1], dv[-1]])
