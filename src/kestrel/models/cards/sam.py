"""Segment Anything (``SamModel`` checkpoints): ViT-Base, ViT-Large, ViT-Huge.

Width, heads, MLP width, depth and the global-attention layers come from the config: the encoder's
layers are built from ``num_hidden_layers`` and ``global_attn_indexes``. The program fixes what every
released SAM shares: a 1024 px input on a 64 x 64 grid of 16 px patches, 14 x 14 windows, a two-layer
two-way transformer, four mask tokens and a 16-channel mask-prompt encoder. A config that differs in
any of these is refused with the field that differs.
"""

from __future__ import annotations

from typing import Any

from .. import sam
from ..capabilities import Capabilities
from .base import IMAGENET_MEAN, IMAGENET_STD, Bindings, Card, Family, pair

_VLAYER = r"vision_encoder\.layers\.(\d+)\."
_TLAYER = r"mask_decoder\.transformer\.layers\.(\d+)\."
_FF = r"(?:proj_in|proj_out)"

BINDINGS = Bindings(
    rows=(
        (r"vision_encoder\.patch_embed\.projection\.(weight|bias)", r"vision_encoder.patch_embed.\1"),
        (r"vision_encoder\.pos_embed", "vision_encoder.pos_embed"),
        (_VLAYER + r"(attn\.(?:qkv|proj)\.(?:weight|bias))", r"vision_encoder.layer_\1.\2"),
        (_VLAYER + r"(attn\.rel_pos_[hw])", r"vision_encoder.layer_\1.\2"),
        (_VLAYER + r"((?:layer_norm[12]|mlp\.lin[12])\.(?:weight|bias))", r"vision_encoder.layer_\1.\2"),
        (r"vision_encoder\.neck\.(conv[12]\.(?:weight|bias))", r"vision_encoder.neck.\1"),
        (r"vision_encoder\.neck\.layer_norm([12])\.(weight|bias)", r"vision_encoder.neck.ln\1.\2"),
        (r"shared_image_embedding\.positional_embedding", "positional_embedding"),
        (r"prompt_encoder\.not_a_point_embed\.weight", "not_a_point_embed"),
        (r"prompt_encoder\.point_embed\.([0-3])\.weight", r"point_embed_\1"),
        (r"prompt_encoder\.no_mask_embed\.weight", "no_mask_embed"),
        (r"prompt_encoder\.mask_embed\.conv([123])\.(weight|bias)", r"mask_conv\1.\2"),
        (r"prompt_encoder\.mask_embed\.layer_norm([12])\.(weight|bias)", r"mask_norm\1.\2"),
        (r"mask_decoder\.(iou_token|mask_tokens)\.weight", r"mask_decoder.\1"),
        (_TLAYER + r"((?:self_attn|cross_attn_token_to_image|cross_attn_image_to_token)\."
         r"(?:q_proj|k_proj|v_proj|out_proj)\.(?:weight|bias))", r"mask_decoder.transformer.layer_\1.\2"),
        (_TLAYER + r"((?:layer_norm[1-4]|mlp\.lin[12])\.(?:weight|bias))", r"mask_decoder.transformer.layer_\1.\2"),
        (r"mask_decoder\.transformer\.(final_attn_token_to_image\.(?:q_proj|k_proj|v_proj|out_proj)"
         r"\.(?:weight|bias))", r"mask_decoder.transformer.\1"),
        (r"mask_decoder\.transformer\.layer_norm_final_attn\.(weight|bias)",
         r"mask_decoder.transformer.layer_norm_final_attn.\1"),
        (r"mask_decoder\.(upscale_conv[12]|upscale_layer_norm)\.(weight|bias)", r"mask_decoder.\1.\2"),
        (r"mask_decoder\.output_hypernetworks_mlps\.([0-3])\.(" + _FF + r")\.(weight|bias)",
         r"mask_decoder.hyper_mlp_\1.\2.\3"),
        (r"mask_decoder\.output_hypernetworks_mlps\.([0-3])\.layers\.0\.(weight|bias)",
         r"mask_decoder.hyper_mlp_\1.hidden.\2"),
        (r"mask_decoder\.iou_prediction_head\.(" + _FF + r")\.(weight|bias)",
         r"mask_decoder.iou_prediction_head.\1.\2"),
        (r"mask_decoder\.iou_prediction_head\.layers\.0\.(weight|bias)", r"mask_decoder.iou_prediction_head.hidden.\1"),
    ),
    # the prompt encoder's copy of the Fourier matrix is tied to ``shared_image_embedding`` upstream
    unused=(r"prompt_encoder\.shared_embedding\.positional_embedding",),
)

# what the program hard-codes, as the config spells it
_FIXED_VISION = {
    "window_size": 14, "num_channels": 3,
    "use_abs_pos": True, "use_rel_pos": True, "qkv_bias": True, "hidden_act": "gelu",
}
_FIXED_DECODER = {
    "num_hidden_layers": 2, "attention_downsample_rate": 2, "num_multimask_outputs": 3, "iou_head_depth": 3,
    "hidden_act": "relu",
}


def _check(section: str, cfg: dict, fixed: dict[str, Any]) -> None:
    for key, want in fixed.items():
        got = cfg.get(key, want)
        if (list(got) if isinstance(got, list | tuple) else got) != want:
            raise ValueError(f"SAM with {section}.{key}={got!r} is not supported (the program fixes {want!r})")


_FIXED_PROMPT = {"mask_input_channels": 16, "num_point_embeddings": 4, "image_size": 1024, "image_embedding_size": 64,
                 "hidden_act": "gelu"}


def layout(cfg: dict) -> tuple[int, tuple[int, ...]]:
    """The encoder's depth and global-attention layers, from ``vision_config``."""
    vision = cfg["vision_config"]
    depth = vision.get("num_hidden_layers", 12)
    globals_ = vision.get("global_attn_indexes", [2, 5, 8, 11])
    if not isinstance(depth, int) or depth <= 0:
        raise ValueError(f"SAM with vision_config.num_hidden_layers={depth!r}: need a positive layer count")
    bad = [i for i in globals_ if not isinstance(i, int) or not 0 <= i < depth]
    if bad or len(set(globals_)) != len(globals_):
        raise ValueError(f"SAM with vision_config.global_attn_indexes={list(globals_)!r}: need distinct layer "
                         f"indexes in 0..{depth - 1}")
    return depth, tuple(globals_)


def root(cfg: dict):
    return sam.model_for(*layout(cfg))


def generics(cfg: dict) -> dict[str, Any]:
    vision, decoder = cfg["vision_config"], cfg.get("mask_decoder_config") or {}
    prompt = cfg.get("prompt_encoder_config") or {}
    _check("vision_config", vision, _FIXED_VISION)
    _check("mask_decoder_config", decoder, _FIXED_DECODER)
    _check("prompt_encoder_config", prompt, _FIXED_PROMPT)
    layout(cfg)
    if pair(vision.get("image_size", 1024)) != (1024, 1024) or pair(vision.get("patch_size", 16)) != (16, 16):
        raise ValueError("SAM is bound at 1024 px with 16 px patches; the config says image_size="
                         f"{vision.get('image_size')!r}, patch_size={vision.get('patch_size')!r}")
    d = vision["hidden_size"]
    hd = vision.get("output_channels", 256)
    out = {
        "D": d, "VisionHeads": vision["num_attention_heads"],
        "VisionInner": vision.get("mlp_dim") or int(d * vision.get("mlp_ratio", 4.0)),
        "Hd": hd, "MaskHeads": decoder.get("num_attention_heads", 8), "MaskInner": decoder.get("mlp_dim", 2048),
    }
    widths = {
        "mask_decoder_config.hidden_size": decoder.get("hidden_size", 256),
        "mask_decoder_config.iou_head_hidden_dim": decoder.get("iou_head_hidden_dim", 256),
        "prompt_encoder_config.hidden_size": prompt.get("hidden_size", 256),
        "2 * vision_config.num_pos_feats": 2 * vision.get("num_pos_feats", 128),
    }
    for key, width in widths.items():
        if width != hd:
            raise ValueError(f"SAM with {key} = {width} is not supported: the program ties it to "
                             f"vision_config.output_channels = {hd}")
    return out


def settings(cfg: dict) -> dict[str, Any]:
    eps = cfg["vision_config"].get("layer_norm_eps", 1e-6)
    decoder_eps = (cfg.get("mask_decoder_config") or {}).get("layer_norm_eps", 1e-6)
    if decoder_eps != eps:
        raise ValueError(f"SAM with layer_norm_eps {eps} (vision) and {decoder_eps} (mask decoder) is not supported")
    return {"eps": eps}


FAMILY = Family(
    "sam", root=root, generics=generics, bindings=BINDINGS, settings=settings,
    preprocess={"image_processor_type": "SamImageProcessor", "do_resize": True, "size": {"longest_edge": 1024},
                "resample": 2, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
                "image_mean": list(IMAGENET_MEAN), "image_std": list(IMAGENET_STD), "do_pad": True,
                "pad_size": {"height": 1024, "width": 1024}, "do_convert_rgb": True},
    description="Segment Anything: image encoder, point, box and mask prompts, mask decoder",
    license="Apache-2.0",
    capabilities=Capabilities(tasks=("segment",), segmenter="sam", processor="sam"),
)

def _config(hidden: int, layers: int, globals_: list[int]) -> dict[str, Any]:
    return {
        "model_type": "sam",
        "vision_config": {
            "hidden_size": hidden, "num_attention_heads": 12 if hidden == 768 else 16, "num_hidden_layers": layers,
            "mlp_dim": 4 * hidden, "mlp_ratio": 4.0, "output_channels": 256, "global_attn_indexes": globals_,
            "window_size": 14, "image_size": 1024, "patch_size": 16, "num_channels": 3, "num_pos_feats": 128,
            "layer_norm_eps": 1e-6, "hidden_act": "gelu", "qkv_bias": True, "use_abs_pos": True, "use_rel_pos": True,
        },
        "prompt_encoder_config": {
            "hidden_size": 256, "image_size": 1024, "patch_size": 16, "image_embedding_size": 64,
            "mask_input_channels": 16, "num_point_embeddings": 4, "layer_norm_eps": 1e-6, "hidden_act": "gelu",
        },
        "mask_decoder_config": {
            "hidden_size": 256, "num_attention_heads": 8, "mlp_dim": 2048, "num_hidden_layers": 2,
            "attention_downsample_rate": 2, "num_multimask_outputs": 3, "iou_head_depth": 3,
            "iou_head_hidden_dim": 256, "layer_norm_eps": 1e-6, "hidden_act": "relu",
        },
    }


# ViT-L and ViT-H: their commit hashes could not be looked up offline; "main" until someone pins them
CARDS = [
    Card("sam-vit-base", FAMILY, "facebook/sam-vit-base", "70c1a07f894ebb5b307fd9eaaee97b9dfc16068f", "SAM ViT-Base",
         config=_config(768, 12, [2, 5, 8, 11])),
    Card("sam-vit-large", FAMILY, "facebook/sam-vit-large", "main", "SAM ViT-Large",
         config=_config(1024, 24, [5, 11, 17, 23])),
    Card("sam-vit-huge", FAMILY, "facebook/sam-vit-huge", "main", "SAM ViT-Huge",
         config=_config(1280, 32, [7, 15, 23, 31])),
]
