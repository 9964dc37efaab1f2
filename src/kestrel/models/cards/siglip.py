"""SigLIP image-text models (``SiglipModel`` checkpoints): base, large and so400m, any image/patch size.

``config.json`` nests a ``vision_config`` and a ``text_config``; the upstream files often write only
the values that differ from the reference defaults, so the defaults below are transformers'
``SiglipVisionConfig``/``SiglipTextConfig`` ones (the base model's).
"""

from __future__ import annotations

from typing import Any

from .. import siglip
from ..capabilities import Capabilities
from .base import Bindings, Card, Family, pair

# SiglipVisionConfig / SiglipTextConfig defaults (transformers 5.24)
VISION_DEFAULTS: dict[str, Any] = {
    "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
    "num_channels": 3, "image_size": 224, "patch_size": 16, "hidden_act": "gelu_pytorch_tanh",
    "layer_norm_eps": 1e-6, "vision_use_head": True,
}
TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32000, "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
    "num_attention_heads": 12, "max_position_embeddings": 64, "hidden_act": "gelu_pytorch_tanh",
    "layer_norm_eps": 1e-6, "projection_size": None,
}

# hidden_act -> the ``approximate`` argument of GELU ("gelu_new"/"gelu_fast" are the same tanh curve)
_GELU = {"gelu_pytorch_tanh": "tanh", "gelu_new": "tanh", "gelu_fast": "tanh", "gelu": "none"}

_V = r"vision_model\."
_T = r"text_model\."
_LAYER = r"encoder\.layers\.(\d+)\."


def _layer_rows(prefix: str, target: str) -> tuple[tuple[str, str], ...]:
    """The encoder-layer rows of one tower (``vision_layers`` or ``text_layers``)."""
    layer = prefix + _LAYER
    return (
        (layer + r"layer_norm(1|2)\.(weight|bias)", target + r".\1.norm\2.\3"),
        (layer + r"self_attn\.q_proj\.(weight|bias)", target + r".\1.attention.query.\2"),
        (layer + r"self_attn\.k_proj\.(weight|bias)", target + r".\1.attention.key.\2"),
        (layer + r"self_attn\.v_proj\.(weight|bias)", target + r".\1.attention.value.\2"),
        (layer + r"self_attn\.out_proj\.(weight|bias)", target + r".\1.attention.out.\2"),
        (layer + r"mlp\.fc1\.(weight|bias)", target + r".\1.mlp.up.\2"),
        (layer + r"mlp\.fc2\.(weight|bias)", target + r".\1.mlp.down.\2"),
    )


BINDINGS = Bindings(
    rows=(
        (_V + r"embeddings\.patch_embedding\.weight", "patch_weight"),
        (_V + r"embeddings\.patch_embedding\.bias", "patch_bias"),
        (_V + r"embeddings\.position_embedding\.weight", "vision_positions"),
        *_layer_rows(_V, "vision_layers"),
        (_V + r"post_layernorm\.(weight|bias)", r"vision_post_norm.\1"),
        (_V + r"head\.probe", "vision_head.probe"),
        (_V + r"head\.attention\.in_proj_(weight|bias)", r"vision_head.in_proj_\1"),
        (_V + r"head\.attention\.out_proj\.(weight|bias)", r"vision_head.out.\1"),
        (_V + r"head\.layernorm\.(weight|bias)", r"vision_head.norm.\1"),
        (_V + r"head\.mlp\.fc1\.(weight|bias)", r"vision_head.mlp.up.\1"),
        (_V + r"head\.mlp\.fc2\.(weight|bias)", r"vision_head.mlp.down.\1"),
        (_T + r"embeddings\.token_embedding\.weight", "token_embedding"),
        (_T + r"embeddings\.position_embedding\.weight", "text_positions"),
        *_layer_rows(_T, "text_layers"),
        (_T + r"final_layer_norm\.(weight|bias)", r"text_final_norm.\1"),
        (_T + r"head\.(weight|bias)", r"text_head.\1"),
        (r"logit_scale", "logit_scale"),
        (r"logit_bias", "logit_bias"),
    ),
    # position ids are arange buffers (not written by transformers 5, present in some older files)
    unused=(r"(?:vision|text)_model\.embeddings\.position_ids",),
)


def vision_config(cfg: dict) -> dict[str, Any]:
    """The vision tower's config with the reference defaults filled in."""
    return {**VISION_DEFAULTS, **{k: v for k, v in (cfg.get("vision_config") or {}).items() if v is not None}}


def text_config(cfg: dict) -> dict[str, Any]:
    """The text tower's config with the reference defaults filled in."""
    return {**TEXT_DEFAULTS, **{k: v for k, v in (cfg.get("text_config") or {}).items() if v is not None}}


def generics(cfg: dict) -> dict[str, Any]:
    v, t = vision_config(cfg), text_config(cfg)
    h, w = pair(v["image_size"])
    p, q = pair(v["patch_size"])
    if p != q:
        raise ValueError(f"SigLIP with a rectangular patch {p}x{q} is not supported")
    if not v["vision_use_head"]:
        raise ValueError("SigLIP without the attention-pool head (vision_use_head=false) is not supported")
    if t["projection_size"] not in (None, t["hidden_size"]):
        raise ValueError(f"SigLIP with a text projection to {t['projection_size']} (not the text width "
                         f"{t['hidden_size']}) is not supported")
    if v["hidden_size"] != t["hidden_size"]:
        raise ValueError(f"SigLIP with image width {v['hidden_size']} and text width {t['hidden_size']}: "
                         "similarity needs them equal")
    return {
        "Height": h, "Width": w, "Channels": v["num_channels"], "Patch": p,
        "VisionD": v["hidden_size"], "VisionHeads": v["num_attention_heads"],
        "VisionInner": v["intermediate_size"], "VisionLayers": v["num_hidden_layers"],
        "Vocab": t["vocab_size"], "MaxPositions": t["max_position_embeddings"],
        "TextD": t["hidden_size"], "TextHeads": t["num_attention_heads"],
        "TextInner": t["intermediate_size"], "TextLayers": t["num_hidden_layers"],
    }


def settings(cfg: dict) -> dict[str, Any]:
    """``eps`` of every LayerNorm and the GELU ``approximate`` of every MLP, shared by both towers."""
    v, t = vision_config(cfg), text_config(cfg)
    acts = {v["hidden_act"], t["hidden_act"]}
    unknown = acts - _GELU.keys()
    if unknown:
        raise ValueError(f"SigLIP with hidden_act={sorted(unknown)} is not supported (only {', '.join(_GELU)})")
    approximate = {_GELU[a] for a in acts}
    if len(approximate) > 1 or v["layer_norm_eps"] != t["layer_norm_eps"]:
        raise ValueError("SigLIP towers with different activations or layer_norm_eps are not supported")
    return {"eps": float(v["layer_norm_eps"]), "approximate": approximate.pop()}


FAMILY = Family(
    "siglip", root=siglip.Model, generics=generics, bindings=BINDINGS, settings=settings,
    preprocess={"image_processor_type": "SiglipImageProcessor", "do_resize": True,
                "size": {"height": 224, "width": 224}, "resample": 3, "do_rescale": True,
                "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.5, 0.5, 0.5],
                "image_std": [0.5, 0.5, 0.5]},
    description="SigLIP image-text model (zero-shot classification)",
    license="Apache-2.0",
    capabilities=Capabilities(tasks=("embed", "zero-shot", "similarity"), features="image_features", text=True),
)

CARDS = [
    Card("siglip-base-patch16-224", FAMILY, "google/siglip-base-patch16-224",
         "7fd15f0689c79d79e38b1c2e2e2370a7bf2761ed", "SigLIP base, patch 16, 224 px",
         config={"model_type": "siglip",
                 "vision_config": {"image_size": 224, "patch_size": 16, "num_channels": 3, "hidden_size": 768,
                                   "num_attention_heads": 12, "intermediate_size": 3072,
                                   "num_hidden_layers": 12},
                 "text_config": {"vocab_size": 32000, "max_position_embeddings": 64, "hidden_size": 768,
                                 "num_attention_heads": 12, "intermediate_size": 3072,
                                 "num_hidden_layers": 12}},
         extra_files=("spiece.model", "tokenizer_config.json", "special_tokens_map.json")),
]
