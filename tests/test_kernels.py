"""Kernel choices: the oneDNN linear for eager inference, F.linear everywhere else."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kestrel.std import ops

pytestmark = pytest.mark.skipif(not ops.USE_ONEDNN_LINEAR, reason="no oneDNN in this torch build")


def test_onednn_linear_matches_f_linear():
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(3, 50, 96, generator=g), torch.randn(200, 96, generator=g), torch.randn(200, generator=g)
    assert ops._onednn_ok(x, w)
    ours, ref = ops.linear(x, w, b), F.linear(x, w, b)
    assert ours.shape == ref.shape
    assert float((ours - ref).abs().max() / ref.abs().max()) < 1e-6
    assert float((ops.linear(x, w) - F.linear(x, w)).abs().max() / ref.abs().max()) < 1e-6


def test_autograd_tracing_and_other_dtypes_keep_f_linear():
    x, w = torch.randn(4, 8), torch.nn.Parameter(torch.randn(6, 8))
    assert not ops._onednn_ok(x, w)  # a weight that wants gradients
    y = ops.linear(x, w)
    y.sum().backward()
    assert w.grad is not None
    with torch.no_grad():
        assert ops._onednn_ok(x, w)
    assert not ops._onednn_ok(x.double(), w.double())
    assert not ops._onednn_ok(x.t(), torch.randn(6, 4))  # not contiguous

    compiled = torch.compile(_Linear(w.detach()), backend="aot_eager", fullgraph=True)
    assert torch.allclose(compiled(x), F.linear(x, w.detach()))
    graph = torch.export.export(_Linear(w.detach()), (x,)).graph
    targets = {str(n.target) for n in graph.nodes if n.op == "call_function"}
    assert not any("mkldnn" in t for t in targets), targets


class _Linear(torch.nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        return ops.linear(a, self.weight)
