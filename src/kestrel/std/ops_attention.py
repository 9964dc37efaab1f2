"""Attention with decomposed relative positions, without materialising every score at once.

The kernel is :func:`kestrel.kernels.attention.decomposed_attention`; this module gives it its op and shape rule.
"""

from __future__ import annotations

from typing import Any

import torch

from ..checker.symbolic import SymTensor, op
from ..kernels import attention
from .ops import _t, qkv_dims, same, same_dtype


@op("decomposed_attention")
def decomposed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rel_h: torch.Tensor,
                         rel_w: torch.Tensor, budget: int | None = None) -> torch.Tensor:
    """``softmax(q k^T / sqrt(d) + rel_h[..., :, None] + rel_w[..., None, :]) v`` over ``[..., N, d]``.

    ``rel_h`` is ``[..., N, Kh]`` and ``rel_w`` ``[..., N, Kw]`` with ``Kh * Kw`` keys (row-major).
    ``budget`` (bytes of scores per slice) defaults to the calibrated choice for this shape.
    """
    return attention.decomposed_attention(q, k, v, rel_h, rel_w, budget)


@decomposed_attention.rule
def _(q: SymTensor, k: SymTensor, v: SymTensor, rel_h: SymTensor, rel_w: SymTensor,
      budget: Any = None) -> SymTensor:
    dq, dk, dv = qkv_dims("decomposed_attention", q, k, v, rel_h, rel_w)
    dh, dw = rel_h.fixed_dims("decomposed_attention"), rel_w.fixed_dims("decomposed_attention")
    for t, ds in ((rel_h, dh), (rel_w, dw)):
        for a, b in zip(dq[:-1], ds[:-1]):
            same(a, b, "decomposed_attention: a relative term's batch or query axes differ from the query's", q, t)
    same(dh[-1] * dw[-1], dk[-2], "decomposed_attention: the key grid Kh * Kw is not the key length", rel_h, k)
    for t in (k, v, rel_h, rel_w):
        same_dtype(q, t, "decomposed_attention")
    return _t(q, [*dq[:-1], dv[-1]])
