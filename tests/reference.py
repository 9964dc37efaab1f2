"""Helpers the test modules share: reference models built from configs with seeded weights, checkpoints, data."""

from __future__ import annotations

import copy
import hashlib
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import transformers
from PIL import Image
from transformers import BitImageProcessor, Dinov2Config, Dinov2Model, Sam2Config, Sam2Model, SamConfig, SamModel


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


def spread_weights(model: torch.nn.Module, special: tuple = (), buffers: tuple = (), norms: bool = True) -> None:
    """Seeded random weights at scales that keep activations in range, in place (under ``no_grad``).

    ``special`` and ``buffers`` are ``(suffixes, mean, std)`` rules, tried first in order (upstream zero-
    initialises some tables, which would hide them from a comparison); then every matrix ~ N(0, 1/fan_in),
    norm weights 1 + N(0, 0.1) (with ``norms``) and biases N(0, 0.02). The draw order is the parameters' order."""
    for name, p in model.named_parameters():
        rule = next(((m, sd) for suffixes, m, sd in special if name.endswith(suffixes)), None)
        if rule is not None:
            p.normal_(*rule)
        elif p.dim() >= 2:
            p.normal_(0, p[0].numel() ** -0.5)
        elif norms and "norm" in name and name.endswith("weight"):
            p.add_(torch.randn_like(p) * 0.1)
        elif name.endswith("bias"):
            p.normal_(0, 0.02)
    for name, b in model.named_buffers():
        rule = next(((m, sd) for suffixes, m, sd in buffers if name.endswith(suffixes)), None)
        if rule is not None:
            b.normal_(*rule)


SAM2_TABLES = ((("pos_embed", "pos_embed_window", "no_memory_embedding"), 0.0, 0.5),)
SAM2_BUFFERS = ((("positional_embedding",), 0.0, 1.0),)


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
        spread_weights(ref, SAM2_TABLES, SAM2_BUFFERS)
    return ref


# --------------------------------------------------------------------------------------------- SAM

SMALL = dict(  # a SamConfig at small widths
    vision_config=dict(hidden_size=32, num_attention_heads=2, mlp_dim=64, output_channels=32, num_pos_feats=16),
    prompt_encoder_config=dict(hidden_size=32),
    mask_decoder_config=dict(hidden_size=32, num_attention_heads=2, mlp_dim=64, iou_head_hidden_dim=32),
)


def seeded_sam(config: dict, seed: int = 0) -> SamModel:
    """A transformers SamModel with random weights everywhere.

    Upstream zero-initialises the positions and draws the encoder's weights with std 1e-10, which
    would leave the image embedding independent of the image: every matrix gets std 1/sqrt(fan-in)
    here, and the Fourier matrix std 1 as in the released checkpoints.
    """
    torch.manual_seed(seed)
    ref = SamModel(SamConfig(**config)).eval()
    with torch.no_grad():
        spread_weights(ref, ((("rel_pos_h", "rel_pos_w", "pos_embed"), 0.0, 0.5),
                             (("positional_embedding",), 0.0, 1.0)))
    return ref


# ------------------------------------------------------------------------------------------ SigLIP


SIGLIP_LABELS = ["dog", "a red car", "sleeping cat"]  # what the siglip_dir fixture's reference scores
SIGLIP_TEMPLATE = "a photo of {}."


def build_siglip(vision: dict, text: dict, seed: int = 0) -> transformers.SiglipModel:
    torch.manual_seed(seed)
    config = transformers.SiglipConfig(vision_config=vision, text_config=text)
    model = transformers.SiglipModel(config).eval()
    with torch.no_grad():  # a logit scale and bias away from their init, so both matter
        model.logit_scale.fill_(2.3)
        model.logit_bias.fill_(-1.7)
    return model


# ------------------------------------------------------------------------------------------ memory


def resident_pages(t: torch.Tensor) -> int:
    """How many whole pages under ``t``'s bytes are resident (Linux's /proc/self/pagemap)."""
    import mmap
    import struct

    page = mmap.PAGESIZE
    first = -(-t.data_ptr() // page) * page
    last = (t.data_ptr() + t.numel() * t.element_size()) // page * page
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first // page * 8)
        raw = f.read((last - first) // page * 8)
    return sum(1 for (e,) in struct.iter_unpack("<Q", raw) if e >> 63)


# ------------------------------------------------------------------------------------- dataset jobs


def make_photos(root, n: int = 14):
    """``n`` random PNGs of a few sizes in three sub-folders, and one file that is not an image."""
    rng = np.random.default_rng(0)
    for i in range(n):
        d = root / f"d{i % 3}"
        d.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (30 + 3 * (i % 5), 40, 3), dtype=np.uint8)).save(d / f"im{i:03d}.png")
    (root / "d1" / "broken.png").write_bytes(b"this is not a png")
    return root


def make_dino(directory):
    cfg = Dinov2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                       image_size=32, patch_size=8)
    ref = seeded(lambda: Dinov2Model(cfg))
    ref.save_pretrained(directory)
    BitImageProcessor(size={"shortest_edge": 36}, crop_size={"height": 32, "width": 32}).save_pretrained(directory)
    return ref


def table(out) -> pa.Table:
    return pq.read_table(sorted(out.glob("part-*.parquet")))


def features(t: pa.Table) -> np.ndarray:
    return np.stack(t.column("features").to_numpy(zero_copy_only=False))


# ---------------------------------------------------------------------------------------- hub cache


def make_cached_repo(
    cache: Path, repo_id: str, commit: str, files: dict[str, bytes], ref: str | None = "main"
) -> Path:
    """Lay out a repo in the HF cache exactly as huggingface_hub does: blobs/, snapshots/<commit>/, refs/."""
    repo_dir = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo_dir / "snapshots" / commit
    for name, content in files.items():
        blob = repo_dir / "blobs" / hashlib.sha256(content).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(content)
        pointer = snapshot / name
        pointer.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(blob, pointer.parent), pointer)
    snapshot.mkdir(parents=True, exist_ok=True)
    if ref is not None:
        (repo_dir / "refs").mkdir(exist_ok=True)
        (repo_dir / "refs" / ref).write_text(commit)  # no trailing newline, like huggingface_hub
    return snapshot
