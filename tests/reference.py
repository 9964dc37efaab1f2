"""Shared helpers for parity tests against the transformers reference."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from transformers import Sam2Config, Sam2Model


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


# ----------------------------------------------------------------------------------------- SAM 2.1

SAM2_HD = 32


def small_config(image: int = 1024, hd: int = SAM2_HD, **backbone) -> dict:
    """A Sam2Config dict at small widths, Hiera-tiny's layout unless ``backbone`` says otherwise."""
    bb = dict(hidden_size=16, embed_dim_per_stage=[16, 32, 64, 128], num_attention_heads_per_stage=[1, 2, 2, 4],
              blocks_per_stage=[1, 2, 7, 2], window_size_per_stage=[8, 4, 14, 7], global_attention_blocks=[5, 7, 9],
              window_positional_embedding_background_size=[7, 7])
    bb.update(backbone)
    return at_size(dict(
        vision_config=dict(backbone_config=dict(bb, model_type="sam2_hiera_det_model"),
                           backbone_channel_list=list(reversed(bb["embed_dim_per_stage"])), fpn_hidden_size=hd),
        prompt_encoder_config=dict(hidden_size=hd),
        mask_decoder_config=dict(hidden_size=hd, num_attention_heads=2, mlp_dim=64, iou_head_hidden_dim=hd),
    ), image)


def at_size(config: dict, image: int) -> dict:
    """The config with ``image_size`` overridden, as the seed's 512 px recipe does."""
    cfg = copy.deepcopy(config)
    s = image // 4
    cfg["vision_config"]["backbone_config"]["image_size"] = [image, image]
    cfg["vision_config"]["backbone_feature_sizes"] = [[s, s], [s // 2, s // 2], [s // 4, s // 4]]
    cfg["prompt_encoder_config"]["image_size"] = image
    return cfg


def seeded_sam2(config: dict, seed: int = 0) -> Sam2Model:
    """A transformers Sam2Model with random weights everywhere (upstream zero-initialises the
    position tables and the no-memory embedding, which would hide them from the comparison)."""
    torch.manual_seed(seed)
    ref = Sam2Model(Sam2Config(**config)).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith(("pos_embed", "pos_embed_window", "no_memory_embedding")):
                p.normal_(0, 0.5)
            elif p.dim() >= 2:
                p.normal_(0, p[0].numel() ** -0.5)
            elif "norm" in name and name.endswith("weight"):
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("bias"):
                p.normal_(0, 0.02)
        for name, b in ref.named_buffers():
            if name.endswith("positional_embedding"):
                b.normal_(0, 1.0)
    return ref
