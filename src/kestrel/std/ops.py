"""The standard ops: each a torch kernel (what runs) and a shape rule (what the checker proves).

Kernels are thin calls of torch, so eager speed is torch's and ``torch.compile``/``torch.export``
see plain aten ops. Rules compute the result type from the argument types and raise
:class:`ShapeError` naming both shapes when they do not fit. Tensor methods (``x.reshape``,
``x + y``, ``x[:, 0]``) under the checker are registered here too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ..checker.symbolic import (
    METHODS,
    ShapeError,
    SymDim,
    SymTensor,
    as_poly,
    current,
    fmt,
    op,
    positive_hint,
    record,
    require_positive,
)
from ..shapes.poly import ONE, Poly, floordiv, ge_text
from ..types.dtypes import DType, DTypeVar, bool_, f32, i64
from ..types.tensor import TensorType, Variadic
from . import kernels

# ------------------------------------------------------------------------------------ helpers


def _t(x: SymTensor, dims: Sequence[Poly | Variadic], dtype: DType | DTypeVar | None = None) -> SymTensor:
    return SymTensor(TensorType(tuple(dims), dtype if dtype is not None else x.dtype))


def nonneg(p: Poly, what: str, x: SymTensor | None = None) -> Poly:
    """Prove the size ``p >= 0`` from the where clause, or fail naming the missing fact."""
    if not current().facts.nonneg(p):
        shape = f" ({x.show()})" if x is not None else ""
        raise ShapeError(f"{what}: cannot prove the size {fmt(p)} is nonnegative{shape}", hint=_ge(p))
    return p


def positive(p: Poly, what: str, x: SymTensor | None = None) -> Poly:
    """Prove the size ``p > 0`` (where torch refuses an empty axis), or fail naming the missing fact."""
    if not current().facts.positive(p):
        shape = f" ({x.show()})" if x is not None else ""
        raise ShapeError(f"{what}: cannot prove the size {fmt(p)} is positive{shape}", hint=positive_hint(p))
    return p


def _ge(p: Poly, strict: bool = False) -> str:
    return ge_text(p, current().order, strict)


def same(a: Poly, b: Poly, what: str, x: SymTensor, y: SymTensor | None = None) -> None:
    """Prove a == b, or fail naming both shapes and the dims that differ."""
    if current().facts.equal(a, b):
        return
    shapes = f"{x.show()} and {y.show()}" if y is not None else x.show()
    raise ShapeError(f"{what}: {fmt(a)} vs {fmt(b)} ({shapes})", hint=f"{fmt(a)} == {fmt(b)}")


def same_dtype(x: SymTensor, y: SymTensor, what: str) -> None:
    if x.dtype != y.dtype:
        raise ShapeError(f"{what}: dtype {x.dtype} vs {y.dtype} ({x.show()} and {y.show()})")


def kind_of(x: SymTensor) -> str:
    """``Float``, ``Int``, ``Bool``, or ``DType`` for a generic that may be any of them."""
    d = x.dtype
    return d.kind if isinstance(d, DType | DTypeVar) else "DType"


def float_dtype(x: SymTensor, what: str) -> None:
    if kind_of(x) != "Float":
        hint = " (declare its dtype generic as `T: Float`, or cast it)" if isinstance(x.dtype, DTypeVar) else ""
        raise ShapeError(f"{what} needs a floating-point tensor, got {x.show()}{hint}")


def numeric_dtype(x: SymTensor, what: str) -> None:
    if kind_of(x) not in ("Float", "Int"):
        raise ShapeError(f"{what} needs a number tensor (Float or Int), got {x.show()}")


def scalar_fits(t: SymTensor, value: Any, what: str) -> None:
    """A Python number beside a tensor keeps the tensor's dtype only when torch would not promote it."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ShapeError(f"{what} of a tensor and a {type(value).__name__}")
    if isinstance(value, float) and kind_of(t) != "Float":
        raise ShapeError(f"{what}: a float {value} with {t.show()} would promote it to a float dtype; "
                         f"cast the tensor explicitly")


def axis(x: SymTensor, dim: int, rank: int | None = None) -> int:
    """The index of axis ``dim`` in ``x.dims`` (``rank``: of a result with that many axes).

    Through a variadic run ``*S`` only an axis after it, counted from the end, is known.
    """
    if rank is None and x.type.rank is None:
        d = x.dims
        if dim >= 0 or -dim > len(d) or any(isinstance(a, Variadic) for a in d[dim:]):
            raise ShapeError(f"axis {dim} of {x.show()} is hidden by the variadic run *{x._var()}")
        return len(d) + dim
    n = rank if rank is not None else len(x.fixed_dims())
    if not -n <= dim < n:
        raise ShapeError(f"axis {dim} is out of range for {x.show()} ({n} axes)")
    return dim % n


def last_dim(x: SymTensor, what: str) -> Poly:
    if not x.dims or isinstance(x.dims[-1], Variadic):
        raise ShapeError(f"{what} needs a last axis, got {x.show()}")
    return x.dims[-1]  # type: ignore[return-value]


def broadcast_dims(x: Sequence[Poly | Variadic], y: Sequence[Poly | Variadic], what: str,
                   xs: str, ys: str) -> list[Poly | Variadic]:
    facts = current().facts
    out: list[Poly | Variadic] = []
    i, j = len(x) - 1, len(y) - 1
    while i >= 0 or j >= 0:
        a = x[i] if i >= 0 else None
        b = y[j] if j >= 0 else None
        if isinstance(a, Variadic) or isinstance(b, Variadic):
            # a variadic run passes through only against nothing or the same run
            if a is not None and b is not None and a != b:
                raise ShapeError(f"{what}: cannot broadcast {xs} with {ys}: {a} against {b}")
            rest = list(x[: i + 1]) if isinstance(a, Variadic) else list(y[: j + 1])
            return rest + list(reversed(out))
        if a is None:
            out.append(b)  # type: ignore[arg-type]
        elif b is None:
            out.append(a)
        elif facts.equal(a, b) or b == ONE:
            out.append(a)
        elif a == ONE:
            out.append(b)
        else:
            raise ShapeError(f"{what}: cannot broadcast {xs} with {ys}: {fmt(a)} against {fmt(b)}",
                             hint=f"{fmt(a)} == {fmt(b)}")
        i, j = i - 1, j - 1
    return list(reversed(out))


# -------------------------------------------------------------------------------- elementwise


def _binary(name: str, torch_fn: Any) -> Any:
    @op(name)
    def kernel(x: Any, y: Any) -> Any:
        return torch_fn(x, y)

    @kernel.rule
    def _(x: Any, y: Any) -> SymTensor:
        if isinstance(x, SymTensor) and isinstance(y, SymTensor):
            same_dtype(x, y, name)
            (float_dtype if name == "div" else numeric_dtype)(x, name)
            dims = broadcast_dims(x.dims, y.dims, name, x.show(), y.show())
            return _t(x, dims)
        t = x if isinstance(x, SymTensor) else y
        other = y if t is x else x
        if isinstance(other, SymDim):
            raise ShapeError(f"{name} of a tensor and the dimension {other}: convert it with a std op")
        (float_dtype if name == "div" else numeric_dtype)(t, name)  # int / int is a float in torch
        scalar_fits(t, other, name)
        return _t(t, t.dims)

    return kernel


add = _binary("add", torch.add)
sub = _binary("sub", torch.sub)
mul = _binary("mul", torch.mul)
div = _binary("div", torch.div)


def _unary(name: str, torch_fn: Any, needs_float: bool = True) -> Any:
    @op(name)
    def kernel(x: torch.Tensor) -> torch.Tensor:
        return torch_fn(x)

    @kernel.rule
    def _(x: SymTensor) -> SymTensor:
        if needs_float:
            float_dtype(x, name)
        return _t(x, x.dims)

    return kernel


relu = _unary("relu", F.relu)
sigmoid = _unary("sigmoid", torch.sigmoid)
silu = _unary("silu", F.silu)
tanh = _unary("tanh", torch.tanh)
exp = _unary("exp", torch.exp)
sin = _unary("sin", torch.sin)
cos = _unary("cos", torch.cos)


@op("gelu")
def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GELU, exact (erf) by default or ``approximate="tanh"``."""
    return F.gelu(x, approximate=approximate)


def _gelu_rule(name: str) -> Any:
    """The type rule of ``gelu`` and of its in-place twin: same shape, a float, a known approximation."""
    def rule(x: SymTensor, approximate: str = "none") -> SymTensor:
        if approximate not in ("none", "tanh"):
            raise ShapeError(f"{name}: approximate must be 'none' or 'tanh', got {approximate!r}")
        float_dtype(x, name)
        return _t(x, x.dims)
    return rule


gelu.rule(_gelu_rule("gelu"))


@op("gelu_")
def gelu_(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GELU of a temporary nothing else reads (an MLP's hidden layer): in place in eager inference.

    An MLP's hidden activation is the largest tensor of a ViT layer (135 MB for DINOv2-B at 518 px,
    batch 8); a second one for GELU's output costs an allocation, fresh pages and a pass of memory
    (that GELU took 45 ms out of place, 13 in place). Compiled, exported and autograd graphs get the
    out-of-place op. Never pass a tensor the caller still uses.
    """
    if kernels.plain_inference(x):
        if approximate == "tanh":
            return kernels.gelu_tanh_(x)
        return torch.ops.aten.gelu_(x, approximate=approximate)
    return F.gelu(x, approximate=approximate)


gelu_.rule(_gelu_rule("gelu_"))


# ----------------------------------------------------------------------------- linear algebra


@op("linear")
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` over the last axis: ``[*S, In] -> [*S, Out]``.

    Kernel: for eager f32 inference on CPU, the GEMM path measured fastest for this shape on this
    machine (:mod:`kestrel.std.kernels`: torch's default, oneDNN or MKL's packed GEMM, all within
    ~1e-6 relative of each other); ``F.linear`` in compiled, exported and autograd graphs.
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
    return _t(x, [*x.dims[:-1], w[0]])


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
        return _t(a, da[:-1])
    if len(da) == 1:
        same(da[0], db[-2], "matmul: the contraction dimension differs", a, b)
        return _t(a, [*db[:-2], db[-1]])
    same(da[-1], db[-2], "matmul: the contraction dimension differs", a, b)
    batch = broadcast_dims(da[:-2], db[:-2], "matmul batch", a.show(), b.show())
    return _t(a, [*batch, da[-2], db[-1]])


bmm = matmul


# ----------------------------------------------------------------------------------- convolution


def _conv_out(size: Poly, k: Poly, stride: Poly, pad: Poly, what: str = "conv", x: SymTensor | None = None) -> Poly:
    """``(size + 2 pad - k) / stride + 1``; torch needs the kernel to fit: ``size + 2 pad >= k``."""
    require_positive(stride)
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


def _pair(v: Any) -> tuple[Any, Any]:
    return (v[0], v[1]) if isinstance(v, tuple | list) else (v, v)


@conv2d.rule
def _(x: SymTensor, weight: SymTensor, bias: SymTensor | None = None, stride: Any = 1,
      padding: Any = 0) -> SymTensor:
    dx, dw = x.fixed_dims("conv2d"), weight.fixed_dims("conv2d")
    if len(dx) != 4 or len(dw) != 4:
        raise ShapeError(f"conv2d takes [B, Cin, H, W] and [Cout, Cin, KH, KW], got {x.show()} and {weight.show()}")
    same(dx[1], dw[1], "conv2d: input channels differ", x, weight)
    same_dtype(x, weight, "conv2d")
    float_dtype(x, "conv2d")
    positive(dw[0], "conv2d: the output channels", weight)
    positive(dx[1], "conv2d: the input channels", x)  # torch gives 0 output channels for 0 input ones
    _conv_bias(bias, dw[0], weight, "conv2d")
    (sh, sw), (ph, pw) = _pair(stride), _pair(padding)
    h = _conv_out(dx[2], dw[2], as_poly(sh), as_poly(ph), "conv2d", x)
    w = _conv_out(dx[3], dw[3], as_poly(sw), as_poly(pw), "conv2d", x)
    return _t(x, [dx[0], dw[0], h, w])


@op("conv1d")
def conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           stride: Any = 1, padding: Any = 0) -> torch.Tensor:
    """1-D convolution: ``[B, Cin, L] -> [B, Cout, L']``."""
    return F.conv1d(x, weight, bias, stride=stride, padding=padding)


@conv1d.rule
def _(x: SymTensor, weight: SymTensor, bias: SymTensor | None = None, stride: Any = 1,
      padding: Any = 0) -> SymTensor:
    dx, dw = x.fixed_dims("conv1d"), weight.fixed_dims("conv1d")
    if len(dx) != 3 or len(dw) != 3:
        raise ShapeError(f"conv1d takes [B, Cin, L] and [Cout, Cin, K], got {x.show()} and {weight.show()}")
    same(dx[1], dw[1], "conv1d: input channels differ", x, weight)
    same_dtype(x, weight, "conv1d")
    float_dtype(x, "conv1d")
    positive(dw[0], "conv1d: the output channels", weight)
    positive(dx[1], "conv1d: the input channels", x)
    _conv_bias(bias, dw[0], weight, "conv1d")
    return _t(x, [dx[0], dw[0], _conv_out(dx[2], dw[2], as_poly(stride), as_poly(padding), "conv1d", x)])


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
    same(dw[1], ONE, "depthwise_conv2d: the filter takes one channel", weight)
    same_dtype(x, weight, "depthwise_conv2d")
    float_dtype(x, "depthwise_conv2d")
    positive(dx[1], "depthwise_conv2d: the channels", x)
    _conv_bias(bias, dw[0], weight, "depthwise_conv2d")
    p = as_poly(padding)
    h = _conv_out(dx[2], dw[2], ONE, p, "depthwise_conv2d", x)
    w = _conv_out(dx[3], dw[3], ONE, p, "depthwise_conv2d", x)
    return _t(x, [dx[0], dx[1], h, w])


@op("conv_transpose2x2")
def conv_transpose2x2(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Transposed 2x2 convolution with stride 2: ``[B, Cin, H, W] -> [B, Cout, 2H, 2W]``.

    Kernel: a GEMM over pixels in eager CPU inference (:func:`kestrel.std.kernels.conv_transpose2x2`,
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
    _conv_bias(bias, dw[1], weight, "conv_transpose2x2")
    return _t(x, [dx[0], dw[1], 2 * dx[2], 2 * dx[3]])


# ------------------------------------------------------------------------------- normalisation


@op("layer_norm")
def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
               eps: float = 1e-5) -> torch.Tensor:
    """Layer norm over the last axis."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


@layer_norm.rule
def _(x: SymTensor, weight: SymTensor | None, bias: SymTensor | None, eps: float = 1e-5) -> SymTensor:
    d = last_dim(x, "layer_norm")
    for p in (weight, bias):
        if p is not None:
            same(p.fixed_dims()[0], d, "layer_norm: parameter length differs from the last axis", p, x)
            same_dtype(x, p, "layer_norm")
    float_dtype(x, "layer_norm")
    return _t(x, x.dims)


@op("layer_norm_chw")
def layer_norm_chw(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Layer norm over the channel axis of ``[B, C, H, W]`` (SAM's channels-first norm)."""
    mean = x.mean(1, keepdim=True)
    var = (x - mean).pow(2).mean(1, keepdim=True)
    y = (x - mean) / torch.sqrt(var + eps)
    return weight[:, None, None] * y + bias[:, None, None]


@layer_norm_chw.rule
def _(x: SymTensor, weight: SymTensor, bias: SymTensor, eps: float = 1e-6) -> SymTensor:
    d = x.fixed_dims("layer_norm_chw")
    if len(d) != 4:
        raise ShapeError(f"layer_norm_chw takes [B, C, H, W], got {x.show()}")
    for p in (weight, bias):
        same(p.fixed_dims()[0], d[1], "layer_norm_chw: parameter length differs from the channels", p, x)
        same_dtype(x, p, "layer_norm_chw")
    float_dtype(x, "layer_norm_chw")
    return _t(x, x.dims)


@op("rms_norm")
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMS norm over the last axis, computed in f32."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


@rms_norm.rule
def _(x: SymTensor, weight: SymTensor, eps: float = 1e-6) -> SymTensor:
    same(weight.fixed_dims()[0], last_dim(x, "rms_norm"), "rms_norm: weight length differs from the last axis",
         weight, x)
    same_dtype(x, weight, "rms_norm")
    float_dtype(x, "rms_norm")
    return _t(x, x.dims)


@op("l2_normalize")
def l2_normalize(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``x / ||x||`` along ``dim``, as the reference divides by the norm."""
    return x / x.norm(p=2, dim=dim, keepdim=True)


@l2_normalize.rule
def _(x: SymTensor, dim: int = -1) -> SymTensor:
    float_dtype(x, "l2_normalize")
    return _t(x, x.dims)


@op("softmax")
def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return torch.softmax(x, dim=dim)


@softmax.rule
def _(x: SymTensor, dim: int = -1) -> SymTensor:
    float_dtype(x, "softmax")
    axis(x, dim)
    return _t(x, x.dims)


# ---------------------------------------------------------------------------------- attention


@op("attention")
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None = None,
              mask: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """Scaled dot-product attention ``softmax(q k^T * scale + bias) v`` over ``[..., N, Dh]``.

    ``bias`` is added to the scores; ``mask`` (bool) keeps the positions where it is True.
    Runs torch's fused kernel, which never materialises the scores when there is no bias.
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
    for extra, name in ((bias, "bias"), (mask, "mask")):
        if extra is not None:
            broadcast_dims(scores, extra.fixed_dims(), f"attention {name}", f"scores [{_show(scores)}]", extra.show())
    return _t(q, [*dq[:-1], dv[-1]])


# a multi-head attention whose keys across all heads number at most this many runs as two GEMMs
# against block-diagonal keys and values (see multihead_attention)
FEW_KEY_COLUMNS = 128


@op("multihead_attention")
def multihead_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    """Multi-head attention on unsplit projections: ``[..., Nq, E]``, ``[..., Nk, E]``, ``[..., Nk, Ev]``
    in, ``[..., Nq, Ev]`` out; head ``h`` is columns ``h * E / heads`` on (``softmax(q_h k_h^T /
    sqrt(E / heads)) v_h``), the heads side by side as an output projection reads them.

    With few keys (SAM's 4096 image tokens attending to 7 prompt tokens) the fused kernel spends its
    time on overhead per query block; in eager inference such a problem (``heads * Nk <=
    FEW_KEY_COLUMNS``) runs as two GEMMs against block-diagonal keys and values instead, the soft-max
    over each head's keys on a strided axis (SAM's decoder at batch 8: ~30 -> 11 ms a call, ~1e-7
    relative). Elsewhere, and in graphs, it is ``scaled_dot_product_attention`` on head views.
    """
    *lead, nq, _ = q.shape
    nk, ev = k.shape[-2], v.shape[-1]
    if kernels.plain_inference(q, k, v) and heads * nk <= FEW_KEY_COLUMNS and q.dtype.is_floating_point:
        return _few_keys_attention(q, k, v, heads)

    def split(t: torch.Tensor) -> torch.Tensor:  # [batch, heads, N, width / heads], the batch axes folded in one
        n, width = t.shape[-2:]
        return t.reshape(-1, n, heads, width // heads).transpose(1, 2)

    y = F.scaled_dot_product_attention(split(q), split(k), split(v))  # 4-D: its fused kernels' layout
    return y.transpose(1, 2).reshape(*lead, nq, ev)


def _few_keys_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    *lead, nq, e = q.shape
    nk, ev = k.shape[-2], v.shape[-1]
    dh, dv, n = e // heads, ev // heads, len(lead)
    # keys as an [E, Nk * heads] matrix, column (j, h) holding key j of head h in head h's rows only
    kbd = k.new_zeros(*lead, heads, dh, nk, heads)
    kbd.diagonal(dim1=n, dim2=n + 3).copy_(k.reshape(*lead, nk, heads, dh).permute(*range(n), n + 2, n, n + 1))
    # values as an [Nk * heads, Ev] matrix: row (j, h) holds value j of head h in head h's columns only
    vbd = v.new_zeros(*lead, nk, heads, heads, dv)
    vbd.diagonal(dim1=n + 1, dim2=n + 2).copy_(v.reshape(*lead, nk, heads, dv).permute(*range(n), n, n + 2, n + 1))
    scores = torch.matmul(q, kbd.view(*lead, e, nk * heads)).mul_(dh ** -0.5)
    weights = torch.softmax(scores.view(*lead, nq, nk, heads), dim=-2)  # over each head's keys
    return torch.matmul(weights.view(*lead, nq, nk * heads), vbd.view(*lead, nk * heads, ev))


@multihead_attention.rule
def _(q: SymTensor, k: SymTensor, v: SymTensor, heads: Any) -> SymTensor:
    dq, dk, dv = qkv_dims("multihead_attention", q, k, v)
    for a, b in zip(dk[:-2], dv[:-2]):
        same(a, b, "multihead_attention: batch axes of key and value differ", k, v)
    h = as_poly(heads)
    require_positive(h)
    facts = current().facts
    for t, width in ((q, dq[-1]), (v, dv[-1])):
        if not facts.divides(h, width):
            raise ShapeError(f"multihead_attention: cannot prove {fmt(h)} heads divide the width {fmt(width)} of "
                             f"{t.show()}", hint=f"{_operand(width)} % {_operand(h)} == 0")
    same_dtype(q, k, "multihead_attention")
    same_dtype(k, v, "multihead_attention")
    float_dtype(q, "multihead_attention")
    return _t(q, [*dq[:-1], dv[-1]])


def _show(dims: Sequence[Poly]) -> str:
    return ", ".join(fmt(d) for d in dims)


# --------------------------------------------------------------------------------- layout ops


@op("reshape")
def reshape(x: torch.Tensor, *shape: Any) -> torch.Tensor:
    return x.reshape(*shape)


def _numel(dims: Sequence[Poly]) -> Poly:
    out = ONE
    for d in dims:
        out = out * d
    return out


@reshape.rule
def _(x: SymTensor, *shape: Any) -> SymTensor:
    src = x.fixed_dims("reshape")
    target: list[Poly | None] = []
    raw = shape[0] if len(shape) == 1 and isinstance(shape[0], list | tuple) else shape
    for s in raw:
        target.append(None if (isinstance(s, int) and s == -1) else as_poly(s))
    facts = current().facts
    total = _numel(src)
    if target.count(None) > 1:
        raise ShapeError(f"reshape of {x.show()}: at most one -1")
    if None in target:
        known = _numel([t for t in target if t is not None])
        if not facts.divides(known, total):
            k2, t2 = _cancel_common(known, total)
            raise ShapeError(f"reshape of {x.show()} to [{_show_target(target)}]: cannot prove {fmt(known)} "
                             f"divides {fmt(total)}", hint=f"{_operand(t2)} % {_operand(k2)} == 0")
        require_positive(known)
        target[target.index(None)] = floordiv(total, known)
    dims: list[Poly] = [t for t in target if t is not None]
    for t in dims:
        nonneg(t, "reshape: a target axis", x)
    if not facts.equal(_numel(dims), total):
        hint = _divisibility_hint(dims)
        raise ShapeError(f"reshape of {x.show()} to [{_show(dims)}]: element counts {fmt(total)} and "
                         f"{fmt(_numel(dims))} cannot be proved equal", hint=hint)
    return _t(x, dims)


def _cancel_common(known: Poly, total: Poly) -> tuple[Poly, Poly]:
    """``known`` and ``total`` without their common monomial factor: what the hint must name."""
    from ..shapes.facts import _common_factor

    _, k, t = _common_factor(known, total)
    return k, t


def _show_target(t: Sequence[Poly | None]) -> str:
    return ", ".join("-1" if d is None else fmt(d) for d in t)


def _divisibility_hint(dims: Sequence[Poly]) -> str | None:
    from ..shapes.poly import FloorDiv

    facts = current().facts
    for d in dims:
        for a in d.atoms():  # the first division not already known exact is the missing fact
            if isinstance(a, FloorDiv) and not facts.divides(a.b, a.a):
                return f"{_operand(a.a)} % {_operand(a.b)} == 0"
    return None


def _operand(p: Poly) -> str:
    text = fmt(p)
    return text if p.is_const or p.as_atom() is not None else f"({text})"


view = reshape


@op("permute")
def permute(x: torch.Tensor, *order: int) -> torch.Tensor:
    return x.permute(*order)


@permute.rule
def _(x: SymTensor, *order: Any) -> SymTensor:
    d = x.fixed_dims("permute")
    order_ = tuple(order[0]) if len(order) == 1 and isinstance(order[0], list | tuple) else order
    if sorted(o % len(d) for o in order_) != list(range(len(d))):
        raise ShapeError(f"permute{order_} is not a permutation of the {len(d)} axes of {x.show()}")
    return _t(x, [d[o] for o in order_])


@op("contiguous")
def contiguous(x: torch.Tensor) -> torch.Tensor:
    """The same values laid out row-major. A layout choice, not a type change: a permuted view left as
    it is makes every later elementwise op (and each residual add, whose result keeps the first
    operand's strides) walk memory across the grain."""
    return x.contiguous()


@contiguous.rule
def _(x: SymTensor) -> SymTensor:
    return _t(x, x.dims)


@op("transpose")
def transpose(x: torch.Tensor, a: int, b: int) -> torch.Tensor:
    return x.transpose(a, b)


@transpose.rule
def _(x: SymTensor, a: int, b: int) -> SymTensor:
    d = x.fixed_dims("transpose")
    i, j = axis(x, a), axis(x, b)
    d[i], d[j] = d[j], d[i]
    return _t(x, d)


@op("flatten")
def flatten(x: torch.Tensor, start: int = 0, end: int = -1) -> torch.Tensor:
    return x.flatten(start, end)


@flatten.rule
def _(x: SymTensor, start: int = 0, end: int = -1) -> SymTensor:
    d = x.fixed_dims("flatten")
    i, j = axis(x, start), axis(x, end)
    return _t(x, [*d[:i], _numel(d[i: j + 1]), *d[j + 1:]])


@op("unsqueeze")
def unsqueeze(x: torch.Tensor, dim: int) -> torch.Tensor:
    return x.unsqueeze(dim)


@unsqueeze.rule
def _(x: SymTensor, dim: int) -> SymTensor:
    d = x.fixed_dims("unsqueeze")
    i = axis(x, dim, len(d) + 1)
    return _t(x, [*d[:i], ONE, *d[i:]])


@op("squeeze")
def squeeze(x: torch.Tensor, dim: int) -> torch.Tensor:
    return x.squeeze(dim)


@squeeze.rule
def _(x: SymTensor, dim: int) -> SymTensor:
    d = x.fixed_dims("squeeze")
    i = axis(x, dim)
    same(d[i], ONE, f"squeeze: axis {dim} is not of size 1", x)
    return _t(x, d[:i] + d[i + 1:])


@op("expand")
def expand(x: torch.Tensor, *sizes: Any) -> torch.Tensor:
    return x.expand(*sizes)


@expand.rule
def _(x: SymTensor, *sizes: Any) -> SymTensor:
    d = x.fixed_dims("expand")
    raw = sizes[0] if len(sizes) == 1 and isinstance(sizes[0], list | tuple) else sizes
    if len(raw) < len(d):
        raise ShapeError(f"expand of {x.show()} to {len(raw)} axes")
    out: list[Poly] = []
    offset = len(raw) - len(d)
    for i, s in enumerate(raw):
        cur = d[i - offset] if i >= offset else None
        if isinstance(s, int) and s == -1:
            if cur is None:
                raise ShapeError(f"expand: -1 for a new leading axis of {x.show()}")
            out.append(cur)
            continue
        want = nonneg(as_poly(s), "expand: a target axis", x)
        if cur is not None and cur != ONE:
            same(cur, want, f"expand: axis {i - offset} is not 1 and differs", x)
        out.append(want)
    return _t(x, out)


@op("cat")
def cat(xs: Sequence[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """Concatenate along ``dim``; every other axis must agree."""
    return torch.cat(list(xs), dim=dim)


@cat.rule
def _(xs: Sequence[SymTensor], dim: int = 0) -> SymTensor:
    first = xs[0]
    d0 = first.fixed_dims("cat")
    i = axis(first, dim)
    total = d0[i]
    for x in xs[1:]:
        d = x.fixed_dims("cat")
        if len(d) != len(d0):
            raise ShapeError(f"cat: ranks differ: {first.show()} and {x.show()}")
        same_dtype(first, x, "cat")
        for k, (a, b) in enumerate(zip(d0, d)):
            if k != i:
                same(a, b, f"cat along axis {dim}: axis {k} differs", first, x)
        total = total + d[i]
    out = list(d0)
    out[i] = total
    return _t(first, out)


@op("stack")
def stack(xs: Sequence[torch.Tensor], dim: int = 0) -> torch.Tensor:
    return torch.stack(list(xs), dim=dim)


@stack.rule
def _(xs: Sequence[SymTensor], dim: int = 0) -> SymTensor:
    d0 = xs[0].fixed_dims("stack")
    for x in xs[1:]:
        d = x.fixed_dims("stack")
        if len(d) != len(d0):
            raise ShapeError(f"stack: ranks differ: {xs[0].show()} and {x.show()}")
        same_dtype(xs[0], x, "stack")
        for a, b in zip(d0, d):
            same(a, b, "stack: shapes differ", xs[0], x)
    i = axis(xs[0], dim, len(d0) + 1)
    return _t(xs[0], [*d0[:i], Poly.const(len(xs)), *d0[i:]])


@op("split")
def split(x: torch.Tensor, sizes: Sequence[Any], dim: int = -1) -> tuple[torch.Tensor, ...]:
    """Split into consecutive pieces of the given sizes along ``dim``."""
    return torch.split(x, list(sizes), dim=dim)


@split.rule
def _(x: SymTensor, sizes: Sequence[Any], dim: int = -1) -> tuple[SymTensor, ...]:
    d = list(x.dims)
    i = axis(x, dim)
    parts = [nonneg(as_poly(s), "split: a piece", x) for s in sizes]
    same(_sum(parts), d[i], "split: the pieces do not add up to the axis", x)  # type: ignore[arg-type]
    return tuple(_t(x, [*d[:i], p, *d[i + 1:]]) for p in parts)


def _sum(ps: Sequence[Poly]) -> Poly:
    out = Poly()
    for p in ps:
        out = out + p
    return out


@op("pad")
def pad(x: torch.Tensor, pads: Sequence[Any], value: float = 0.0) -> torch.Tensor:
    """Constant padding, ``pads`` as torch orders it: last axis first, (before, after) pairs."""
    return F.pad(x, [int(p) for p in pads], value=value)


@pad.rule
def _(x: SymTensor, pads: Sequence[Any], value: float = 0.0) -> SymTensor:
    d = x.fixed_dims("pad")
    if len(pads) % 2 or len(pads) // 2 > len(d):
        raise ShapeError(f"pad: {len(pads)} values for {x.show()}")
    facts = current().facts
    for k in range(len(pads) // 2):
        before, after = as_poly(pads[2 * k]), as_poly(pads[2 * k + 1])
        for p in (before, after):
            if not facts.nonneg(p):
                raise ShapeError(f"pad: cannot prove the padding {fmt(p)} is nonnegative", hint=_ge(p))
        d[len(d) - 1 - k] = d[len(d) - 1 - k] + before + after
    return _t(x, d)


@op("repeat")
def repeat(x: torch.Tensor, *times: Any) -> torch.Tensor:
    return x.repeat(*times)


@repeat.rule
def _(x: SymTensor, *times: Any) -> SymTensor:
    d = x.fixed_dims("repeat")
    t = [nonneg(as_poly(s), "repeat: a factor", x) for s in times]
    if len(t) < len(d):
        raise ShapeError(f"repeat of {x.show()} with {len(t)} factors")
    d = [ONE] * (len(t) - len(d)) + d
    return _t(x, [a * b for a, b in zip(d, t)])


# ------------------------------------------------------------------------------- indexing


def _slice_len(size: Poly, s: slice, where: str = "") -> Poly:
    """The length of ``s`` on an axis of length ``size``; ``where`` names the tensor in errors."""
    facts = current().facts
    if s.step not in (None, 1):
        step = as_poly(s.step)
        require_positive(step)
    else:
        step = ONE
    start = as_poly(0 if s.start is None else s.start)
    stop = size if s.stop is None else as_poly(s.stop)
    if start.is_const and start.value < 0:
        start = size + start
    if stop.is_const and stop.value < 0:
        stop = size + stop
    for bound, name in ((start, "start"), (stop, "stop")):
        if not (facts.nonneg(bound) and facts.nonneg(size - bound)):
            bad = bound if not facts.nonneg(bound) else size - bound
            raise ShapeError(f"slice {name} {fmt(bound)} may be outside an axis of length {fmt(size)}{where}",
                             hint=_ge(bad))
    if not facts.nonneg(stop - start):
        raise ShapeError(f"slice {fmt(start)}:{fmt(stop)} may be empty or reversed{where}",
                         hint=_ge(stop - start))
    return floordiv(stop - start + step - 1, step)


def getitem(x: SymTensor, index: Any) -> SymTensor:
    """``x[...]`` with ints, slices, ``None`` and ``...`` under the checker."""
    idx = index if isinstance(index, tuple) else (index,)
    d = x.fixed_dims("indexing")
    n_real = sum(1 for i in idx if i is not None and i is not Ellipsis)
    if n_real > len(d):
        raise ShapeError(f"too many indices ({n_real}) for {x.show()}")
    if Ellipsis in idx:
        k = idx.index(Ellipsis)
        idx = idx[:k] + (slice(None),) * (len(d) - n_real) + idx[k + 1:]
    out: list[Poly] = []
    facts = current().facts
    pos = 0
    for i in idx:
        if i is None:
            out.append(ONE)
            continue
        size = d[pos]
        pos += 1
        if isinstance(i, slice):
            out.append(_slice_len(size, i, f" in {x.show()}"))
        elif isinstance(i, int | SymDim):
            p = as_poly(i)
            if p.is_const and p.value < 0:  # x[-k] needs size >= k
                ok, hint = facts.nonneg(size + p), _ge(size + p)
            else:
                ok, hint = facts.positive(size - p), _ge(size - p, strict=True)
            if not ok:
                raise ShapeError(f"index {fmt(p)} may be out of range for an axis of length {fmt(size)} "
                                 f"in {x.show()}", hint=hint)
        else:
            raise ShapeError(f"indexing with a {type(i).__name__}: use the gather op")
    out.extend(d[pos:])
    result = _t(x, out)
    record("getitem", [x], [result], detail=str(index))
    return result


@op("gather")
def gather(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows of ``table`` at integer ``index``: ``[V, *R]`` at ``[*S] -> [*S, *R]``."""
    return table[index]


@gather.rule
def _(table: SymTensor, index: SymTensor) -> SymTensor:
    if not (isinstance(index.dtype, DType | DTypeVar) and index.dtype.kind == "Int"):
        raise ShapeError(f"gather: the index must be an integer tensor, got {index.show()}")
    d = table.fixed_dims("gather")
    return _t(table, [*index.dims, *d[1:]])


@op("embedding")
def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Rows of an embedding table: ``[*S] (int) -> [*S, H]``."""
    return F.embedding(ids, weight)


@embedding.rule
def _(ids: SymTensor, weight: SymTensor) -> SymTensor:
    if not (isinstance(ids.dtype, DType | DTypeVar) and ids.dtype.kind == "Int"):
        raise ShapeError(f"embedding: ids must be integers, got {ids.show()}")
    w = weight.fixed_dims("embedding")
    return _t(weight, [*ids.dims, w[1]])


@op("eq")
def eq(x: torch.Tensor, value: int | float) -> torch.Tensor:
    """``x == value`` elementwise, a bool tensor of ``x``'s shape."""
    return x == value


@eq.rule
def _(x: SymTensor, value: int | float) -> SymTensor:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ShapeError(f"eq compares with a Python number, got {type(value).__name__}")
    return _t(x, x.dims, bool_)


@op("where")
def where(cond: torch.Tensor, x: Any, y: Any) -> torch.Tensor:
    """``x`` where ``cond`` holds, else ``y``; tensors broadcast, either side may be a number."""
    return torch.where(cond, x, y)


@where.rule
def _(cond: SymTensor, x: Any, y: Any) -> SymTensor:
    if not isinstance(cond, SymTensor) or cond.dtype != bool_:
        shown = cond.show() if isinstance(cond, SymTensor) else type(cond).__name__
        raise ShapeError(f"where: the condition must be a bool tensor, got {shown}")
    tensors = [v for v in (x, y) if isinstance(v, SymTensor)]
    for v in (x, y):
        if not isinstance(v, SymTensor) and (isinstance(v, bool) or not isinstance(v, int | float)):
            raise ShapeError(f"where: values must be tensors or Python numbers, got {type(v).__name__}")
    if not tensors:
        raise ShapeError("where: at least one of the values must be a tensor")
    if len(tensors) == 2:
        same_dtype(tensors[0], tensors[1], "where")
    else:
        scalar_fits(tensors[0], y if tensors[0] is x else x, "where")
    dims = list(cond.dims)
    shown = cond.show()
    for v in tensors:
        dims = broadcast_dims(dims, v.dims, "where", shown, v.show())
        shown = f"[{_show(dims)}]"
    return _t(tensors[0], dims)


@op("relative_positions")
def relative_positions(table: torch.Tensor, n: int) -> torch.Tensor:
    """Rows ``table[i - j + n - 1]`` for ``i, j < n``: ``[2n - 1, C] -> [n, n, C]``.

    The relative-position lookup of SAM's (and MViTv2's) decomposed attention bias.
    """
    idx = torch.arange(n, device=table.device)
    return table[idx[:, None] - idx[None, :] + (n - 1)]


@relative_positions.rule
def _(table: SymTensor, n: Any) -> SymTensor:
    d = table.fixed_dims("relative_positions")
    if len(d) != 2:
        raise ShapeError(f"relative_positions takes a [2n - 1, C] table, got {table.show()}")
    size = as_poly(n)  # the table's length 2n - 1, a size, makes n >= 1
    same(d[0], 2 * size - 1, "relative_positions: the table length is not 2n - 1", table)
    return _t(table, [size, size, d[1]])


# -------------------------------------------------------------------------------- reductions


def _reduce(name: str, torch_fn: Any) -> Any:
    @op(name)
    def kernel(x: torch.Tensor, dim: int | Sequence[int], keepdim: bool = False) -> torch.Tensor:
        return torch_fn(x, dim=dim, keepdim=keepdim)

    @kernel.rule
    def _(x: SymTensor, dim: int | Sequence[int], keepdim: bool = False) -> SymTensor:
        d = x.fixed_dims(name)
        axes = {axis(x, a) for a in (dim if isinstance(dim, list | tuple) else [dim])}
        out = [ONE if i in axes else s for i, s in enumerate(d)] if keepdim else [
            s for i, s in enumerate(d) if i not in axes]
        if name == "amax":
            for i in axes:  # torch refuses the max of nothing
                positive(d[i], "amax: the reduced axis", x)
        if name == "mean":
            float_dtype(x, name)
        elif name == "sum" and kind_of(x) != "Float":
            if kind_of(x) == "DType":
                raise ShapeError(f"sum of {x.show()}: a float stays, an integer or bool becomes i64; "
                                 "declare the dtype's kind")
            return _t(x, out, i64)  # torch sums integers and bools in int64
        return _t(x, out)

    return kernel


sum_ = _reduce("sum", torch.sum)
mean = _reduce("mean", torch.mean)
amax = _reduce("amax", torch.amax)


# ------------------------------------------------------------------------ comparisons, selection


abs_ = _unary("abs", torch.abs)


def _compare(name: str, torch_fn: Any) -> Any:
    @op(name)
    def kernel(x: torch.Tensor, value: int | float) -> torch.Tensor:
        return torch_fn(x, value)

    @kernel.rule
    def _(x: SymTensor, value: int | float) -> SymTensor:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ShapeError(f"{name} compares with a Python number, got {type(value).__name__}")
        return _t(x, x.dims, bool_)

    return kernel


gt = _compare("gt", torch.gt)  # ``x > value``, a bool tensor of x's shape
ge = _compare("ge", torch.ge)  # ``x >= value``


@op("argmax")
def argmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The index of the first largest value along ``dim`` (which is dropped), as i64."""
    return torch.argmax(x, dim=dim)


@argmax.rule
def _(x: SymTensor, dim: int = -1) -> SymTensor:
    d = x.fixed_dims("argmax")
    a = axis(x, dim)
    positive(d[a], "argmax: the reduced axis", x)  # torch refuses an empty one
    return _t(x, [s for i, s in enumerate(d) if i != a], i64)


@op("take_along")
def take_along(x: torch.Tensor, index: torch.Tensor, dim: int) -> torch.Tensor:
    """``torch.gather``: ``out[..., i, ...] = x[..., index[..., i, ...], ...]`` along ``dim``.

    ``index`` has ``x``'s rank and its shape on every axis but ``dim``; the result has ``index``'s shape.
    """
    return torch.gather(x, dim, index)


@take_along.rule
def _(x: SymTensor, index: SymTensor, dim: int) -> SymTensor:
    if not (isinstance(index.dtype, DType | DTypeVar) and index.dtype.kind == "Int"):
        raise ShapeError(f"take_along: the index must be an integer tensor, got {index.show()}")
    d, di = x.fixed_dims("take_along"), index.fixed_dims("take_along")
    if len(d) != len(di):
        raise ShapeError(f"take_along: index {index.show()} and {x.show()} differ in rank")
    a = axis(x, dim)
    for i, (s, t) in enumerate(zip(d, di)):
        if i != a:
            same(s, t, f"take_along: axis {i} of the index differs", x, index)
    return _t(x, di)


# ------------------------------------------------------------------------------ resampling


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
    if size is None:
        if not isinstance(scale_factor, int):
            raise ShapeError("interpolate: give an output size (a float scale factor has no exact shape)")
        if scale_factor < 1:
            raise ShapeError(f"interpolate: the scale factor {scale_factor} must be at least 1")
        return _t(x, [d[0], d[1], d[2] * scale_factor, d[3] * scale_factor])
    h, w = _pair(size)
    for s in (h, w):
        positive(as_poly(s), "interpolate: the output size", x)
    for s in d[1:]:  # torch refuses an empty input (an empty batch is fine)
        positive(s, "interpolate: an input axis", x)
    return _t(x, [d[0], d[1], as_poly(h), as_poly(w)])


@op("max_pool2d")
def max_pool2d(x: torch.Tensor, kernel: int, stride: int | None = None) -> torch.Tensor:
    return F.max_pool2d(x, kernel, stride if stride is not None else kernel)


@max_pool2d.rule
def _(x: SymTensor, kernel: int, stride: int | None = None) -> SymTensor:
    d = x.fixed_dims("max_pool2d")
    float_dtype(x, "max_pool2d")
    for a in d[1:-2]:  # torch refuses empty channels (an empty batch is fine)
        positive(a, "max_pool2d: the channels", x)
    s = as_poly(stride if stride is not None else kernel)
    k = as_poly(kernel)
    return _t(x, [*d[:-2], _conv_out(d[-2], k, s, Poly(), "max_pool2d", x),
                  _conv_out(d[-1], k, s, Poly(), "max_pool2d", x)])


# ----------------------------------------------------------------------------------- dtypes


@op("cast")
def cast(x: torch.Tensor, dtype: DType) -> torch.Tensor:
    return x.to(dtype.torch)


@cast.rule
def _(x: SymTensor, dtype: DType | DTypeVar) -> SymTensor:
    if not isinstance(dtype, DType | DTypeVar):
        raise ShapeError(f"cast to {dtype!r}: give a kestrel dtype (f32, i32...) or a dtype generic (self.T)")
    return _t(x, x.dims, dtype)  # exactly the named dtype


@op("arange_like")
def arange_like(x: torch.Tensor, n: int) -> torch.Tensor:
    """``[0, 1, ..., n-1]`` in the dtype and on the device of ``x``."""
    return torch.arange(n, dtype=x.dtype, device=x.device)


@arange_like.rule
def _(x: SymTensor, n: Any) -> SymTensor:
    numeric_dtype(x, "arange_like")
    return _t(x, [nonneg(as_poly(n), "arange_like: the length", x)])


@op("dim_like")
def dim_like(x: torch.Tensor, n: int) -> torch.Tensor:
    """The dimension ``n`` as a 0-d tensor in the dtype and on the device of ``x`` (to scale by a size)."""
    return torch.tensor(float(n), dtype=x.dtype, device=x.device)


@dim_like.rule
def _(x: SymTensor, n: Any) -> SymTensor:
    as_poly(n)
    return _t(x, [])


# ------------------------------------------------------------------------- tensor methods

METHODS.update({
    "add": add, "sub": sub, "mul": mul, "div": div, "matmul": matmul, "getitem": getitem,
    "reshape": reshape, "view": reshape, "permute": permute, "transpose": transpose, "flatten": flatten,
    "unsqueeze": unsqueeze, "squeeze": squeeze, "expand": expand, "softmax": softmax, "sum": sum_,
    "mean": mean, "amax": amax, "sigmoid": sigmoid, "relu": relu, "exp": exp, "sin": sin, "cos": cos,
    "tanh": tanh, "repeat": repeat,
    "contiguous": lambda x: x,
})


def _float(x: SymTensor) -> SymTensor:
    return cast(x, f32)


METHODS["float"] = _float

__all__ = [
    "add", "amax", "arange_like", "attention", "bmm", "cast", "cat", "conv1d", "conv2d", "conv_transpose2x2",
    "cos", "div", "embedding", "eq", "exp", "expand", "flatten", "gather", "gelu", "getitem", "interpolate",
    "l2_normalize", "layer_norm", "layer_norm_chw", "linear", "matmul", "max_pool2d", "mean", "mul", "pad",
    "permute", "relative_positions", "relu", "repeat", "reshape", "rms_norm", "sigmoid", "silu", "sin", "softmax",
    "split", "squeeze", "stack", "sub", "sum_", "tanh", "transpose", "unsqueeze", "view", "where",
]
