"""Shared helpers for parity tests against the transformers reference."""

from __future__ import annotations

from pathlib import Path

import torch


def rel_diff(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max |ours - ref| relative to the largest reference value (DESIGN.md's parity measure)."""
    assert ours.shape == ref.shape, f"shapes differ: {tuple(ours.shape)} vs {tuple(ref.shape)}"
    return float((ours.float() - ref.float()).abs().max() / ref.float().abs().max())


def save_reference(model: torch.nn.Module, directory: Path) -> Path:
    """Save a seeded transformers model as a hub checkpoint would be laid out."""
    model.save_pretrained(directory)
    return directory


def seeded(build, seed: int = 0):
    """Build a reference model with deterministic random weights (LayerNorms and scales perturbed too)."""
    torch.manual_seed(seed)
    model = build()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "norm1.weight", "norm2.weight", "layernorm.weight",
                              "layernorm_before.weight", "layernorm_after.weight", "lambda1")):
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("bias"):
                p.normal_(0, 0.02)
    return model.eval()
