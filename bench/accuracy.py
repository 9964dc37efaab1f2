#!/usr/bin/env python
"""Accuracy of the reduced-precision options against Kestrel's f32 default, on the parity checkpoints.

For each model the script saves a transformers model built from the tests' small config with seeded
random weights (``save_pretrained``), loads it with Kestrel three times (f32; ``dtype="bf16"``;
``quantize="int8"``), runs the same seeded inputs and compares each with f32:

    cosine     mean cosine similarity of the output feature vectors (per token / per item)
    top-1      share of items whose arg-max class agrees with f32 (classifier logits)
    mask IoU   IoU of the thresholded (> 0) masks against f32 (SAM decoder)
    rel diff   max |out - f32| / max |f32|

Random weights make these a lower bound of what trained checkpoints see (their activations are
better conditioned); real checkpoints cannot be downloaded here.

    python bench/accuracy.py                 # the table, as the README shows it
    python bench/accuracy.py --batch 32
"""

from __future__ import annotations

import argparse
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F


def _seeded(build: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    torch.manual_seed(0)
    model = build().eval()
    well_conditioned(model)
    return model


def well_conditioned(model: torch.nn.Module) -> None:
    """Every matrix std 1/sqrt(fan-in), norms and biases perturbed, SAM's positions drawn as released models have
    them: upstream initialises SAM's encoder with std 1e-10 and zero positions (denormal activations)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("rel_pos_h", "rel_pos_w", "pos_embed")):
                p.normal_(0, 0.5)
            elif name.endswith("positional_embedding"):
                p.normal_(0, 1.0)
            elif p.dim() >= 2:
                p.normal_(0, p[0].numel() ** -0.5)
            elif "norm" in name and name.endswith("weight"):
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("bias"):
                p.normal_(0, 0.02)


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(F.cosine_similarity(a.float().flatten(0, -2), b.float().flatten(0, -2), dim=-1).mean())


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def models() -> dict[str, tuple[Callable[[], torch.nn.Module], Callable[[Any, int, torch.dtype], dict[str, Any]]]]:
    import transformers as t

    def vit() -> torch.nn.Module:
        return t.ViTForImageClassification(t.ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                       intermediate_size=128, image_size=64, patch_size=16,
                                                       num_labels=7))

    def dino() -> torch.nn.Module:
        return t.Dinov2Model(t.Dinov2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, mlp_ratio=4,
                                            image_size=56, patch_size=14))

    def siglip() -> torch.nn.Module:
        return t.SiglipModel(t.SiglipConfig(
            vision_config=dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                               image_size=32, patch_size=8),
            text_config=dict(vocab_size=1000, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                             num_attention_heads=2, max_position_embeddings=16)))

    def sam() -> torch.nn.Module:
        return t.SamModel(t.SamConfig(
            vision_config=dict(hidden_size=32, num_attention_heads=2, mlp_dim=64, output_channels=32,
                               num_pos_feats=16),
            prompt_encoder_config=dict(hidden_size=32),
            mask_decoder_config=dict(hidden_size=32, num_attention_heads=2, mlp_dim=64, iou_head_hidden_dim=32)))

    def images(size: int) -> Callable[[Any, int, torch.dtype], dict[str, Any]]:
        def run(m: Any, batch: int, dt: torch.dtype) -> dict[str, Any]:
            g = torch.Generator().manual_seed(1)
            x = torch.randn(batch, 3, size, size, generator=g).to(dt)
            out = {"features": m.features(x) if hasattr(m, "features") else m.forward(x)}
            if hasattr(m, "features"):
                out["logits"] = m.forward(x)
            return out
        return run

    def run_siglip(m: Any, batch: int, dt: torch.dtype) -> dict[str, Any]:
        g = torch.Generator().manual_seed(1)
        x = torch.randn(batch, 3, 32, 32, generator=g).to(dt)
        tokens = torch.randint(0, 1000, (batch, 16), generator=g, dtype=torch.int32)
        return {"features": m.image_features(x), "text": m.text_features(tokens)}

    def run_sam(m: Any, batch: int, dt: torch.dtype) -> dict[str, Any]:
        g = torch.Generator().manual_seed(1)
        b = min(batch, 2)
        x = torch.randn(b, 3, 1024, 1024, generator=g).to(dt)
        emb = m.encode_image(x)
        points = (torch.rand(b, 1, 1, 2, generator=g) * 1024).to(dt)
        masks, _ = m.decode_points(emb, points, torch.ones(b, 1, 1, dtype=torch.int32))
        return {"features": emb.flatten(2).transpose(1, 2), "masks": masks}

    return {"vit": (vit, images(64)), "dinov2": (dino, images(56)), "siglip": (siglip, run_siglip),
            "sam": (sam, run_sam)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16, help="items per model (SAM: 2)")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    import kestrel

    print("| model | option | cosine | top-1 | mask IoU | rel diff |")
    print("| --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        for name, (build, run) in models().items():
            d = Path(tmp) / name
            _seeded(build).save_pretrained(d)
            ref = run(kestrel.load(d), args.batch, torch.float32)
            for option, kw, dt in (("bf16", {"dtype": "bf16"}, torch.bfloat16),
                                   ("int8", {"quantize": "int8"}, torch.float32)):
                try:
                    out = run(kestrel.load(d, **kw), args.batch, dt)
                except Exception as e:  # an option a model does not support is a row saying so
                    print(f"| {name} | {option} | error: {type(e).__name__}: {str(e)[:60]} | | | |")
                    continue
                cos = min(_cos(out[k], ref[k]) for k in ("features", "text") if k in ref)
                top1 = "-"
                if "logits" in ref:
                    top1 = f"{float((out['logits'].argmax(-1) == ref['logits'].argmax(-1)).float().mean()):.3f}"
                iou = "-"
                if "masks" in ref:
                    a, b = out["masks"].float() > 0, ref["masks"] > 0
                    iou = f"{float((a & b).sum() / (a | b).sum().clamp_min(1)):.3f}"
                rel = max(_rel(out[k], ref[k]) for k in ref)
                print(f"| {name} | {option} | {cos:.5f} | {top1} | {iou} | {rel:.1e} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
