"""ViT image classifiers (``ViTForImageClassification`` checkpoints)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from .. import vit
from ..capabilities import Capabilities
from .base import Bindings, Card, Family, pair


def embedding_and_attention_rows(prefix: str) -> tuple[tuple[str, str], ...]:
    """The rows ViT-layout checkpoints share (ViT, DINOv2): patch embedding, class token, positions,
    each layer's attention; ``prefix`` is the optional model prefix (``vit``, ``dinov2``)."""
    p = rf"(?:{prefix}\.)?"
    return (
        (p + r"embeddings\.patch_embeddings\.projection\.weight", "patch_weight"),
        (p + r"embeddings\.patch_embeddings\.projection\.bias", "patch_bias"),
        (p + r"embeddings\.cls_token", "class_token"),
        (p + r"embeddings\.position_embeddings", "positions"),
        (layer_pattern(prefix) + r"attention\.attention\.(query|key|value)\.(weight|bias)",
         r"layers.\1.attention.\2.\3"),
        *layer_rows(prefix, {"attention.output.dense": "attention.out"}),
    )


def layer_pattern(prefix: str) -> str:
    """The checkpoint's ``[<prefix>.]encoder.layer.<N>.``, the layer number its first group."""
    return rf"(?:{prefix}\.)?encoder\.layer\.(\d+)\."


def layer_rows(prefix: str, renames: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """Rows that bind each layer's ``<theirs>.weight`` and ``.bias`` to ``layers.<N>.<ours>``."""
    layer = layer_pattern(prefix)
    return tuple((layer + re.escape(theirs) + r"\.(weight|bias)", rf"layers.\1.{ours}.\2")
                 for theirs, ours in renames.items())


BINDINGS = Bindings(
    rows=(
        *embedding_and_attention_rows("vit"),
        *layer_rows("vit", {"layernorm_before": "norm_before", "layernorm_after": "norm_after",
                            "intermediate.dense": "up", "output.dense": "down"}),
        (r"(?:vit\.)?layernorm\.(weight|bias)", r"norm.\1"),
        (r"classifier\.(weight|bias)", r"head.\1"),
    ),
    # the pooler is not part of the classifier's path; the mask token is for masked pretraining
    unused=(r"(?:vit\.)?pooler\..*", r"(?:vit\.)?embeddings\.mask_token"),
)


def generics(cfg: dict) -> dict[str, Any]:
    h, w = pair(cfg.get("image_size", 224))
    p, q = pair(cfg.get("patch_size", 16))
    if p != q:
        raise ValueError(f"ViT with a rectangular patch {p}x{q} is not supported")
    labels = cfg.get("id2label") or {}
    return {
        "Height": h, "Width": w, "Channels": cfg.get("num_channels", 3), "Patch": p,
        "D": cfg["hidden_size"], "Heads": cfg["num_attention_heads"], "Inner": cfg["intermediate_size"],
        "Layers": cfg["num_hidden_layers"], "Classes": cfg.get("num_labels", len(labels) or 2),
    }


def settings(cfg: dict) -> dict[str, Any]:
    if cfg.get("hidden_act", "gelu") != "gelu":
        raise ValueError(f"ViT with hidden_act={cfg['hidden_act']!r} is not supported (only gelu)")
    return {"eps": cfg.get("layer_norm_eps", 1e-12)}


FAMILY = Family(
    "vit", root=vit.Model, generics=generics, bindings=BINDINGS, settings=settings,
    preprocess={"image_processor_type": "ViTImageProcessor", "do_resize": True, "size": {"height": 224, "width": 224},
                "resample": 2, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
                "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]},
    description="ViT image classifier",
    license="Apache-2.0",
    capabilities=Capabilities(tasks=("classify", "embed"), features="features"),
)

CARDS = [
    Card("vit-base-patch16-224", FAMILY, "google/vit-base-patch16-224",
         "3f49326eb077187dfe1c2a2bb15fbd74e6ab91e3", "ViT-Base, patch 16, 224 px, ImageNet-1k classifier",
         config={"model_type": "vit", "image_size": 224, "patch_size": 16, "num_channels": 3, "hidden_size": 768,
                 "num_attention_heads": 12, "intermediate_size": 3072, "num_hidden_layers": 12,
                 "num_labels": 1000, "layer_norm_eps": 1e-12, "hidden_act": "gelu"}),
]
