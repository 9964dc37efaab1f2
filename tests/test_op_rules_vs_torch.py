"""Every std op's shape rule against torch on random shapes, failures included.

For each op a table row draws random arguments (empty axes, wrong ranks, out-of-range axes, other
dtypes). The op runs in torch and its rule runs on the same shapes as constants. Whenever torch
raises, the rule must refuse; whenever the rule accepts, torch must return exactly its shapes and
dtypes. (The rule may refuse what torch runs: that is a missing capability, never a wrong answer,
but each row must accept some cases, so that it is tested at all.)
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
import torch

from kestrel.checker.graph import Graph
from kestrel.checker.symbolic import Context, ShapeError, SymTensor, checking
from kestrel.shapes import AtomOrder, Facts, Poly
from kestrel.std import ops
from kestrel.std.ops_attention import decomposed_attention
from kestrel.types import TensorType, from_torch

CASES = 50


def _sym(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return SymTensor(TensorType(tuple(Poly.const(s) for s in x.shape), from_torch(x.dtype)))
    if isinstance(x, list | tuple):
        return type(x)(_sym(i) for i in x)
    return x


def _types(out: Any) -> Any:
    if isinstance(out, tuple):
        return tuple(_types(o) for o in out)
    if isinstance(out, SymTensor):
        dims = []
        for d in out.dims:
            assert isinstance(d, Poly) and d.is_const, out
            dims.append(d.value)
        return tuple(dims), out.dtype.torch
    return tuple(out.shape), out.dtype


def compare(fn: Callable[..., Any], args: tuple, kwargs: dict) -> str:
    """"both", "refused" (the rule, torch too or not) or raise when the rule is wrong."""
    order = AtomOrder()
    try:
        with checking(Context(Facts(), order, Graph("t", "op", order))):
            predicted = _types(fn(*_sym(args), **{k: _sym(v) for k, v in kwargs.items()}))
    except ShapeError:
        predicted = None
    try:
        with torch.no_grad():
            got = _types(fn(*args, **kwargs))
    except Exception as e:  # torch refuses
        assert predicted is None, f"the rule accepts {predicted} where torch raises {type(e).__name__}: {e}"
        return "refused"
    if predicted is None:
        return "refused"
    assert predicted == got, f"the rule says {predicted}, torch returns {got}"
    return "both"


DTYPES = (torch.float32, torch.float32, torch.float32, torch.int64, torch.bool)


def t(rnd: random.Random, *shape: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    dtype = dtype or rnd.choice(DTYPES)
    if dtype == torch.bool:
        return torch.rand(tuple(shape)) > 0.5
    if dtype.is_floating_point:
        return torch.randn(tuple(shape), dtype=dtype)
    return torch.randint(0, 3, tuple(shape), dtype=dtype)


def dims(rnd: random.Random, low: int = 1, high: int = 4, rank: int | None = None) -> list[int]:
    return [rnd.randint(0, 3) for _ in range(rank if rank is not None else rnd.randint(low, high))]


def f32(rnd: random.Random, *shape: int) -> torch.Tensor:
    return t(rnd, *shape, dtype=torch.float32)


def axis(rnd: random.Random, rank: int) -> int:
    return rnd.randint(-rank - 1, rank)


def _binary(op):
    def draw(rnd):
        a = dims(rnd, 0, 3)
        b = a[rnd.randint(0, len(a)):] if rnd.random() < 0.5 else dims(rnd, 0, 3)
        b = [1 if rnd.random() < 0.2 else d for d in b]
        x, y = t(rnd, *a), t(rnd, *b)
        if rnd.random() < 0.5:
            y = (x.dtype == torch.float32 and rnd.random() < 0.5 and 1.5) or rnd.choice([2, 0.5, x])
        return op, (x, y), {}
    return draw


def _addcmul(rnd):
    """Three operands whose shapes broadcast or not (suffixes, ones, unrelated), dtypes mixed or not."""
    a = dims(rnd, 0, 3)
    shapes = [a] + [a[rnd.randint(0, len(a)):] if rnd.random() < 0.6 else dims(rnd, 0, 3) for _ in range(2)]
    shapes = [[1 if rnd.random() < 0.2 else d for d in s] for s in shapes]
    dtype = rnd.choice(DTYPES)
    return ops.addcmul, tuple(t(rnd, *s, dtype=dtype if rnd.random() < 0.8 else None) for s in shapes), {}


def _unary(op):
    return lambda rnd: (op, (t(rnd, *dims(rnd, 0, 3)),), {})


def _compare(op):
    return lambda rnd: (op, (t(rnd, *dims(rnd, 0, 3)), rnd.choice([0, 1.5, True])), {})


def _reduce(op):
    def draw(rnd):
        shape = dims(rnd, 1, 3)
        dim = axis(rnd, len(shape)) if rnd.random() < 0.6 else tuple(axis(rnd, len(shape)) for _ in range(2))
        return op, (t(rnd, *shape), dim), {"keepdim": rnd.random() < 0.5}
    return draw


def _linear(rnd):
    n_in, n_out = rnd.randint(0, 3), rnd.randint(0, 3)
    x = f32(rnd, *dims(rnd, 0, 2), n_in if rnd.random() < 0.8 else rnd.randint(0, 3))
    w = f32(rnd, n_out, n_in) if rnd.random() < 0.9 else f32(rnd, n_out, n_in, 1)
    b = rnd.choice([None, f32(rnd, n_out), f32(rnd, n_out + 1)])
    return ops.linear, (x, w, b), {}


def _linear_gelu(rnd):
    _, (x, w, b), _ = _linear(rnd)
    return ops.linear_gelu, (x, w, b), {"approximate": rnd.choice(["none", "tanh", "erf"])}


def _fused_linear(rnd):
    n_in = rnd.randint(1, 3)
    x = f32(rnd, 2, n_in)
    ws = [f32(rnd, rnd.randint(1, 3), n_in if rnd.random() < 0.85 else n_in + 1) for _ in range(rnd.randint(1, 3))]
    bs = [rnd.choice([None, f32(rnd, w.shape[0]), f32(rnd, w.shape[0] + 1)]) for w in ws]
    return ops.fused_linear, (x, ws, bs), {}


def _matmul(rnd):
    k = rnd.randint(0, 3)
    a = [*dims(rnd, 0, 2), rnd.randint(0, 3), k]
    b = [*dims(rnd, 0, 2), k if rnd.random() < 0.8 else rnd.randint(0, 3), rnd.randint(0, 3)]
    if rnd.random() < 0.2:
        b = [k]
    if rnd.random() < 0.1:
        a = [k]
    dt = rnd.choice([torch.float32, torch.float32, torch.int64])
    return ops.matmul, (t(rnd, *a, dtype=dt), t(rnd, *b, dtype=dt)), {}


def _conv2d(rnd):
    cin = rnd.randint(0, 3)
    x = f32(rnd, rnd.randint(0, 2), cin, rnd.randint(0, 6), rnd.randint(0, 6))
    w = f32(rnd, rnd.randint(0, 3), cin if rnd.random() < 0.85 else cin + 1, rnd.randint(0, 3), rnd.randint(0, 3))
    b = rnd.choice([None, f32(rnd, w.shape[0]), f32(rnd, w.shape[0] + 1)])
    return ops.conv2d, (x, w, b), {"stride": rnd.randint(1, 3), "padding": rnd.randint(0, 2)}


def _depthwise_conv2d(rnd):
    c = rnd.randint(0, 3)
    x = f32(rnd, rnd.randint(0, 2), c, rnd.randint(0, 6), rnd.randint(0, 6))
    w = f32(rnd, c if rnd.random() < 0.85 else c + 1, 1 if rnd.random() < 0.85 else 2, rnd.randint(0, 3),
            rnd.randint(0, 3))
    b = rnd.choice([None, f32(rnd, w.shape[0]), f32(rnd, w.shape[0] + 1)])
    return ops.depthwise_conv2d, (x, w, b), {"padding": rnd.randint(0, 2)}


def _conv1d(rnd):
    cin = rnd.randint(0, 3)
    x = f32(rnd, rnd.randint(0, 2), cin, rnd.randint(0, 6))
    w = f32(rnd, rnd.randint(0, 3), cin if rnd.random() < 0.85 else cin + 1, rnd.randint(0, 3))
    return ops.conv1d, (x, w, None), {"stride": rnd.randint(1, 3), "padding": rnd.randint(0, 2)}


def _conv_transpose(rnd):
    cin = rnd.randint(0, 3)
    x = f32(rnd, rnd.randint(0, 2), cin, rnd.randint(0, 3), rnd.randint(0, 3))
    w = f32(rnd, cin if rnd.random() < 0.85 else cin + 1, rnd.randint(0, 3), 2, rnd.choice([2, 2, 3]))
    b = rnd.choice([None, f32(rnd, w.shape[1])])
    return ops.conv_transpose2x2, (x, w, b), {}


def _interpolate(rnd):
    x = f32(rnd, *dims(rnd, rank=rnd.choice([3, 4, 4, 4])))
    kw: dict[str, Any] = {"mode": rnd.choice(["nearest", "bilinear", "bicubic"])}
    if rnd.random() < 0.7:
        kw["size"] = (rnd.randint(0, 4), rnd.randint(0, 4))
    if rnd.random() < 0.5 or "size" not in kw:
        kw["scale_factor"] = rnd.choice([1, 2, 3])
    return ops.interpolate, (x,), kw


def _max_pool(rnd):
    x = f32(rnd, *dims(rnd, rank=rnd.choice([3, 4, 4])), )
    x = f32(rnd, *([*list(x.shape[:-2]), rnd.randint(0, 6), rnd.randint(0, 6)]))
    return ops.max_pool2d, (x, rnd.randint(1, 3)), {"stride": rnd.choice([None, 1, 2])}


def _layer_norm(rnd):
    d = rnd.randint(0, 3)
    x = f32(rnd, *dims(rnd, 0, 2), d)
    w = rnd.choice([None, f32(rnd, d), f32(rnd, d + 1), f32(rnd, d, 2)])
    b = rnd.choice([None, f32(rnd, d)])
    return ops.layer_norm, (x, w, b), {}


def _layer_norm_chw(rnd):
    c = rnd.randint(0, 3)
    x = f32(rnd, rnd.randint(0, 2), c, rnd.randint(0, 2), rnd.randint(0, 2))
    w = rnd.choice([f32(rnd, c), f32(rnd, c + 1), f32(rnd, c, 1)])
    return ops.layer_norm_chw, (x, w, f32(rnd, c)), {}


def _rms_norm(rnd):
    d = rnd.randint(0, 3)
    x = f32(rnd, *dims(rnd, 0, 2), d)
    return ops.rms_norm, (x, rnd.choice([f32(rnd, d), f32(rnd, d + 1), f32(rnd, d, 2), f32(rnd, 1)])), {}


def _attention(rnd):
    b, n, m, e, ev = (rnd.randint(0, 3) for _ in range(5))
    batch = [b] if rnd.random() < 0.7 else [b, 2]
    q = f32(rnd, *batch, n, e)
    k = f32(rnd, *(batch if rnd.random() < 0.9 else [b + 1]), m, e if rnd.random() < 0.9 else e + 1)
    v = f32(rnd, *(batch if rnd.random() < 0.85 else [b + 1] * len(batch)), m if rnd.random() < 0.9 else m + 1, ev)
    bias = rnd.choice([None, None, f32(rnd, n, m), f32(rnd, 2, *batch, n, m), f32(rnd, 1, m), f32(rnd, n + 1, m)])
    return ops.attention, (q, k, v), {"bias": bias}


def _multihead(rnd):
    h = rnd.randint(1, 3)
    e = h * rnd.randint(1, 2) + (1 if rnd.random() < 0.15 else 0)
    q = f32(rnd, 2, rnd.randint(1, 3), e)
    k = f32(rnd, 2, rnd.randint(1, 3), e if rnd.random() < 0.9 else e + 1)
    v = f32(rnd, 2 if rnd.random() < 0.9 else 3, k.shape[1], h * rnd.randint(1, 2))
    m = k.shape[1]
    key_bias = rnd.choice([None, None, f32(rnd, 2, 1, m), f32(rnd, 2, q.shape[1], m), f32(rnd, 1, m),
                           f32(rnd, 2, 1, m + 1)])
    return ops.multihead_attention, (q, k, v, h), ({} if key_bias is None else {"key_bias": key_bias})


def _projected(rnd):
    h = rnd.randint(1, 3)
    width = h * rnd.randint(1, 2) + (1 if rnd.random() < 0.1 else 0)
    d = rnd.randint(1, 4)
    nq, nk = rnd.choice([(rnd.randint(1, 3), 40), (40, rnd.randint(1, 3)), (rnd.randint(1, 3), rnd.randint(1, 3))])
    q = f32(rnd, 2, nq, d)
    k = f32(rnd, 2, nk, d if rnd.random() < 0.9 else d + 1)
    v = f32(rnd, 2 if rnd.random() < 0.9 else 3, nk, d)
    vwidth = h * rnd.randint(1, 2)
    dout = rnd.randint(1, 3)

    def proj(n_out, n_in):
        w = f32(rnd, n_out, n_in if rnd.random() < 0.93 else n_in + 1)
        return w, rnd.choice([None, f32(rnd, n_out), f32(rnd, n_out) if rnd.random() < 0.9 else f32(rnd, n_out + 1)])

    projections = [proj(width, d), proj(width, d), proj(vwidth, d), proj(dout, vwidth)]
    key_bias = rnd.choice([None, None, f32(rnd, 2, 1, nk), f32(rnd, 2, nq, nk)])
    return ops.projected_attention, (q, k, v, h, projections), ({} if key_bias is None else {"key_bias": key_bias})


def _decomposed(rnd):
    kh, kw = rnd.randint(1, 3), rnd.randint(1, 3)
    n, d = rnd.randint(1, 4), rnd.randint(1, 4)
    q = f32(rnd, 2, n, d)
    k = f32(rnd, 2, kh * kw if rnd.random() < 0.9 else kh * kw + 1, d)
    v = f32(rnd, 2, k.shape[1], d)
    rel_h = f32(rnd, 2, n, kh)
    rel_w = f32(rnd, 2, n, kw if rnd.random() < 0.9 else kw + 1)
    return decomposed_attention, (q, k, v, rel_h, rel_w), {}


def _reshape(rnd):
    shape = dims(rnd, 1, 3)
    total = 1
    for s in shape:
        total *= s
    target = rnd.choice([[total], [-1], [1, -1], [total, 1], [2, -1], [-1, -1], [total + 1], [0, -1]])
    return ops.reshape, (t(rnd, *shape), *target), {}


def _view(rnd):
    _op, args, kw = _reshape(rnd)
    x, *target = args
    if rnd.random() < 0.5:
        return (lambda y, *s: y.contiguous().view(*s)), (x, *target), kw
    return (lambda y, *s: y.transpose(0, -1).view(*s)), (x, *target), kw


def _permute(rnd):
    shape = dims(rnd, 0, 3)
    order = list(range(len(shape)))
    rnd.shuffle(order)
    if rnd.random() < 0.3:
        order = [axis(rnd, len(shape)) for _ in order] + ([0] if rnd.random() < 0.3 else [])
    return ops.permute, (t(rnd, *shape), *order), {}


def _transpose(rnd):
    shape = dims(rnd, 1, 3)
    return ops.transpose, (t(rnd, *shape), axis(rnd, len(shape)), axis(rnd, len(shape))), {}


def _flatten(rnd):
    shape = dims(rnd, 0, 4)
    r = max(len(shape), 1)
    return ops.flatten, (t(rnd, *shape), axis(rnd, r), axis(rnd, r)), {}


def _unsqueeze(rnd):
    shape = dims(rnd, 0, 3)
    return ops.unsqueeze, (t(rnd, *shape), axis(rnd, len(shape) + 1)), {}


def _squeeze(rnd):
    shape = [rnd.choice([1, 1, 2]) for _ in range(rnd.randint(1, 3))]
    return ops.squeeze, (t(rnd, *shape), axis(rnd, len(shape))), {}


def _expand(rnd):
    shape = [rnd.choice([1, 1, 2, 0]) for _ in range(rnd.randint(1, 3))]
    target = [rnd.choice([s, 3, -1, 0]) if s == 1 else rnd.choice([s, s, -1, 3]) for s in shape]
    if rnd.random() < 0.3:
        target = [rnd.randint(0, 3), *target]
    return ops.expand, (t(rnd, *shape), *target), {}


def _cat(rnd):
    shape = dims(rnd, 1, 3)
    xs = []
    for _ in range(rnd.randint(1, 3)):
        s = list(shape)
        i = rnd.randrange(len(s))
        s[i] = rnd.randint(0, 3)
        if rnd.random() < 0.1:
            s = [*s, 1]
        xs.append(f32(rnd, *s))
    return ops.cat, (xs,), {"dim": axis(rnd, len(shape))}


def _stack(rnd):
    shape = dims(rnd, 0, 3)
    xs = [f32(rnd, *(shape if rnd.random() < 0.85 else [*shape, 1])) for _ in range(rnd.randint(1, 3))]
    return ops.stack, (xs,), {"dim": axis(rnd, len(shape) + 1)}


def _split(rnd):
    shape = dims(rnd, 1, 3)
    a = axis(rnd, len(shape))
    size = shape[a % len(shape)] if -len(shape) <= a < len(shape) else 2
    cut = rnd.randint(0, size)
    sizes = rnd.choice([[cut, size - cut], [size], [cut, size - cut + 1]])
    return ops.split, (f32(rnd, *shape), sizes), {"dim": a}


def _pad(rnd):
    shape = dims(rnd, 1, 3)
    pads = [rnd.randint(0, 2) for _ in range(2 * rnd.randint(1, len(shape) + 1))]
    if rnd.random() < 0.1:
        pads = pads[:-1]
    return ops.pad, (f32(rnd, *shape), pads), {}


def _repeat(rnd):
    shape = dims(rnd, 0, 3)
    times = [rnd.randint(0, 2) for _ in range(rnd.randint(max(len(shape) - 1, 0), len(shape) + 1))]
    return ops.repeat, (f32(rnd, *shape), *times), {}


def _getitem(rnd):
    shape = dims(rnd, 1, 3)
    parts: list[Any] = []
    for s in shape[: rnd.randint(1, len(shape))]:
        kind = rnd.choice(["slice", "int", "none", "neg"])
        if kind == "slice":
            parts.append(slice(rnd.choice([None, 0, 1]), rnd.choice([None, s, s + 1, 1, -1])))
        elif kind == "int":
            parts.append(rnd.randint(0, s))
        elif kind == "neg":
            parts.append(-rnd.randint(1, s + 1))
        else:
            parts.append(None)
    if rnd.random() < 0.3:
        parts.insert(rnd.randint(0, len(parts)), Ellipsis)
    return (lambda x, i: x[i]), (f32(rnd, *shape), tuple(parts)), {}


def _gather(rnd):
    table = f32(rnd, rnd.randint(1, 4), *dims(rnd, 0, 2))
    index = torch.randint(0, table.shape[0], tuple(dims(rnd, 0, 2)))
    return ops.gather, (table, index if rnd.random() < 0.85 else index.float()), {}


def _embedding(rnd):
    weight = f32(rnd, rnd.randint(1, 4), rnd.randint(0, 3))
    if rnd.random() < 0.15:
        weight = f32(rnd, 3)
    ids = torch.randint(0, weight.shape[0], tuple(dims(rnd, 0, 2)))
    return ops.embedding, (ids if rnd.random() < 0.9 else ids.float(), weight), {}


def _take_along(rnd):
    shape = dims(rnd, 1, 3)
    shape = [max(s, 1) for s in shape]
    a = axis(rnd, len(shape))
    ishape = list(shape)
    if -len(shape) <= a < len(shape):
        ishape[a] = rnd.randint(0, 3)
    if rnd.random() < 0.15:
        ishape[0] += 1
    index = torch.randint(0, 1, tuple(ishape))
    return ops.take_along, (f32(rnd, *shape), index, a), {}


def _relative(rnd):
    n = rnd.randint(1, 4)
    return ops.relative_positions, (f32(rnd, 2 * n - 1 if rnd.random() < 0.8 else 2 * n, rnd.randint(0, 3)), n), {}


def _grid_fourier(rnd):
    rows = 2 if rnd.random() < 0.8 else rnd.choice([1, 3])  # a [2, C] table, now and then a wrong one
    table = t(rnd, rows, rnd.randint(1, 4)) if rnd.random() < 0.8 else f32(rnd, 2, 3, 1)
    return ops.grid_fourier, (table, rnd.randint(1, 5)), {}


def _argmax(rnd):
    shape = dims(rnd, 1, 3)
    return ops.argmax, (f32(rnd, *shape), axis(rnd, len(shape))), {}


def _softmax(rnd):
    shape = dims(rnd, 1, 3)
    return ops.softmax, (t(rnd, *shape), axis(rnd, len(shape))), {}


def _where(rnd):
    a = dims(rnd, 0, 3)
    cond = t(rnd, *a, dtype=rnd.choice([torch.bool, torch.bool, torch.float32]))
    x = rnd.choice([f32(rnd, *a[rnd.randint(0, len(a)):]), 1.0, 0])
    y = rnd.choice([f32(rnd, *a), 2.0, t(rnd, *a, dtype=torch.int64)])
    return ops.where, (cond, x, y), {}


def _cast(rnd):
    from kestrel.types.dtypes import bf16, i64
    from kestrel.types.dtypes import f32 as kf32

    return ops.cast, (t(rnd, *dims(rnd, 0, 3)), rnd.choice([kf32, bf16, i64])), {}


def _gelu(op):
    return lambda rnd: (op, (t(rnd, *dims(rnd, 0, 3)),), {"approximate": rnd.choice(["none", "tanh", "erf"])})


TABLE: dict[str, Callable[[random.Random], tuple]] = {
    "add": _binary(ops.add), "sub": _binary(ops.sub), "mul": _binary(ops.mul), "div": _binary(ops.div),
    "addcmul": _addcmul,
    "relu": _unary(ops.relu), "sigmoid": _unary(ops.sigmoid), "silu": _unary(ops.silu), "tanh": _unary(ops.tanh),
    "exp": _unary(ops.exp), "sin": _unary(ops.sin), "cos": _unary(ops.cos), "abs": _unary(ops.abs_),
    "gelu": _gelu(ops.gelu), "gelu_": _gelu(ops.gelu_), "eq": _compare(ops.eq), "gt": _compare(ops.gt),
    "ge": _compare(ops.ge), "where": _where, "cast": _cast,
    "linear": _linear, "linear_gelu": _linear_gelu, "fused_linear": _fused_linear, "matmul": _matmul,
    "conv2d": _conv2d, "depthwise_conv2d": _depthwise_conv2d,
    "conv1d": _conv1d, "conv_transpose2x2": _conv_transpose, "interpolate": _interpolate,
    "max_pool2d": _max_pool, "layer_norm": _layer_norm, "layer_norm_chw": _layer_norm_chw, "rms_norm": _rms_norm,
    "l2_normalize": lambda rnd: (ops.l2_normalize, (t(rnd, *dims(rnd, 1, 3)),), {}), "softmax": _softmax,
    "attention": _attention, "multihead_attention": _multihead, "decomposed_attention": _decomposed,
    "projected_attention": _projected,
    "reshape": _reshape, "view": _view, "permute": _permute, "transpose": _transpose, "flatten": _flatten,
    "unsqueeze": _unsqueeze, "squeeze": _squeeze, "expand": _expand, "cat": _cat, "stack": _stack,
    "split": _split, "pad": _pad, "repeat": _repeat,
    "contiguous": lambda rnd: (ops.contiguous, (t(rnd, *dims(rnd, 0, 3)),), {}),
    "getitem": _getitem, "gather": _gather, "embedding": _embedding, "take_along": _take_along,
    "relative_positions": _relative, "grid_fourier": _grid_fourier,
    "arange_like": lambda rnd: (ops.arange_like, (t(rnd, 2), rnd.randint(0, 3)), {}),
    "dim_like": lambda rnd: (ops.dim_like, (f32(rnd, 2), rnd.randint(0, 3)), {}),
    "sum": _reduce(ops.sum_), "mean": _reduce(ops.mean), "amax": _reduce(ops.amax), "argmax": _argmax,
}


def test_the_table_covers_every_std_op():
    exported = {getattr(ops, n).op_name for n in ops.__all__ if hasattr(getattr(ops, n), "op_name")}
    assert exported - set(TABLE) == set(), exported - set(TABLE)


@pytest.mark.parametrize("name", sorted(TABLE))
def test_rule_agrees_with_torch(name):
    rnd = random.Random(name)
    torch.manual_seed(0)
    seen = {"both": 0, "refused": 0}
    for _ in range(CASES):
        fn, args, kwargs = TABLE[name](rnd)
        try:
            seen[compare(fn, args, kwargs)] += 1
        except AssertionError as e:
            raise AssertionError(f"{name}{tuple(_types(a) if isinstance(a, torch.Tensor) else a for a in args)} "
                                 f"{kwargs}: {e}") from None
    assert seen["both"] > 0, seen  # every row exercises the rule's acceptance too
