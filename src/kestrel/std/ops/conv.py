"""Convolutions, pooling and resampling over spatial axes."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ... import kernels
from ...checker.rules import (
    float_dtype,
    like,
    nonneg,
    pair,
    positive,
    same,
    same_dtype,
)
from ...checker.symbolic import ShapeError, SymTensor, as_poly, fmt, op, require_positive
from ...shapes.poly import Poly, floordiv


def _conv_out(size: Poly, k: Poly, stride: Poly, pad: Poly, what: str = "conv", x: SymTensor | None = None) -> Poly:
    """``(size + 2 pad - k) / stride + 1``; torch needs the kernel to fit: ``size + 2 pad >= k``."""
    require_positive(stride)
    positive(size, f"{what}: a spatial input axis (torch refuses an empty one, padded or not)", x)
    positive(k, f"{what}: the kernel size", x)
    nonneg(pad, f"{what}: the padding", x)
    nonneg(size + 2 * pad - k, f"{what}: the kernel {fmt(k)} must fit in the padded input (output size "
           f"{fmt(floordiv(size + 2 * pad - k, stride) + 1)})", x)
    return floordiv(size + 2 * pad - k, stride) + 1


@op("conv2d")
def conv2d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           stride: Any = 1, padding: Any = 0) -> torch.Tensor:
    """2-D convolution, square or rectangular kernel: ``[B, Cin, H, W] -> [B, Cout, H', W']``."""
    return F.conv2d(x, weight, bias, stride=stride, padding=padding)


def _conv_bias(bias: SymTensor | None, out: Poly, weight: SymTensor, what: str) -> None:
    if bias is None:
        return
    b = bias.fixed_dims(f"{what}'s bias")
    if len(b) != 1:
        raise ShapeError(f"{what}: bias must be [Cout], got {bias.show()}")
    same(b[0], out, f"{what}: bias length differs from the output channels", bias, weight)
    same_dtype(bias, weight, f"{what} bias")


def _dense_conv_dims(x: SymTensor, weight: SymTensor, bias: SymTensor | None, what: str, axes: str,
                     kernel: str) -> tuple[list[Poly], list[Poly]]:
    """The dims of a dense convolution's input ``[B, Cin, *axes]`` and weight ``[Cout, Cin, *kernel]``,
    after the checks conv1d and conv2d share (channels, dtypes, bias)."""
    dx, dw = x.fixed_dims(what), weight.fixed_dims(what)
    rank = 3 + axes.count(",")
    if len(dx) != rank or len(dw) != rank:
        raise ShapeError(f"{what} takes [B, Cin, {axes}] and [Cout, Cin, {kernel}], got {x.show()} and {weight.show()}")
    same(dx[1], dw[1], f"{what}: input channels differ", x, weight)
    same_dtype(x, weight, what)
    float_dtype(x, what)
    positive(dw[0], f"{what}: the output channels", weight)
    positive(dx[1], f"{what}: the input channels", x)  # torch gives 0 output channels for 0 input ones
    _conv_bias(bias, dw[0], weight, what)
    return dx, dw


@conv2d.rule
def _(x: SymTensor, weight: SymTensor, bias: SymTensor | None = None, stride: Any = 1,
      padding: Any = 0) -> SymTensor:
    dx, dw = _dense_conv_dims(x, weight, bias, "conv2d", "H, W", "KH, KW")
    (sh, sw), (ph, pw) = pair(stride), pair(padding)
    h = _conv_out(dx[2], dw[2], as_poly(sh), as_poly(ph), "conv2d", x)
    w = _conv_out(dx[3], dw[3], as_poly(sw), as_poly(pw), "conv2d", x)
    return like(x, [dx[0], dw[0], h, w])


@op("conv1d")
def conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           stride: Any = 1, padding: Any = 0) -> torch.Tensor:
    """1-D convolution: ``[B, Cin, L] -> [B, Cout, L']``."""
    return F.conv1d(x, weight, bias, stride=stride, padding=padding)


@conv1d.rule
def _(x: SymTensor, weight: SymTensor, bias: SymTensor | None = None, stride: Any = 1,
      padding: Any = 0) -> SymTensor:
    dx, dw = _dense_conv_dims(x, weight, bias, "conv1d", "L", "K")
    return like(x, [dx[0], dw[0], _conv_out(dx[2], dw[2], as_poly(stride), as_poly(padding), "conv1d", x)])


@op("depthwise_conv2d")
def depthwise_conv2d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     padding: Any = 0) -> torch.Tensor:
    """Depthwise 2-D convolution, one ``K x K`` filter per channel, stride 1: ``[B, C, H, W] -> [B, C, H', W']``."""
    return F.conv2d(x, weight, bias, padding=padding, groups=x.shape[1])


@depthwise_conv2d.rule
def _(x: SymTensor, weight: SymTensor, bias: SymTensor | None = None, padding: Any = 0) -> SymTensor:
    dx, dw = x.fixed_dims("depthwise_conv2d"), weight.fixed_dims("depthwise_conv2d")
    if len(dx) != 4 or len(dw) != 4:
        raise ShapeError(f"depthwise_conv2d takes [B, C, H, W] and [C, 1, KH, KW], got {x.show()} and {weight.show()}")
    same(dx[1], dw[0], "depthwise_conv2d: the channels differ", x, weight)
    same(dw[1], Poly.const(1), "depthwise_conv2d: the filter takes one channel", weight)
    same_dtype(x, weight, "depthwise_conv2d")
    float_dtype(x, "depthwise_conv2d")
    positive(dx[1], "depthwise_conv2d: the channels", x)
    _conv_bias(bias, dw[0], weight, "depthwise_conv2d")
    p = as_poly(padding)
    h = _conv_out(dx[2], dw[2], Poly.const(1), p, "depthwise_conv2d", x)
    w = _conv_out(dx[3], dw[3], Poly.const(1), p, "depthwise_conv2d", x)
    return like(x, [dx[0], dx[1], h, w])


@op("conv_transpose2x2")
def conv_transpose2x2(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Transposed 2x2 convolution with stride 2: ``[B, Cin, H, W] -> [B, Cout, 2H, 2W]``.

    Kernel: a GEMM over pixels in eager CPU inference (:func:`kestrel.kernels.gemm.conv_transpose2x2`,
    channels-last result), ``F.conv_transpose2d`` in compiled, exported and autograd graphs.
    """
    return kernels.conv_transpose2x2(x, weight, bias)


@conv_transpose2x2.rule
def _(x: SymTensor, weight: SymTensor, bias: SymTensor | None = None) -> SymTensor:
    dx, dw = x.fixed_dims("conv_transpose2x2"), weight.fixed_dims("conv_transpose2x2")
    if len(dx) != 4 or len(dw) != 4 or dw[2] != Poly.const(2) or dw[3] != Poly.const(2):
        raise ShapeError(f"conv_transpose2x2 takes [B, Cin, H, W] and [Cin, Cout, 2, 2], got "
                         f"{x.show()} and {weight.show()}")
    same(dx[1], dw[0], "conv_transpose2x2: input channels differ", x, weight)
    same_dtype(x, weight, "conv_transpose2x2")
    float_dtype(x, "conv_transpose2x2")
    positive(dw[0], "conv_transpose2x2: the input channels", weight)
    positive(dw[1], "conv_transpose2x2: the output channels", weight)
    for a in dx[2:]:  # torch refuses an empty spatial input (an empty batch is fine)
        positive(a, "conv_transpose2x2: a spatial input axis", x)
    _conv_bias(bias, dw[1], weight, "conv_transpose2x2")
    return like(x, [dx[0], dw[1], 2 * dx[2], 2 * dx[3]])


@op("interpolate")
def interpolate(x: torch.Tensor, size: tuple[Any, Any] | None = None, scale_factor: Any = None,
                mode: str = "bilinear", align_corners: bool | None = None, antialias: bool = False) -> torch.Tensor:
    """Resize ``[B, C, H, W]`` as torch does (nearest, bilinear, bicubic; align_corners, antialias)."""
    return F.interpolate(x, size=size, scale_factor=scale_factor, mode=mode, align_corners=align_corners,
                         antialias=antialias)


@interpolate.rule
def _(x: SymTensor, size: tuple[Any, Any] | None = None, scale_factor: Any = None, mode: str = "bilinear",
      align_corners: bool | None = None, antialias: bool = False) -> SymTensor:
    if mode not in ("nearest", "bilinear", "bicubic"):
        raise ShapeError(f"interpolate: mode {mode!r} is not one of nearest, bilinear, bicubic")
    d = x.fixed_dims("interpolate")
    float_dtype(x, "interpolate")
    if len(d) != 4:
        raise ShapeError(f"interpolate takes [B, C, H, W], got {x.show()}")
    if (size is None) == (scale_factor is None):
        raise ShapeError("interpolate: give exactly one of size and scale_factor (torch refuses both or neither)")
    for s in d[1:]:  # torch refuses an empty input (an empty batch is fine)
        positive(s, "interpolate: an input axis", x)
    if size is None:
        if isinstance(scale_factor, bool) or not isinstance(scale_factor, int):
            raise ShapeError("interpolate: give an output size (a float scale factor has no exact shape)")
        if scale_factor < 1:
            raise ShapeError(f"interpolate: the scale factor {scale_factor} must be at least 1")
        return like(x, [d[0], d[1], d[2] * scale_factor, d[3] * scale_factor])
    h, w = pair(size)
    for s in (h, w):
        positive(as_poly(s), "interpolate: the output size", x)
    return like(x, [d[0], d[1], as_poly(h), as_poly(w)])


@op("max_pool2d")
def max_pool2d(x: torch.Tensor, kernel: int, stride: int | None = None) -> torch.Tensor:
    return F.max_pool2d(x, kernel, stride if stride is not None else kernel)


@max_pool2d.rule
def _(x: SymTensor, kernel: int, stride: int | None = None) -> SymTensor:
    d = x.fixed_dims("max_pool2d")
    float_dtype(x, "max_pool2d")
    if len(d) not in (3, 4):
        raise ShapeError(f"max_pool2d takes [C, H, W] or [B, C, H, W], got {x.show()}")
    positive(d[-3], "max_pool2d: the channels", x)  # torch refuses empty channels (an empty batch is fine)
    s = as_poly(stride if stride is not None else kernel)
    k = as_poly(kernel)
    return like(x, [*d[:-2], _conv_out(d[-2], k, s, Poly(), "max_pool2d", x),
                  _conv_out(d[-1], k, s, Poly(), "max_pool2d", x)])
