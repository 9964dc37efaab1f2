"""Normalisations over an axis: layer norm (last axis or channels), RMS norm, L2, softmax."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ... import kernels
from ...checker.rules import (
    axis,
    float_dtype,
    last_dim,
    like,
    same,
    same_dtype,
)
from ...checker.symbolic import ShapeError, SymTensor, op


@op("layer_norm", layout="preserve")
def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
               eps: float = 1e-5) -> torch.Tensor:
    """Layer norm over the last axis."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


@layer_norm.rule
def _(x: SymTensor, weight: SymTensor | None, bias: SymTensor | None, eps: float = 1e-5) -> SymTensor:
    d = last_dim(x, "layer_norm")
    for p in (weight, bias):
        if p is not None:
            if len(p.fixed_dims("layer_norm's parameters")) != 1:
                raise ShapeError(f"layer_norm: a weight or bias must be [D] for the last axis D, got {p.show()} "
                                 f"with {x.show()}")
            same(p.fixed_dims()[0], d, "layer_norm: parameter length differs from the last axis", p, x)
            same_dtype(x, p, "layer_norm")
    float_dtype(x, "layer_norm")
    return like(x, x.dims)


@op("layer_norm_chw", layout="preserve")
def layer_norm_chw(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Layer norm over the channel axis of ``[B, C, H, W]`` (SAM's channels-first norm).

    Kernel: one fused pass where the map is laid out channels-last, the reference's formula op by op
    elsewhere (:func:`kestrel.kernels.layer_norm_chw`).
    """
    return kernels.layer_norm_chw(x, weight, bias, eps)


@layer_norm_chw.rule
def _(x: SymTensor, weight: SymTensor, bias: SymTensor, eps: float = 1e-6) -> SymTensor:
    d = x.fixed_dims("layer_norm_chw")
    if len(d) != 4:
        raise ShapeError(f"layer_norm_chw takes [B, C, H, W], got {x.show()}")
    for p in (weight, bias):
        if len(p.fixed_dims("layer_norm_chw's parameters")) != 1:
            raise ShapeError(f"layer_norm_chw: a weight or bias must be [C], got {p.show()} with {x.show()}")
        same(p.fixed_dims()[0], d[1], "layer_norm_chw: parameter length differs from the channels", p, x)
        same_dtype(x, p, "layer_norm_chw")
    float_dtype(x, "layer_norm_chw")
    return like(x, x.dims)


@op("rms_norm", layout="preserve")
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMS norm over the last axis, computed in f32."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


@rms_norm.rule
def _(x: SymTensor, weight: SymTensor, eps: float = 1e-6) -> SymTensor:
    if len(weight.fixed_dims("rms_norm's weight")) != 1:
        raise ShapeError(f"rms_norm: the weight must be [D] for the last axis D, got {weight.show()} with {x.show()}")
    same(weight.fixed_dims()[0], last_dim(x, "rms_norm"), "rms_norm: weight length differs from the last axis",
         weight, x)
    same_dtype(x, weight, "rms_norm")
    float_dtype(x, "rms_norm")
    return like(x, x.dims)


@op("l2_normalize", layout="preserve")
def l2_normalize(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``x / ||x||`` along ``dim``, as the reference divides by the norm."""
    return x / x.norm(p=2, dim=dim, keepdim=True)


@l2_normalize.rule
def _(x: SymTensor, dim: int = -1) -> SymTensor:
    float_dtype(x, "l2_normalize")
    return like(x, x.dims)


@op("softmax", layout="preserve")
def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return torch.softmax(x, dim=dim)


@softmax.rule
def _(x: SymTensor, dim: int = -1) -> SymTensor:
    float_dtype(x, "softmax")
    axis(x, dim)
    return like(x, x.dims)
