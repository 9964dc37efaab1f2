#!/usr/bin/env python
"""Accuracy of the reduced-precision options against Kestrel's f32 default, on the parity checkpoints.

For each model the script saves a transformers model built from the tests' small config with seeded
random weights (``save_pretrained``), loads it with Kestrel in f32 and with each fast path (``dtype="bf16"``;
``quantize="int8"``), and measures the fast path against f32 with :mod:`kestrel.pipelines.accuracy`, as each
family's users see its output (what ``kestrel bench DIR --dtype bf16 --accuracy`` prints for one model):

    cosine        feature cosine (DINOv2, SigLIP images, ViT features; SAM / SAM 2.1 image embeddings)
    text cosine   SigLIP's text embeddings
    top-1, top-5  class agreement (ViT)
    ranking       zero-shot ranking agreement (SigLIP): mean Spearman correlation of each image's scores over
                  the texts; "ranking top-1": the best text agrees
    mask IoU      post-processed masks (SAM, SAM 2.1), single-point prompts on seeded photo-like images
    rel diff      max |out - f32| / max |f32|

Random weights make these a lower bound of what trained checkpoints see (their activations are
better conditioned); real checkpoints cannot be downloaded here.

    python bench/accuracy.py                                  # the table, as the README shows it
    python bench/accuracy.py --out bench/results/accuracy.json  # also for the site's Benchmarks sections

int8 is measured with every marked linear in int8 (no per-shape race), so its row is the option's whole cost,
the same on every machine; where the race keeps f32 for a shape, users see less.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch


def _seeded(build: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    torch.manual_seed(0)
    model = build().eval()
    well_conditioned(model)
    return model


def well_conditioned(model: torch.nn.Module) -> None:
    """Every matrix std 1/sqrt(fan-in), norms and biases perturbed, SAM's and SAM 2.1's position tables drawn as
    released models have them: upstream initialises SAM's encoder with std 1e-10 and zero positions (denormal
    activations), and SAM 2.1's tables with zeros."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("rel_pos_h", "rel_pos_w", "pos_embed", "pos_embed_window", "no_memory_embedding")):
                p.normal_(0, 0.5)
            elif name.endswith("positional_embedding"):
                p.normal_(0, 1.0)
            elif p.dim() >= 2:
                p.normal_(0, p[0].numel() ** -0.5)
            elif "norm" in name and name.endswith("weight"):
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("bias"):
                p.normal_(0, 0.02)
        for name, b in model.named_buffers():  # SAM 2.1 keeps its Fourier features' table as a buffer
            if name.endswith("positional_embedding"):
                b.normal_(0, 1.0)


def models() -> dict[str, Callable[[], torch.nn.Module]]:
    import transformers as t

    def vit() -> torch.nn.Module:
        return t.ViTForImageClassification(t.ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                       intermediate_size=128, image_size=64, patch_size=16,
                                                       num_labels=100))

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

    def sam2() -> torch.nn.Module:
        # the tests' small SAM 2.1 (Hiera-tiny's layout at small widths), at the edge split's 512 px
        bb = dict(hidden_size=16, embed_dim_per_stage=[16, 32, 64, 128], num_attention_heads_per_stage=[1, 2, 2, 4],
                  blocks_per_stage=[1, 2, 7, 2], window_size_per_stage=[8, 4, 14, 7],
                  global_attention_blocks=[5, 7, 9], window_positional_embedding_background_size=[7, 7],
                  image_size=[512, 512], model_type="sam2_hiera_det_model")
        return t.Sam2Model(t.Sam2Config(
            vision_config=dict(backbone_config=bb, backbone_channel_list=[128, 64, 32, 16], fpn_hidden_size=32,
                               backbone_feature_sizes=[[128, 128], [64, 64], [32, 32]]),
            prompt_encoder_config=dict(hidden_size=32, image_size=512),
            mask_decoder_config=dict(hidden_size=32, num_attention_heads=2, mlp_dim=64, iou_head_hidden_dim=32)))

    return {"vit": vit, "dinov2": dino, "siglip": siglip, "sam": sam, "sam2": sam2}


OPTIONS = {"bf16": {"dtype": "bf16"}, "int8": {"quantize": "int8"}}


@contextlib.contextmanager
def int8_everywhere(option: str) -> Iterator[None]:
    """For int8, no per-shape race: every marked linear runs int8 (``KESTREL_CALIBRATE=0``), so the row is the
    option's whole cost and the same on every machine. With the race on, a machine where f32 wins some
    shapes keeps them exact and its users see at most this difference (the race then only changes speed)."""
    if option != "int8":
        yield
        return
    old = os.environ.get("KESTREL_CALIBRATE")
    os.environ["KESTREL_CALIBRATE"] = "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ["KESTREL_CALIBRATE"]
        else:
            os.environ["KESTREL_CALIBRATE"] = old


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16, help="items per model (segmenters: 4 images, 8 prompts each)")
    ap.add_argument("--models", default=None, help="comma list (default: all)")
    ap.add_argument("--out", type=Path, default=None, help="also write the rows as JSON (the site reads it)")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    import kestrel
    from kestrel.kernels.calibration import cpu_model
    from kestrel.pipelines import accuracy

    builders = models()
    names = args.models.split(",") if args.models else list(builders)
    print("| " + " | ".join(["model", "option", *accuracy.COLUMNS]) + " |")
    print("|" + " --- |" * (2 + len(accuracy.COLUMNS)))
    rows = []
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        for name in names:
            d = Path(tmp) / name
            _seeded(builders[name]).save_pretrained(d)
            ref = kestrel.load(d)
            for option, kw in OPTIONS.items():
                with int8_everywhere(option):
                    acc = accuracy.measure(ref, kestrel.load(d, **kw), batch=args.batch)
                print("| " + " | ".join(accuracy.row(name, option, acc)) + " |", flush=True)
                rows.append({"model": name, "family": ref.loaded.family.name, "option": option,
                             "inputs": acc.inputs, "metrics": acc.metrics})
    if args.out:
        args.out.write_text(json.dumps({
            "kind": "accuracy", "date": time.strftime("%Y-%m-%d"), "command": "python bench/accuracy.py",
            "machine": {"cpu": cpu_model(), "python": platform.python_version(), "torch": torch.__version__},
            "note": "the tests' small configs with seeded random weights, against Kestrel f32 on the same inputs; "
                    "int8 in every marked linear (no per-shape race)",
            "rows": rows}, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
