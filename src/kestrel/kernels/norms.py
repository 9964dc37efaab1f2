"""Normalisation kernels: the channel layer norm of a channels-last map as one fused pass."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .library import plain_inference


def layer_norm_chw(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """Layer norm over the channels of ``[B, C, H, W]``.

    A map laid out channels-last (SAM's and SAM 2's mask upscaling, after the transposed convolution) has
    each pixel's channels side by side: there it is torch's fused layer norm over the last axis of the
    ``[B, H, W, C]`` view, one pass in and one out, and the result keeps that layout. Elsewhere (traced,
    compiled or autograd graphs, channels-first maps) it is the reference's formula, op by op: mean,
    centred variance, division, affine. The two agree to rounding (~1e-7 relative).
    """
    if x.dim() == 4 and x.is_cpu and plain_inference(x, weight, bias):
        rows = x.permute(0, 2, 3, 1)
        if rows.is_contiguous() and x.numel() > 0:
            return F.layer_norm(rows, (x.shape[1],), weight, bias, eps).permute(0, 3, 1, 2)
    mean = x.mean(1, keepdim=True)
    var = (x - mean).pow(2).mean(1, keepdim=True)
    y = (x - mean) / torch.sqrt(var + eps)
    return weight[:, None, None] * y + bias[:, None, None]
