"""Linear algebra: linear (one or several fused projections, or followed by its GELU) and the matrix product."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ... import kernels
from ...checker.rules import (
    broadcast_dims,
    float_dtype,
    last_dim,
    like,
    same,
    same_dtype,
)
from ...checker.symbolic import ShapeError, SymTensor, op
from .elementwise import _gelu_rule


@op("linear")
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` over the last axis: ``[*S, In] -> [*S, Out]``.

    Kernel: for eager f32 or bf16 inference on CPU, the GEMM path measured fastest for this shape and
    dtype on this machine (:mod:`kestrel.kernels.gemm`: torch's default, oneDNN on plain or reordered
    weights, MKL's packed GEMM; in f32 all within ~1e-6 relative of each other); ``F.linear`` in
    compiled, exported and autograd graphs.
    """
    return kernels.linear(x, weight, bias)


@linear.rule
def _linear_rule(x: SymTensor, weight: SymTensor, bias: SymTensor | None = None) -> SymTensor:
    w = weight.fixed_dims("linear's weight")
    if len(w) != 2:
        raise ShapeError(f"linear: weight must be [Out, In], got {weight.show()}")
    same(last_dim(x, "linear"), w[1], "linear: the contraction dimension differs", x, weight)
    same_dtype(x, weight, "linear")
    float_dtype(x, "linear")
    if bias is not None:
        b = bias.fixed_dims("linear's bias")
        if len(b) != 1:
            raise ShapeError(f"linear: bias must be [Out], got {bias.show()}")
        same(b[0], w[0], "linear: bias length differs from the output features", bias, weight)
        same_dtype(bias, weight, "linear bias")
    return like(x, [*x.dims[:-1], w[0]])


@op("linear_gelu")
def linear_gelu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                approximate: str = "none") -> torch.Tensor:
    """``gelu(linear(x, weight, bias), approximate)``: an MLP's first projection and its activation.

    Kernel: as ``linear``; where that kernel is oneDNN's and the GELU the tanh approximation, the GELU is
    applied to each output tile inside the GEMM (:func:`kestrel.kernels.gemm.linear_gelu`), else the GELU
    runs in place on the fresh output. ``F.gelu(F.linear(...))`` in compiled, exported and autograd graphs.
    """
    return kernels.linear_gelu(x, weight, bias, approximate)


_linear_gelu_activation = _gelu_rule("linear_gelu")


@linear_gelu.rule
def _(x: SymTensor, weight: SymTensor, bias: SymTensor | None = None, approximate: str = "none") -> SymTensor:
    return _linear_gelu_activation(_linear_rule(x, weight, bias), approximate)  # GELU's own rule on the output


@op("fused_linear")
def fused_linear(x: torch.Tensor, weights: Sequence[torch.Tensor],
                 biases: Sequence[torch.Tensor | None]) -> tuple[torch.Tensor, ...]:
    """Several projections of one input, ``(linear(x, w0, b0), linear(x, w1, b1), ...)``, as one GEMM.

    Kernel: the weights (and biases) are concatenated once, at the first eager call, into one
    buffer of which the parameters become views (same objects, names and numbers; no extra
    memory); each call is then one ``linear`` and a split. Compiled graphs see ``cat`` + ``linear``.
    """
    return kernels.fused_linear(x, weights, biases)


@fused_linear.rule
def _(x: SymTensor, weights: Sequence[SymTensor], biases: Sequence[SymTensor | None]) -> tuple[SymTensor, ...]:
    if len(weights) != len(biases) or not weights:
        raise ShapeError(f"fused_linear: {len(weights)} weight(s) but {len(biases)} bias(es)")
    return tuple(_linear_rule(x, w, b) for w, b in zip(weights, biases))


@op("matmul")
def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Matrix product with batch broadcasting: ``[..., M, K] @ [..., K, N] -> [..., M, N]``."""
    return torch.matmul(a, b)


@matmul.rule
def _(a: SymTensor, b: SymTensor) -> SymTensor:
    same_dtype(a, b, "matmul")
    float_dtype(a, "matmul")
    da, db = a.fixed_dims("matmul"), b.fixed_dims("matmul")
    if len(da) < 1 or len(db) < 1:
        raise ShapeError(f"matmul of a scalar: {a.show()} @ {b.show()}")
    if len(db) == 1:
        same(da[-1], db[0], "matmul: the contraction dimension differs", a, b)
        return like(a, da[:-1])
    if len(da) == 1:
        same(da[0], db[-2], "matmul: the contraction dimension differs", a, b)
        return like(a, [*db[:-2], db[-1]])
    same(da[-1], db[-2], "matmul: the contraction dimension differs", a, b)
    batch = broadcast_dims(da[:-2], db[:-2], "matmul batch", a.show(), b.show())
    return like(a, [*batch, da[-2], db[-1]])


bmm = matmul
