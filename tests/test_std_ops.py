"""The std ops: each kernel against a plain computation, each shape rule against the kernel's output.

``both(op, *args)`` runs the op twice: on torch tensors (the kernel) and, under a checker context,
on symbolic tensors of the same constant shapes (the rule). The rule's type must be the kernel's
actual shape and dtype. The numbers are compared with references written out here (einsum, unfold,
explicit softmax...) or with torch's own modules.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kestrel.blocks import Array, Block, Dim, Float, f32
from kestrel.checker.check import check_program
from kestrel.checker.graph import Graph
from kestrel.checker.symbolic import Context, ShapeError, SymTensor, checking
from kestrel.shapes import AtomOrder, Facts, Poly, evaluate
from kestrel.std import ops
from kestrel.std.nn import Conv1d, Conv2d, Conv2dRect, Embedding, Linear, RmsNorm
from kestrel.types import TensorType, from_torch

FAST = settings(max_examples=25, deadline=None)


def _context() -> Context:
    order = AtomOrder()
    return Context(Facts(), order, Graph("test", "op", order))


def _sym(x):
    if isinstance(x, torch.Tensor):
        return SymTensor(TensorType(tuple(Poly.const(s) for s in x.shape), from_torch(x.dtype)))
    if isinstance(x, list | tuple):
        return type(x)(_sym(i) for i in x)
    return x


def _concrete(t: SymTensor) -> tuple[tuple[int, ...], torch.dtype]:
    dims = []
    for d in t.dims:
        assert isinstance(d, Poly) and d.is_const, t
        dims.append(d.value)
    return tuple(dims), t.dtype.torch


def rule(fn, *args, **kwargs):
    """The rule's result types for constant-shaped inputs like ``args``."""
    with checking(_context()):
        out = fn(*(_sym(a) for a in args), **{k: _sym(v) for k, v in kwargs.items()})
        return tuple(_concrete(o) for o in out) if isinstance(out, tuple) else _concrete(out)


def both(fn, *args, **kwargs):
    """Run the kernel; assert the shape rule predicts its output's shape and dtype; return the output."""
    out = fn(*args, **kwargs)
    want = tuple((tuple(o.shape), o.dtype) for o in out) if isinstance(out, tuple) else (tuple(out.shape), out.dtype)
    assert rule(fn, *args, **kwargs) == want
    return out


def close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-5) -> None:
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def rand(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# ------------------------------------------------------------------------------ linear algebra


def test_linear():
    x, w, b = rand(2, 3, 5), rand(4, 5), rand(4)
    close(both(ops.linear, x, w, b), torch.einsum("bni,oi->bno", x, w) + b)
    close(both(ops.linear, x, w), torch.einsum("bni,oi->bno", x, w))
    v = rand(5)
    close(both(ops.linear, v, w, b), torch.mv(w, v) + b)
    with pytest.raises(ShapeError, match="contraction dimension differs: 5 vs 6"):
        rule(ops.linear, x, rand(4, 6))


@pytest.mark.parametrize(
    ("sa", "sb"),
    [((3, 4), (4, 5)), ((2, 3, 4), (2, 4, 5)), ((2, 1, 3, 4), (5, 4, 6)), ((4,), (4, 5)), ((3, 4), (4,)),
     ((4,), (4,))],
)
def test_matmul(sa, sb):
    a, b = rand(*sa), rand(*sb)
    out = both(ops.matmul, a, b)
    # reference: sum over the contraction axis of broadcast products
    a2 = a.unsqueeze(-2) if a.dim() == 1 else a
    b2 = b.unsqueeze(-1) if b.dim() == 1 else b
    ref = (a2.unsqueeze(-1) * b2.unsqueeze(-3)).sum(-2)
    if a.dim() == 1:
        ref = ref.squeeze(-2)
    if b.dim() == 1:
        ref = ref.squeeze(-1)
    close(out, ref)
    close(both(ops.bmm, a, b), ref)


def test_matmul_rejects_mismatches():
    with pytest.raises(ShapeError, match="contraction dimension differs"):
        rule(ops.matmul, rand(3, 4), rand(5, 6))
    with pytest.raises(ShapeError, match="matmul batch"):
        rule(ops.matmul, rand(2, 3, 4), rand(3, 4, 5))


# ---------------------------------------------------------------------------------- convolution


def _conv2d_ref(x, w, b, stride, pad):
    (sh, sw), (ph, pw) = stride, pad
    kh, kw = w.shape[2:]
    cols = F.unfold(x, (kh, kw), padding=(ph, pw), stride=(sh, sw))  # [B, Cin*kh*kw, L]
    oh = (x.shape[2] + 2 * ph - kh) // sh + 1
    ow = (x.shape[3] + 2 * pw - kw) // sw + 1
    out = (w.reshape(w.shape[0], -1) @ cols).reshape(x.shape[0], w.shape[0], oh, ow)
    return out + b[None, :, None, None] if b is not None else out


@FAST
@given(h=st.integers(3, 12), w=st.integers(3, 12), kh=st.integers(1, 3), kw=st.integers(1, 3),
       sh=st.integers(1, 3), sw=st.integers(1, 3), ph=st.integers(0, 2), pw=st.integers(0, 2),
       bias=st.booleans())
def test_conv2d(h, w, kh, kw, sh, sw, ph, pw, bias):
    x, wt = rand(2, 3, h, w), rand(4, 3, kh, kw)
    b = rand(4) if bias else None
    ref = _conv2d_ref(x, wt, b, (sh, sw), (ph, pw))
    close(both(ops.conv2d, x, wt, b, stride=(sh, sw), padding=(ph, pw)), ref, 1e-4)
    if kh == kw and sh == sw and ph == pw:  # the square spelling with int stride and padding
        close(both(ops.conv2d, x, wt, b, stride=sh, padding=ph), ref, 1e-4)


@FAST
@given(n=st.integers(3, 20), k=st.integers(1, 4), s=st.integers(1, 3), p=st.integers(0, 2), bias=st.booleans())
def test_conv1d(n, k, s, p, bias):
    assume(n + 2 * p >= k)  # the window fits
    x, wt = rand(2, 3, n), rand(5, 3, k)
    b = rand(5) if bias else None
    windows = F.pad(x, (p, p)).unfold(2, k, s)  # [B, Cin, L', k]
    ref = torch.einsum("bclk,ock->bol", windows, wt)
    if b is not None:
        ref = ref + b[None, :, None]
    close(both(ops.conv1d, x, wt, b, stride=s, padding=p), ref, 1e-4)


def test_conv_transpose2x2():
    x, w, b = rand(2, 3, 4, 5), rand(3, 6, 2, 2), rand(6)
    out = both(ops.conv_transpose2x2, x, w, b)
    # each input pixel writes a 2x2 block: out[b, o, 2i + di, 2j + dj] = sum_c x[b, c, i, j] w[c, o, di, dj]
    blocks = torch.einsum("bcij,cokl->boikjl", x, w).reshape(2, 6, 8, 10)
    close(out, blocks + b[None, :, None, None], 1e-5)
    close(both(ops.conv_transpose2x2, x, w), blocks, 1e-5)


# ------------------------------------------------------------------------------- normalisation


def test_layer_norm():
    x, w, b = rand(2, 3, 8), rand(8), rand(8)
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    ref = (x - mu) / torch.sqrt(var + 1e-6) * w + b
    close(both(ops.layer_norm, x, w, b, 1e-6), ref)
    close(both(ops.layer_norm, x, None, None, 1e-6), (x - mu) / torch.sqrt(var + 1e-6))
    with pytest.raises(ShapeError, match="layer_norm"):
        rule(ops.layer_norm, x, rand(7), rand(7))


def test_layer_norm_chw():
    x, w, b = rand(2, 6, 4, 5), rand(6), rand(6)
    ref = F.layer_norm(x.permute(0, 2, 3, 1), (6,), w, b, 1e-6).permute(0, 3, 1, 2)
    close(both(ops.layer_norm_chw, x, w, b), ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm(dtype):
    x, w = rand(3, 4, 8, dtype=dtype), rand(8, dtype=dtype)
    xf = x.float()
    ref = (w.float() * (xf / torch.sqrt((xf * xf).mean(-1, keepdim=True) + 1e-6)).to(dtype).float()).to(dtype)
    out = both(ops.rms_norm, x, w)
    assert out.dtype == dtype
    close(out.float(), ref.float(), 1e-5 if dtype == torch.float32 else 1e-2)


def test_embedding_and_gather():
    table = rand(10, 4)
    ids = torch.tensor([[1, 9, 0], [3, 3, 7]], dtype=torch.int32)
    out = both(ops.embedding, ids, table)
    ref = torch.stack([torch.stack([table[int(i)] for i in row]) for row in ids])
    close(out, ref)
    close(both(ops.gather, table, ids.long()), ref)
    with pytest.raises(ShapeError, match="integer"):
        rule(ops.embedding, rand(2, 3), table)


def test_softmax():
    x = rand(2, 3, 5)
    e = torch.exp(x - x.amax(1, keepdim=True))
    close(both(ops.softmax, x, 1), e / e.sum(1, keepdim=True))
    e = torch.exp(x)
    close(both(ops.softmax, x), e / e.sum(-1, keepdim=True))


# ----------------------------------------------------------------------------------- attention


def _explicit_attention(q, k, v, bias=None, mask=None, scale=None):
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = q @ k.transpose(-1, -2) * scale
    if bias is not None:
        s = s + bias
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, -1) @ v


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("with_mask", [False, True])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_attention(with_bias, with_mask, scale):
    q, k, v = rand(2, 3, 5, 8), rand(2, 3, 7, 8), rand(2, 3, 7, 6)
    bias = rand(3, 5, 7) if with_bias else None  # broadcast over the batch
    mask = torch.rand(2, 1, 5, 7) > 0.3 if with_mask else None
    if mask is not None:
        mask[..., 0] = True  # no fully masked row
    out = both(ops.attention, q, k, v, bias=bias, mask=mask, scale=scale)
    assert out.shape == (2, 3, 5, 6)
    close(out, _explicit_attention(q, k, v, bias, mask, scale), 1e-4)


def test_attention_rule_rejects_mismatches():
    q, k = rand(2, 5, 8), rand(2, 7, 8)
    with pytest.raises(ShapeError, match="key and value lengths differ"):
        rule(ops.attention, q, k, rand(2, 6, 8))
    with pytest.raises(ShapeError, match=r"the bias .* does not broadcast to the scores"):
        rule(ops.attention, q, k, rand(2, 7, 4), bias=rand(5, 6))


def _heads_attention(q, k, v, heads, key_bias=None):
    """The reference: per head, softmax(q_h k_h^T / sqrt(d) + key_bias) v_h, heads side by side."""
    outs = []
    for qh, kh, vh in zip(q.chunk(heads, -1), k.chunk(heads, -1), v.chunk(heads, -1)):
        scores = qh @ kh.transpose(-1, -2) / math.sqrt(qh.shape[-1])
        w = torch.softmax(scores if key_bias is None else scores + key_bias, dim=-1)
        outs.append(w @ vh)
    return torch.cat(outs, -1)


@pytest.mark.parametrize("nq,nk", [(300, 7), (7, 300), (5, 5)])  # few keys (per-head GEMMs, keys-major scores) or SDPA
def test_multihead_attention_on_unsplit_projections(nq, nk):
    q, k, v = rand(2, 1, nq, 32), rand(2, 1, nk, 32), rand(2, 1, nk, 16)
    want = _heads_attention(q, k, v, 4)
    with torch.inference_mode():
        out = both(ops.multihead_attention, q, k, v, 4)
    assert out.shape == (2, 1, nq, 16)
    close(out, want, 1e-5)
    g = q.clone().requires_grad_(True)  # autograd (and graphs) take SDPA on head views
    out = ops.multihead_attention(g, k, v, 4)
    close(out.detach(), want, 1e-5)
    out.sum().backward()
    assert g.grad is not None


@pytest.mark.parametrize("nq,nk", [(300, 7), (7, 300)])  # few keys (bias added to the scores) or SDPA's mask
def test_multihead_attention_with_a_key_bias(nq, nk):
    q, k, v = rand(2, 1, nq, 32), rand(2, 1, nk, 32), rand(2, 1, nk, 16)
    key_bias = rand(2, 1, 1, nk)
    key_bias[0, 0, 0, 3] = -1e9  # a padding key: no weight for any query of that image
    want = _heads_attention(q, k, v, 4, key_bias)
    with torch.inference_mode():
        out = both(ops.multihead_attention, q, k, v, 4, key_bias)
        unpadded = ops.multihead_attention(q[:1], torch.cat([k[:1, :, :3], k[:1, :, 4:]], 2),
                                           torch.cat([v[:1, :, :3], v[:1, :, 4:]], 2), 4,
                                           torch.cat([key_bias[:1, ..., :3], key_bias[:1, ..., 4:]], -1))
    close(out, want, 1e-5)
    close(out[:1], unpadded, 1e-5)  # the padded key is as if absent
    assert (out[1] - _heads_attention(q, k, v, 4)[1]).abs().max() > 1e-3  # the bias is applied
    g = q.clone().requires_grad_(True)  # graphs take SDPA with the bias as its mask
    close(ops.multihead_attention(g, k, v, 4, key_bias).detach(), want, 1e-5)


def test_multihead_attention_rule_checks_the_key_bias():
    q, k, v = rand(2, 5, 32), rand(2, 7, 32), rand(2, 7, 16)
    assert rule(ops.multihead_attention, q, k, v, 4, rand(2, 1, 7)) == ((2, 5, 16), torch.float32)
    for bad in (rand(2, 5, 7), rand(2, 1, 6), rand(1, 7), rand(3, 1, 7)):
        with pytest.raises(ShapeError, match=r"the key bias .* is not \[2, 1, 7\]"):
            rule(ops.multihead_attention, q, k, v, 4, bad)
    with pytest.raises(ShapeError, match="key bias"):
        rule(ops.multihead_attention, q, k, v, 4, rand(2, 1, 7, dtype=torch.float64))
    wrong = r"key bias has shape \(2, 5, 7\), expected \(2, 1, 7\)"
    with torch.inference_mode(), pytest.raises(ValueError, match=wrong):
        ops.multihead_attention(q, k, v, 4, rand(2, 5, 7))  # eager: a reshape would have taken it silently


@pytest.mark.parametrize("nq,nk", [(300, 7), (7, 300), (5, 5)])  # folded on either side, or projected
def test_projected_attention_is_its_composition(nq, nk):
    q, k, v = rand(2, 1, nq, 24), rand(2, 1, nk, 20), rand(2, 1, nk, 12)
    projections = [(rand(32, 24) / 5, rand(32)), (rand(32, 20) / 5, None), (rand(16, 12) / 4, rand(16)),
                   (rand(40, 16) / 4, rand(40))]
    (wq, bq), (wk, bk), (wv, bv), (wo, bo) = projections
    want = F.linear(_heads_attention(F.linear(q, wq, bq), F.linear(k, wk, bk), F.linear(v, wv, bv), 4), wo, bo)
    with torch.inference_mode():
        out = both(ops.projected_attention, q, k, v, 4, projections)
    assert out.shape == (2, 1, nq, 40)
    close(out, want, 1e-5)


def test_projected_attention_rule_names_the_projection_that_does_not_fit():
    q, k, v = rand(2, 5, 24), rand(2, 7, 20), rand(2, 7, 12)
    good = [(rand(32, 24), rand(32)), (rand(32, 20), None), (rand(16, 12), rand(16)), (rand(40, 16), rand(40))]
    assert rule(ops.projected_attention, q, k, v, 4, good) == ((2, 5, 40), torch.float32)
    key_error = r"key projection: linear: the contraction dimension differs: 20 vs 24 \(Tensor\[2, 7, 20; f32\]"
    with pytest.raises(ShapeError, match=key_error):
        rule(ops.projected_attention, q, k, v, 4, [good[0], (rand(32, 24), None), *good[2:]])
    with pytest.raises(ShapeError, match=r"output projection: linear: the contraction dimension differs: 16 vs 32"):
        rule(ops.projected_attention, q, k, v, 4, [*good[:3], (rand(40, 32), None)])
    with pytest.raises(ShapeError, match="cannot prove 3 heads divide the width 32"):
        rule(ops.projected_attention, q, k, v, 3, good)
    with pytest.raises(ShapeError, match="four"):
        rule(ops.projected_attention, q, k, v, 4, good[:3])
    with torch.inference_mode(), pytest.raises(ValueError, match=r"key bias has shape \(2, 5, 7\)"):
        ops.projected_attention(q, k, v, 4, good, rand(2, 5, 7))


def test_multihead_attention_rule_needs_the_heads_to_divide_the_widths():
    with pytest.raises(ShapeError, match="cannot prove 3 heads divide the width 32"):
        rule(ops.multihead_attention, rand(2, 5, 32), rand(2, 7, 32), rand(2, 7, 16), 3)
    with pytest.raises(ShapeError, match="key and value lengths differ"):
        rule(ops.multihead_attention, rand(2, 5, 32), rand(2, 7, 32), rand(2, 6, 16), 4)


# ---------------------------------------------------------------------------------- elementwise


def test_gelu():
    x = torch.linspace(-4, 4, 101)
    close(both(ops.gelu, x), 0.5 * x * (1 + torch.erf(x / math.sqrt(2))))
    tanh_form = 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    close(both(ops.gelu, x, approximate="tanh"), tanh_form)
    assert (ops.gelu(x) - ops.gelu(x, approximate="tanh")).abs().max() > 1e-5  # the two forms differ


def test_relu_sigmoid_silu():
    x = rand(3, 4)
    close(both(ops.relu, x), torch.where(x > 0, x, torch.zeros_like(x)))
    close(both(ops.sigmoid, x), 1 / (1 + torch.exp(-x)))
    close(both(ops.silu, x), x / (1 + torch.exp(-x)))
    with pytest.raises(ShapeError, match="floating-point"):
        rule(ops.relu, torch.ones(3, dtype=torch.int32))


def test_broadcast_add_mul():
    a, b = rand(2, 1, 4), rand(3, 1)
    ref_add = torch.tensor([[[a[i, 0, k].item() + b[j, 0].item() for k in range(4)] for j in range(3)]
                            for i in range(2)])
    close(both(ops.add, a, b), ref_add)
    close(both(lambda x, y: x + y, a, b), ref_add)
    close(both(lambda x, y: x * y, a, b), a.expand(2, 3, 4) * b.expand(2, 3, 4))
    close(both(ops.mul, a, 2.0), a + a)
    close(both(ops.sub, a, b), a - b)
    close(both(ops.div, a, 4.0), a * 0.25)
    with pytest.raises(ShapeError, match="cannot broadcast"):
        rule(ops.add, rand(2, 3), rand(4, 3))
    with pytest.raises(ShapeError, match="dtype i32 vs f32"):
        rule(ops.add, torch.ones(3, dtype=torch.int32), rand(3))


def test_addcmul_is_the_residual_plus_the_scaled_branch():
    x, branch, scale = rand(2, 5, 8), rand(2, 5, 8), rand(8)
    out = both(ops.addcmul, x, branch, scale)
    exact = (x.double() + branch.double() * scale.double()).float()
    close(out, exact, tol=1e-6)  # the product may be fused into the add: one rounding, not two
    assert both(ops.addcmul, rand(5, 1), rand(3, 1, 4), rand(4)).shape == (3, 5, 4)  # all three broadcast
    with pytest.raises(ShapeError, match="cannot broadcast"):
        rule(ops.addcmul, rand(2, 8), rand(2, 8), rand(7))
    with pytest.raises(ShapeError, match="cannot broadcast"):
        rule(ops.addcmul, rand(3, 8), rand(2, 8), rand(8))
    with pytest.raises(ShapeError, match="dtype"):
        rule(ops.addcmul, rand(8), rand(8), rand(8, dtype=torch.float64))
    with pytest.raises(ShapeError, match="three tensors"):
        rule(ops.addcmul, rand(8), rand(8), 2.0)


# ---------------------------------------------------------------------------------- layout ops


def test_reshape_permute_transpose_flatten():
    x = torch.arange(24.0).reshape(2, 3, 4)
    out = both(ops.reshape, x, 6, 4)
    assert out[1, 2].item() == 6.0 and out[5, 3].item() == 23.0  # row-major order
    both(ops.reshape, x, 2, -1)
    both(ops.reshape, x, [4, -1, 2])
    both(lambda t: t.contiguous().view(3, 8), x)
    with pytest.raises(ShapeError, match="use reshape"):  # an input's layout is unknown
        rule(lambda t: t.view(3, 8), x)
    with pytest.raises(ShapeError, match="use reshape"):  # torch refuses this one
        rule(lambda t: t.transpose(0, 1).view(12, 2), x)
    with pytest.raises(RuntimeError):
        x.transpose(0, 1).view(12, 2)
    with pytest.raises(ShapeError, match="element counts"):
        rule(ops.reshape, x, 5, 5)
    with pytest.raises(ShapeError, match="divides"):
        rule(ops.reshape, x, 5, -1)

    p = both(ops.permute, x, 2, 0, 1)
    assert p[3, 1, 2].item() == x[1, 2, 3].item()
    both(lambda t: t.permute(0, -1, 1), x)
    t = both(ops.transpose, x, 0, -1)
    assert t[3, 2, 1].item() == x[1, 2, 3].item()
    f = both(ops.flatten, x, 1)
    assert f.shape == (2, 12) and f[1, 11].item() == 23.0
    both(ops.flatten, x)
    both(ops.flatten, rand(2, 3, 4, 5), 1, 2)


def test_unsqueeze_squeeze_expand():
    x = rand(3, 1, 4)
    assert both(ops.unsqueeze, x, 0).shape == (1, 3, 1, 4)
    assert both(ops.unsqueeze, x, -1).shape == (3, 1, 4, 1)
    assert both(ops.unsqueeze, x, 2).shape == (3, 1, 1, 4)
    close(both(ops.squeeze, x, 1), x[:, 0])
    with pytest.raises(ShapeError, match="not of size 1"):
        rule(ops.squeeze, x, 0)
    e = both(ops.expand, x, 3, 5, 4)
    close(e[:, 3], x[:, 0])
    e2 = both(ops.expand, x, 2, -1, 5, -1)
    close(e2[1, :, 4], x[:, 0])
    with pytest.raises(ShapeError, match="expand"):
        rule(ops.expand, x, 2, 5, 4)


def test_cat_stack_split():
    a, b = rand(2, 3), rand(2, 5)
    c = both(ops.cat, [a, b], dim=1)
    close(c[:, :3], a)
    close(c[:, 3:], b)
    both(ops.cat, [a, a, a], dim=0)
    with pytest.raises(ShapeError, match="axis 1 differs"):
        rule(ops.cat, [a, b], dim=0)
    s = both(ops.stack, [a, a * 2], dim=1)
    assert s.shape == (2, 2, 3)
    close(s[:, 1], a * 2)
    assert both(ops.stack, [a, a], dim=-1).shape == (2, 3, 2)
    with pytest.raises(ShapeError, match="stack"):
        rule(ops.stack, [a, rand(2, 3, 1)])
    with pytest.raises(ShapeError, match="stack"):
        rule(ops.stack, [a, b])
    x = rand(2, 10)
    parts = both(ops.split, x, [3, 7], dim=1)
    close(parts[0], x[:, :3])
    close(parts[1], x[:, 3:])
    parts = both(ops.split, x, [1, 1], dim=0)
    close(parts[1][0], x[1])
    with pytest.raises(ShapeError, match="do not add up"):
        rule(ops.split, x, [3, 3], dim=1)


def _slices(n):
    bound = st.integers(0, n)
    return st.one_of(
        st.integers(0, n - 1), st.integers(-n, -1),
        st.tuples(bound, bound, st.sampled_from([None, 1, 2, 3])).filter(lambda t: t[0] <= t[1]).map(
            lambda t: slice(t[0], t[1], t[2])),
        st.just(slice(None)),
    )


@FAST
@given(st.tuples(_slices(4), _slices(5)), st.sampled_from([None, 0, 1, 2]), st.booleans())
def test_slicing(index, new_axis_at, ellipsis):
    x = torch.arange(2 * 4 * 5.0).reshape(2, 4, 5)
    items = list(index)
    if new_axis_at is not None:  # a None adds an axis without using one up
        items.insert(new_axis_at, None)
    idx = (Ellipsis, *items) if ellipsis else (slice(None), *items)
    out = both(lambda t: t[idx], x)
    close(out, x[idx])


def test_slicing_out_of_range_is_an_error():
    x = rand(2, 4)
    with pytest.raises(ShapeError, match="index 4 may be out of range"):
        rule(lambda t: t[:, 4], x)
    with pytest.raises(ShapeError, match="may be outside"):
        rule(lambda t: t[:, 5:], x)
    assert rule(lambda t: t[:, -4], x) == ((2,), torch.float32)
    with pytest.raises(ShapeError, match="out of range"):
        rule(lambda t: t[:, -5], x)


def test_pad():
    x = rand(2, 3, 4)
    out = both(ops.pad, x, [1, 2], value=-1.0)
    assert out.shape == (2, 3, 7)
    close(out[..., 1:5], x)
    assert (out[..., 0] == -1).all() and (out[..., 5:] == -1).all()
    out = both(ops.pad, x, [0, 1, 2, 0])
    assert out.shape == (2, 5, 5)
    close(out[:, 2:, :4], x)
    assert (out[:, :2] == 0).all() and (out[..., 4] == 0).all()


# ---------------------------------------------------------------------------------- reductions


def test_sum_and_mean():
    x = rand(2, 3, 4)
    ref = torch.tensor([[sum(x[i, :, k].tolist()) for k in range(4)] for i in range(2)])
    close(both(ops.sum_, x, 1), ref)
    close(both(ops.sum_, x, 1, keepdim=True), ref[:, None])
    close(both(ops.mean, x, [0, 2]), torch.tensor([x[:, j].sum().item() / 8 for j in range(3)]))
    close(both(ops.mean, x, -1, keepdim=True), x.sum(-1, keepdim=True) / 4)
    close(both(lambda t: t.mean(1), x), ref / 3)
    close(both(lambda t: t.sum(0), x), x[0] + x[1])


# ---------------------------------------------------------------------------------- resampling


def test_interpolate_nearest():
    x = rand(1, 2, 3, 5)
    out = both(ops.interpolate, x, size=(7, 4), mode="nearest")
    # torch's nearest: source index floor(dst * in / out)
    rows = [math.floor(i * 3 / 7) for i in range(7)]
    cols = [math.floor(j * 5 / 4) for j in range(4)]
    close(out, x[:, :, rows][:, :, :, cols])
    up = both(ops.interpolate, x, scale_factor=2, mode="nearest")
    close(up, x.repeat_interleave(2, 2).repeat_interleave(2, 3))


def test_interpolate_bilinear_and_bicubic():
    ramp = torch.arange(5.0).reshape(1, 1, 1, 5).expand(1, 1, 4, 5).contiguous()
    out = both(ops.interpolate, ramp, size=(4, 9), mode="bilinear", align_corners=True)
    close(out[0, 0, 0], torch.linspace(0, 4, 9))  # corners aligned: a ramp stays a ramp
    x = rand(2, 3, 6, 7)
    for mode in ("bilinear", "bicubic"):
        for align in (False, True):
            ref = F.interpolate(x, size=(9, 4), mode=mode, align_corners=align)
            close(both(ops.interpolate, x, size=(9, 4), mode=mode, align_corners=align), ref)
        ref = F.interpolate(x, size=(3, 4), mode=mode, align_corners=False, antialias=True)
        got = both(ops.interpolate, x, size=(3, 4), mode=mode, align_corners=False, antialias=True)
        close(got, ref)
        plain = ops.interpolate(x, size=(3, 4), mode=mode, align_corners=False)
        assert (got - plain).abs().max() > 1e-3  # the antialias flag reaches the kernel
    with pytest.raises(ShapeError, match="mode"):
        rule(ops.interpolate, x, size=(3, 3), mode="area")


@FAST
@given(h=st.integers(2, 11), w=st.integers(2, 11), k=st.integers(1, 3), s=st.sampled_from([None, 1, 2, 3]))
def test_max_pool2d(h, w, k, s):
    assume(k <= min(h, w))
    x = rand(2, 3, h, w)
    out = both(ops.max_pool2d, x, k, s)
    st_ = s if s is not None else k
    ref = x.unfold(2, k, st_).unfold(3, k, st_).amax((-1, -2))
    close(out, ref)


# ------------------------------------------------------------------------------- the std blocks


def _init(m: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p))


def _declared_dims(block: torch.nn.Module, fn: str, **dims: int) -> list[int]:
    decl = type(block).decl()
    f = decl.function(fn)
    assert f is not None
    binding = {k: v for k, v in block.generics.items() if isinstance(v, int)} | dims
    return [evaluate(d, binding) for d in f.result.dims]


@pytest.mark.parametrize("bias", [True, False])
def test_linear_block(bias):
    m = Linear(In=5, Out=3, T="f32")
    _init(m)
    if not bias:
        m.drop_optional("bias")
    assert set(m.state_dict()) == ({"weight", "bias"} if bias else {"weight"})
    ref = torch.nn.Linear(5, 3, bias=bias)
    ref.load_state_dict(m.state_dict())
    x = rand(2, 4, 5)
    close(m(x), ref(x))


def test_conv_blocks():
    m = Conv2d(Cin=3, Cout=4, K=3, Stride=2, Pad=1, T="f32")
    _init(m)
    assert set(m.state_dict()) == {"weight", "bias"}
    ref = torch.nn.Conv2d(3, 4, 3, stride=2, padding=1)
    ref.load_state_dict(m.state_dict())
    x = rand(2, 3, 11, 8)
    out = m(x)
    close(out, ref(x), 1e-4)
    assert list(out.shape) == _declared_dims(m, "forward", B=2, H=11, W=8)

    m = Conv2dRect(Cin=3, Cout=4, KH=3, KW=5, StrideH=1, StrideW=2, PadH=1, PadW=2, T="f32")
    _init(m)
    ref = torch.nn.Conv2d(3, 4, (3, 5), stride=(1, 2), padding=(1, 2))
    ref.load_state_dict(m.state_dict())
    x = rand(2, 3, 9, 10)
    out = m(x)
    close(out, ref(x), 1e-4)
    assert list(out.shape) == _declared_dims(m, "forward", B=2, H=9, W=10)

    m = Conv1d(Cin=3, Cout=4, K=3, Stride=2, Pad=1, T="f32")
    _init(m)
    m.drop_optional("bias")
    assert set(m.state_dict()) == {"weight"}
    ref = torch.nn.Conv1d(3, 4, 3, stride=2, padding=1, bias=False)
    ref.load_state_dict(m.state_dict())
    x = rand(2, 3, 13)
    out = m(x)
    close(out, ref(x), 1e-4)
    assert list(out.shape) == _declared_dims(m, "forward", B=2, L=13)


def test_rms_norm_and_embedding_blocks():
    m = RmsNorm(H=6, T="f32")
    _init(m)
    assert set(m.state_dict()) == {"weight"}
    ref = torch.nn.RMSNorm(6, eps=1e-6)
    ref.load_state_dict(m.state_dict())
    x = rand(2, 3, 6)
    close(m(x), ref(x))

    m = Embedding(Vocab=10, H=4, T="f32")
    _init(m)
    assert set(m.state_dict()) == {"weight"}
    ref = torch.nn.Embedding(10, 4)
    ref.load_state_dict(m.state_dict())
    ids = torch.tensor([[0, 9, 4]], dtype=torch.int32)
    close(m(ids), ref(ids.long()))
    assert m.weight.dtype == torch.float32 and Embedding(Vocab=2, H=2).weight.dtype == torch.bfloat16


class Stack(Block, module="test.std"):
    D: Dim
    N: Dim
    T: Float = f32

    layers: Array[Linear["D, D, T"], "N"]
    head: Linear["D, 2, T"]


def test_nested_parameter_paths():
    m = Stack(D=3, N=2)
    assert {k: tuple(v.shape) for k, v in m.state_dict().items()} == {
        "layers.0.weight": (3, 3), "layers.0.bias": (3,), "layers.1.weight": (3, 3), "layers.1.bias": (3,),
        "head.weight": (2, 3), "head.bias": (2,),
    }


@pytest.mark.parametrize("block", [Linear, Conv1d, Conv2d, Conv2dRect, RmsNorm, Embedding])
def test_std_blocks_check_clean(block):
    report = check_program(block)
    assert report.ok, "\n".join(map(str, report.diagnostics))


class _VariadicAxes(Block, module="test.variadic"):
    D: Dim
    T: Float = f32

    def last(self, x: "Tensor[*S, D; T]") -> "Tensor[*S, D; T]":
        return ops.softmax(x, dim=-1)

    def hidden(self, x: "Tensor[*S, D; T]") -> "Tensor[*S, D; T]":
        return ops.softmax(x, dim=0)


def test_axes_through_a_variadic_run():
    from kestrel.checker.check import check_block_class

    report = check_block_class(_VariadicAxes)
    assert [d.function for d in report.diagnostics] == ["hidden"]
    assert "axis 0 of Tensor[*S, D; T] is hidden by the variadic run *S" in report.diagnostics[0].message


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_in_place_on_a_temporary_in_inference_out_of_place_under_autograd(approximate):
    x = torch.randn(4, 9)
    want = F.gelu(x, approximate=approximate)
    t = x.clone()
    with torch.inference_mode():
        y = ops.gelu_(t, approximate=approximate)
    assert y.data_ptr() == t.data_ptr()  # the temporary was reused
    if approximate == "none":
        assert torch.equal(y, want)
    else:  # computed as x * sigmoid(2u): as close to float64 as torch's tanh form
        exact = F.gelu(x.double(), approximate="tanh")
        assert (y.double() - exact).abs().max() <= 4 * (want.double() - exact).abs().max() + 1e-7
    g = x.clone().requires_grad_(True)
    y = ops.gelu_(g, approximate=approximate)
    assert y.data_ptr() != g.data_ptr() and torch.equal(y.detach(), want)
    y.sum().backward()
    assert g.grad is not None
    assert both(ops.gelu_, torch.randn(2, 3)).shape == (2, 3)


def test_tanh_gelu_in_cache_sized_steps_covers_every_element(monkeypatch):
    from kestrel.kernels import activations as kernels

    monkeypatch.setattr(kernels, "GELU_CHUNK", 1000)
    x = torch.randn(7, 501) * 4  # 3507 elements: three whole steps and a ragged one
    exact = F.gelu(x.double(), approximate="tanh")
    y = kernels.gelu_tanh_(x.clone())
    assert float((y.double() - exact).abs().max() / exact.abs().max()) < 1e-7
    strided = torch.randn(6, 8).t()  # not contiguous: torch's own op, still in place
    want = F.gelu(strided, approximate="tanh")
    assert torch.equal(kernels.gelu_tanh_(strided), want)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_in_place_runs_over_a_permuted_layout_as_one_flat_vector(approximate, monkeypatch):
    from kestrel.kernels import activations as kernels

    x = torch.randn(2, 8, 5, 6).contiguous(memory_format=torch.channels_last)  # SAM's upscaling hands these over
    exact = F.gelu(x.double(), approximate=approximate)
    seen = []
    real = torch.ops.aten.gelu_
    monkeypatch.setattr(torch.ops.aten, "gelu_", lambda t, **kw: seen.append(t.shape) or real(t, **kw))
    with torch.inference_mode():
        y = ops.gelu_(t := x.clone(memory_format=torch.preserve_format), approximate=approximate)
    assert y is t and y.stride() == x.stride()  # in place, the layout kept
    assert float((y.double() - exact).abs().max() / exact.abs().max()) < 1e-6
    if approximate == "none":
        assert seen == [(x.numel(),)]  # one flat pass, not the permuted axes
    overlapping = torch.randn(3, 1).expand(3, 4)  # no flat view: torch's op on the tensor as it is
    assert kernels.memory_order_view(overlapping) is None
    assert kernels.memory_order_view(torch.randn(4, 6)[:, :3]) is None  # gaps
    p = torch.randn(3, 4, 5).permute(2, 0, 1)
    assert torch.equal(kernels.memory_order_view(p), p.permute(1, 2, 0).reshape(-1))


def test_kept_reuses_a_subs_result_only_for_the_same_unwritten_input():
    sub = torch.nn.Linear(4, 3)
    runs = []
    sub.register_forward_hook(lambda *a: runs.append(1))
    x = rand(5, 4)
    with torch.no_grad():
        y = ops.kept(sub, x)
        assert ops.kept(sub, x) is y and len(runs) == 1
        sub.weight.mul_(2.0)  # the sub's parameters written to: made again
        close(ops.kept(sub, x), sub(x))
        runs.clear()
        x.add_(1.0)  # the input written to: made again
        close(ops.kept(sub, x), sub(x))
        assert len(runs) == 2
    g = x.clone().requires_grad_(True)  # autograd: every call runs the sub
    ops.kept(sub, g).sum().backward()
    ops.kept(sub, g)
    assert g.grad is not None and len(runs) == 4
