"""Attention: scaled dot-product attention, multi-head attention on unsplit projections, and multi-head attention
with its four projections (which eager inference may fold into the side with fewer tokens)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ... import kernels
from ...checker.rules import (
    float_dtype,
    like,
    operand,
    same,
    same_dtype,
    show_dims,
)
from ...checker.symbolic import ShapeError, SymTensor, as_poly, current, fmt, op, require_positive
from ...kernels import folded_attention as folded
from ...shapes.poly import ONE, Poly
from ...types.dtypes import bool_
from .linalg import _linear_rule


@op("attention")
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None = None,
              mask: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """Scaled dot-product attention ``softmax(q k^T * scale + bias) v`` over ``[..., N, Dh]``.

    ``bias`` is added to the scores; ``mask`` (bool) keeps the positions where it is True.
    Without a bias, torch's fused kernel (which never materialises the scores) or two GEMMs, whichever
    this machine measured faster for the shape and dtype (:func:`kestrel.kernels.sdpa`).
    """
    if mask is not None:
        bias = (bias if bias is not None else 0) + torch.zeros_like(mask, dtype=q.dtype).masked_fill(
            ~mask, float("-inf"))
    if q.dim() > 4:  # exporters (ONNX) take 4-D attention: fold the leading axes into one batch
        lead = q.shape[:-3]
        if bias is not None:
            bias = bias.reshape((1,) * (q.dim() - bias.dim()) + tuple(bias.shape))
            bias = bias.expand(*lead, *bias.shape[-3:]).reshape(-1, *bias.shape[-3:])
        out = F.scaled_dot_product_attention(q.reshape(-1, *q.shape[-3:]), k.reshape(-1, *k.shape[-3:]),
                                             v.reshape(-1, *v.shape[-3:]), attn_mask=bias, scale=scale)
        return out.reshape(*lead, *out.shape[-3:])
    if bias is None and q.dim() == 4:
        return kernels.sdpa(q, k, v, scale)  # fused, or two GEMMs where this machine measured them faster
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)


def qkv_dims(name: str, q: SymTensor, k: SymTensor, v: SymTensor,
             *more: SymTensor) -> tuple[list[Poly], list[Poly], list[Poly]]:
    """What every attention rule checks of ``[..., Nq, d]`` queries, ``[..., Nk, d]`` keys and ``[..., Nk,
    dv]`` values (and ``more`` operands of the same rank): one rank >= 2, one width for queries and keys,
    one length for keys and values, the same batch axes for queries and keys."""
    dq, dk, dv = (t.fixed_dims(name) for t in (q, k, v))
    if not (all(len(t.fixed_dims(name)) == len(dq) for t in (k, v, *more)) and len(dq) >= 2):
        shown = ", ".join(t.show() for t in (q, k, v, *more))
        raise ShapeError(f"{name} needs q, k, v{', ...' if more else ''} of one rank >= 2, got {shown}")
    same(dq[-1], dk[-1], f"{name}: query and key widths differ", q, k)
    same(dk[-2], dv[-2], f"{name}: key and value lengths differ", k, v)
    for a, b in zip(dq[:-2], dk[:-2]):
        same(a, b, f"{name}: batch axes of query and key differ", q, k)
    for a, b in zip(dk[:-2], dv[:-2]):
        same(a, b, f"{name}: batch axes of key and value differ", k, v)
    return dq, dk, dv


@attention.rule
def _(q: SymTensor, k: SymTensor, v: SymTensor, bias: SymTensor | None = None, mask: SymTensor | None = None,
      scale: float | None = None) -> SymTensor:
    dq, dk, dv = qkv_dims("attention", q, k, v)
    same_dtype(q, k, "attention")
    same_dtype(k, v, "attention")
    float_dtype(q, "attention")
    if bias is not None:
        same_dtype(q, bias, "attention bias")
    if mask is not None and mask.dtype != bool_:
        raise ShapeError(f"attention: the mask must be a bool tensor, got {mask.show()}")
    scores = [*dq[:-1], dk[-2]]
    facts = current().facts
    for extra, name in ((bias, "bias"), (mask, "mask")):
        if extra is None:
            continue
        de = extra.fixed_dims(f"attention's {name}")
        if len(de) > len(scores):
            raise ShapeError(f"attention: the {name} {extra.show()} has more axes than the scores "
                             f"[{show_dims(scores)}]")
        for s, e in zip(scores[len(scores) - len(de):], de):  # it must broadcast to the scores, never widen them
            if not (e == ONE or facts.equal(s, e)):
                raise ShapeError(f"attention: the {name} {extra.show()} does not broadcast to the scores "
                                 f"[{show_dims(scores)}]: {fmt(e)} against {fmt(s)}", hint=f"{fmt(e)} == {fmt(s)}")
    return like(q, [*dq[:-1], dv[-1]])


# a multi-head attention whose keys across all heads number at most this many runs as per-head GEMMs with
# the scores laid out keys-major (see multihead_attention)
FEW_KEY_COLUMNS = 128


@op("multihead_attention")
def multihead_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int,
                        key_bias: torch.Tensor | None = None) -> torch.Tensor:
    """Multi-head attention on unsplit projections: ``[..., Nq, E]``, ``[..., Nk, E]``, ``[..., Nk, Ev]``
    in, ``[..., Nq, Ev]`` out; head ``h`` is columns ``h * E / heads`` on (``softmax(q_h k_h^T /
    sqrt(E / heads) + key_bias) v_h``), the heads side by side as an output projection reads them.
    ``key_bias`` (``[..., 1, Nk]``, optional) is added to each key's score for every query and head (SAM 2's
    padding tokens take -1e9).

    With few keys (SAM's 4096 image tokens attending to 7 prompt tokens) the fused kernel spends its
    time on overhead per query block; in eager inference such a problem (``heads * Nk <=
    FEW_KEY_COLUMNS``) runs as two batched GEMMs per head whose scores are laid out ``[heads, Nk, Nq]``,
    so that the soft-max over the keys runs across rows of contiguous queries and the second GEMM writes
    the heads side by side in place (SAM's decoder at batch 1: 1.37 -> 0.60 ms a call, the same numbers).
    Elsewhere, and in graphs, it is ``scaled_dot_product_attention`` on head views.
    """
    *lead, nq, _ = q.shape
    nk, ev = k.shape[-2], v.shape[-1]
    _check_key_bias("multihead_attention", q, k, key_bias)
    extra = () if key_bias is None else (key_bias,)
    if kernels.plain_inference(q, k, v, *extra) and heads * nk <= FEW_KEY_COLUMNS and q.dtype.is_floating_point:
        return _few_keys_attention(q, k, v, heads, key_bias)

    def split(t: torch.Tensor) -> torch.Tensor:  # [batch, heads, N, width / heads], the batch axes folded in one
        n, width = t.shape[-2:]
        return t.reshape(-1, n, heads, width // heads).transpose(1, 2)

    if key_bias is None:
        y = kernels.sdpa(split(q), split(k), split(v))  # 4-D: the fused kernel's layout
    else:
        mask = key_bias.reshape(-1, 1, 1, nk)  # the same for every head and query
        y = F.scaled_dot_product_attention(split(q), split(k), split(v), attn_mask=mask)
    return y.transpose(1, 2).reshape(*lead, nq, ev)


def _check_key_bias(name: str, q: torch.Tensor, k: torch.Tensor, key_bias: torch.Tensor | None) -> None:
    """A key bias must be ``[..., 1, Nk]`` with the queries' batch axes: eager paths reshape it, and would not fail."""
    want = (*q.shape[:-2], 1, k.shape[-2])
    if key_bias is not None and tuple(key_bias.shape) != want:
        raise ValueError(f"{name}: the key bias has shape {tuple(key_bias.shape)}, expected {want} (the queries' "
                         "batch axes, 1, the number of keys)")


def _few_keys_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int,
                        key_bias: torch.Tensor | None) -> torch.Tensor:
    # Laid out [heads, Nq, Nk], the soft-max would run along rows of a handful of keys, which torch does
    # element by element (7 keys: 2.1 ms for SAM's 8 x 4096 rows); across an outer axis of [heads, Nk, Nq]
    # it runs on whole vectors of queries (0.10 ms). Block-diagonal GEMMs over all heads at once, the way
    # before, did eight times the work and left the keys on a strided axis (1.37 against 0.60 ms a call).
    *lead, nq, e = q.shape
    nk, ev = k.shape[-2], v.shape[-1]
    dh, dv = e // heads, ev // heads
    q3, k3, v3 = q.reshape(-1, nq, e), k.reshape(-1, nk, e), v.reshape(-1, nk, ev)
    bias = None if key_bias is None else key_bias.reshape(-1, nk, 1)
    out = q.new_empty(q3.shape[0], nq, heads, dv)
    for b in range(q3.shape[0]):
        keys = (k3[b] * dh ** -0.5).unflatten(-1, (heads, dh)).transpose(0, 1)  # [heads, Nk, dh], scaled
        scores = torch.bmm(keys, q3[b].unflatten(-1, (heads, dh)).permute(1, 2, 0))  # [heads, Nk, Nq]
        if bias is not None:
            scores.add_(bias[b])  # each key's bias, for every head and query
        torch.ops.aten._softmax.out(scores, 1, False, out=scores)
        values = v3[b].unflatten(-1, (heads, dv)).transpose(0, 1)  # [heads, Nk, dv]
        torch.bmm(scores.transpose(1, 2), values, out=out[b].transpose(0, 1))  # into [Nq, heads, dv]
    return out.view(*lead, nq, ev)


@multihead_attention.rule
def _multihead_attention_rule(q: SymTensor, k: SymTensor, v: SymTensor, heads: Any,
                              key_bias: SymTensor | None = None) -> SymTensor:
    dq, dk, dv = qkv_dims("multihead_attention", q, k, v)
    if key_bias is not None:  # [..., 1, Nk]: q's batch axes exactly, one row, one number per key
        db = key_bias.fixed_dims("multihead_attention's key bias")
        want = [*dq[:-2], ONE, dk[-2]]
        if len(db) != len(want) or not all(current().facts.equal(a, b) for a, b in zip(db, want)):
            raise ShapeError(f"multihead_attention: the key bias {key_bias.show()} is not [{show_dims(want)}] "
                             "(the queries' batch axes, 1, the number of keys)")
        same_dtype(q, key_bias, "multihead_attention key bias")
    h = as_poly(heads)
    require_positive(h)
    facts = current().facts
    for t, width in ((q, dq[-1]), (v, dv[-1])):
        if not facts.divides(h, width):
            raise ShapeError(f"multihead_attention: cannot prove {fmt(h)} heads divide the width {fmt(width)} of "
                             f"{t.show()}", hint=f"{operand(width)} % {operand(h)} == 0")
    same_dtype(q, k, "multihead_attention")
    same_dtype(k, v, "multihead_attention")
    float_dtype(q, "multihead_attention")
    return like(q, [*dq[:-1], dv[-1]])


# a projection's weight [Out, In] and bias [Out] (or None)
Projection = Sequence[Any]


@op("projected_attention")
def projected_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, heads: int,
                        projections: Sequence[Projection], key_bias: torch.Tensor | None = None) -> torch.Tensor:
    """Multi-head attention with its projections: ``projections`` is ``[(w_q, b_q), (w_k, b_k), (w_v, b_v),
    (w_o, b_o)]``, and the result is ``linear(multihead_attention(linear(query, w_q, b_q), linear(key, w_k, b_k),
    linear(value, w_v, b_v), heads, key_bias), w_o, b_o)``.

    Where one side has few tokens (SAM's decoder: 7 prompt tokens against 4096 image tokens), eager f32 inference
    may instead fold the projections into that side, so that no GEMM projects every token of the long side
    (:mod:`kestrel.kernels.folded_attention`: the same numbers to rounding, measured per problem against the
    projected path, the faster kept). Graphs and everything else run the composition as written.
    """
    if len(projections) != 4:
        raise ValueError(f"projected_attention: expected 4 projections (query, key, value, output), got "
                         f"{len(projections)}")
    pairs = [(w, b) for w, b in projections]
    _check_key_bias("projected_attention", query, key, key_bias)

    def projected() -> torch.Tensor:
        (wq, bq), (wk, bk), (wv, bv), (wo, bo) = pairs
        y = multihead_attention(kernels.linear(query, wq, bq), kernels.linear(key, wk, bk),
                                kernels.linear(value, wv, bv), heads, key_bias)
        return kernels.linear(y, wo, bo)

    if not folded.applies(query, key, value, heads, pairs, key_bias):
        return projected()
    name = folded.folded_key(query, key, value, heads, pairs, key_bias is not None)
    choice = folded.choose(name, lambda: folded.folded_attention(query, key, value, heads, pairs, key_bias),
                           projected, lambda: folded.projected_reference(query, key, value, heads, pairs, key_bias))
    if choice == "folded":
        return folded.folded_attention(query, key, value, heads, pairs, key_bias)
    return projected()


@projected_attention.rule
def _(query: SymTensor, key: SymTensor, value: SymTensor, heads: Any, projections: Sequence[Any],
      key_bias: SymTensor | None = None) -> SymTensor:
    if len(projections) != 4 or not all(len(p) == 2 for p in projections):
        raise ShapeError("projected_attention: expected four (weight, bias) projections: query, key, value, output")
    (wq, bq), (wk, bk), (wv, bv), (wo, bo) = projections
    q = _projection_rule("query", query, wq, bq)
    k, v = _projection_rule("key", key, wk, bk), _projection_rule("value", value, wv, bv)
    attended = _multihead_attention_rule(q, k, v, heads, key_bias)
    return _projection_rule("output", attended, wo, bo)


def _projection_rule(which: str, x: SymTensor, weight: SymTensor, bias: SymTensor | None) -> SymTensor:
    """``linear``'s rule for one of projected_attention's projections, its error saying which."""
    try:
        return _linear_rule(x, weight, bias)
    except ShapeError as e:
        raise ShapeError(f"projected_attention's {which} projection: {e.message}", e.hint) from None
