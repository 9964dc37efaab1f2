"""SAM 2.1 (``Sam2Model`` checkpoints): Hiera tiny, small, base-plus and large, at any image size.

The program's shape is Hiera's: four stages, query pooling into stages 1-3, three global layers in
stage 2. Everything else comes from the config as data: widths, heads, windows, depths, where the
global layers sit, the background position table. The image size is the generic ``E`` (the image
embedding's side, image / 16): the config's ``image_size`` by default, rebindable at load
(``kestrel.load(dir, E=32)`` for the seed's 512 px edge size); the window paddings follow from it.
"""

from __future__ import annotations

import copy
from typing import Any

from ...blocks.spec import group_runs
from .. import sam2, sam2_video
from ..capabilities import Capabilities
from .base import IMAGENET_MEAN, IMAGENET_STD, Bindings, Card, Family, pair

_B = r"vision_encoder\.backbone\."
_TLAYER = r"mask_decoder\.transformer\.layers\.(\d+)\."
_ATTN = r"(?:self_attn|cross_attn_token_to_image|cross_attn_image_to_token|final_attn_token_to_image)"
_HEAD = r"(output_hypernetworks_mlps\.\d+|iou_prediction_head|pred_obj_score_head)"

_FIXED_BACKBONE = {
    "patch_kernel_size": [7, 7], "patch_stride": [4, 4], "patch_padding": [3, 3], "query_stride": [2, 2],
    "num_query_pool_stages": 3, "mlp_ratio": 4.0, "hidden_act": "gelu", "num_channels": 3,
}
_FIXED_VISION = {"fpn_kernel_size": 1, "fpn_stride": 1, "fpn_padding": 0, "fpn_top_down_levels": [2, 3],
                 "num_feature_levels": 3}
_FIXED_DECODER = {"num_hidden_layers": 2, "attention_downsample_rate": 2, "num_multimask_outputs": 3,
                  "iou_head_depth": 3}
_DEFAULT_BACKBONE = {  # Sam2HieraDetConfig's defaults (Hiera-tiny), for configs that leave them out
    "blocks_per_stage": [1, 2, 7, 2], "embed_dim_per_stage": [96, 192, 384, 768],
    "num_attention_heads_per_stage": [1, 2, 4, 8], "window_size_per_stage": [8, 4, 14, 7],
    "global_attention_blocks": [5, 7, 9], "window_positional_embedding_background_size": [7, 7],
    "image_size": [1024, 1024],
}


def _norm(v: Any) -> Any:
    return list(v) if isinstance(v, list | tuple) else v


def _check(section: str, cfg: dict, fixed: dict[str, Any]) -> None:
    for key, want in fixed.items():
        got = cfg.get(key, want)
        if _norm(got) != _norm(want):
            raise ValueError(f"SAM 2 with {section}.{key}={got!r} is not supported (the program fixes {want!r})")


def _backbone(cfg: dict) -> dict[str, Any]:
    vision = cfg.get("vision_config") or {}
    bb = dict(_DEFAULT_BACKBONE)
    bb.update({k: v for k, v in (vision.get("backbone_config") or {}).items() if v is not None})
    return bb


def _pad(side: int, win: int) -> int:
    """How far a ``side`` map is padded to a whole number of ``win`` windows."""
    return (-side) % win


def layout(cfg: dict) -> dict[str, Any]:
    """Hiera's layout from the config: which blocks pool, which attend globally, stage by stage."""
    bb = _backbone(cfg)
    return sam2.hiera_layout(bb["blocks_per_stage"], bb["global_attention_blocks"])


def generics(cfg: dict, E: int | None = None) -> dict[str, Any]:
    vision = cfg.get("vision_config") or {}
    decoder = cfg.get("mask_decoder_config") or {}
    prompt = cfg.get("prompt_encoder_config") or {}
    bb = _backbone(cfg)
    _check("vision_config.backbone_config", bb, _FIXED_BACKBONE)
    _check("vision_config", vision, _FIXED_VISION)
    _check("mask_decoder_config", decoder, _FIXED_DECODER)
    layout(cfg)  # refuses a layout the program cannot lay out, naming the field
    dims = [int(d) for d in bb["embed_dim_per_stage"]]
    heads = [int(h) for h in bb["num_attention_heads_per_stage"]]
    wins = [int(w) for w in bb["window_size_per_stage"]]
    if int(bb.get("hidden_size", dims[0])) != dims[0]:
        raise ValueError(f"SAM 2 with backbone hidden_size {bb.get('hidden_size')} != embed_dim_per_stage[0] {dims[0]}")
    channels = _norm(vision.get("backbone_channel_list") or list(reversed(dims)))
    if channels != list(reversed(dims)):
        raise ValueError(f"SAM 2 with backbone_channel_list={channels} is not supported: the neck takes the stage "
                         f"widths {list(reversed(dims))}")
    if any(dims[i] == dims[i - 1] for i in (1, 2, 3)):
        raise ValueError(f"SAM 2 needs each stage wider than the one before, embed_dim_per_stage={dims}")
    if E is None:
        h, w = pair(bb["image_size"])
        p = pair(prompt.get("image_size", h))
        if h != w or p != (h, w):
            raise ValueError(f"SAM 2 needs a square image and the prompt encoder at the same size: backbone "
                             f"image_size={bb['image_size']!r}, prompt_encoder_config.image_size={p!r}")
        if h % 32:
            raise ValueError(f"SAM 2 needs an image size divisible by 32, the config says {h}")
        E = h // 16
    elif E <= 0 or E % 2:
        raise ValueError(f"SAM 2's embedding side E must be even and positive (image = 16 E), got {E}")
    bg = pair(bb["window_positional_embedding_background_size"])
    if bg[0] != bg[1]:
        raise ValueError(f"SAM 2 with a non-square background position table {bg} is not supported")
    sides = [4 * E, 2 * E, E, E // 2]
    if sides[0] % wins[0]:
        raise ValueError(f"SAM 2 at {16 * E} px: the stage-0 map ({sides[0]}) is not a whole number of "
                         f"{wins[0]}-windows, so the window position table cannot tile it")
    if any(w % 2 for w in wins[:3]):
        raise ValueError(f"SAM 2 needs even windows in stages 0-2 (query pooling halves them), got {wins}")
    hd = int(vision.get("fpn_hidden_size", 256))
    for key, width in {"mask_decoder_config.hidden_size": decoder.get("hidden_size", 256),
                       "prompt_encoder_config.hidden_size": prompt.get("hidden_size", 256)}.items():
        if width != hd:
            raise ValueError(f"SAM 2 with {key} = {width} is not supported: the program ties it to "
                             f"vision_config.fpn_hidden_size = {hd}")
    if decoder.get("iou_head_hidden_dim", 256) != hd:
        raise ValueError(f"SAM 2 with mask_decoder_config.iou_head_hidden_dim = {decoder.get('iou_head_hidden_dim')}"
                         f" is not supported: the program ties it to fpn_hidden_size = {hd}")
    out: dict[str, Any] = {"E": E, "Bg": bg[0]}
    out.update({f"D{i}": dims[i] for i in range(4)})
    out.update({f"Heads{i}": heads[i] for i in range(4)})
    out.update({f"Win{i}": wins[i] for i in range(4)})
    out.update({f"Pad{i}": _pad(sides[i], wins[i]) for i in range(4)})
    out.update({"Hd": hd, "MaskHeads": decoder.get("num_attention_heads", 8),
                "MaskInner": decoder.get("mlp_dim", 2048)})
    if is_video(cfg):
        out.update(video_generics(cfg, hd, E))
    return out


def is_video(cfg: dict) -> bool:
    """A ``Sam2VideoModel`` config (the hub checkpoints): the program has the memory too."""
    return cfg.get("model_type") == "sam2_video"


_FIXED_VIDEO = {  # Sam2VideoConfig's values that the video program fixes
    "memory_attention_num_attention_heads": 1, "memory_attention_downsample_rate": 1,
    "memory_attention_feed_forward_hidden_act": "relu", "mask_downsampler_kernel_size": 3,
    "mask_downsampler_stride": 2, "mask_downsampler_padding": 1, "mask_downsampler_total_stride": 16,
    "mask_downsampler_hidden_act": "gelu", "memory_fuser_kernel_size": 7, "memory_fuser_padding": 3,
    "memory_fuser_hidden_act": "gelu", "enable_temporal_pos_encoding_for_object_pointers": True,
    "enable_occlusion_spatial_embedding": True,
}


def video_generics(cfg: dict, hd: int, E: int) -> dict[str, Any]:
    """The memory's generics from a ``Sam2VideoModel`` config (its defaults where it leaves them out)."""
    _check("sam2_video", cfg, _FIXED_VIDEO)
    for key in ("memory_attention_hidden_size", "memory_encoder_hidden_size", "mask_downsampler_embed_dim",
                "memory_fuser_embed_dim"):
        if cfg.get(key, 256) != hd:
            raise ValueError(f"SAM 2 video with {key} = {cfg.get(key, 256)} is not supported: the program ties it "
                             f"to vision_config.fpn_hidden_size = {hd}")
    mem = int(cfg.get("memory_encoder_output_channels", 64))
    if mem <= 0 or hd % mem or mem % 4:
        raise ValueError(f"SAM 2 video needs memory_encoder_output_channels ({mem}) a multiple of 4 dividing "
                         f"the hidden size {hd}")
    return {"Mem": mem, "MaskMem": int(cfg.get("num_maskmem", 7)),
            "MemLayers": int(cfg.get("memory_attention_num_layers", 4)),
            "MemInner": int(cfg.get("memory_attention_feed_forward_hidden_size", 2048)),
            "FuserInner": int(cfg.get("memory_fuser_intermediate_dim", 1024)),
            "FuserLayers": int(cfg.get("memory_fuser_num_layers", 2))}


def _block_paths(cfg: dict) -> list[str]:
    """The program path of every upstream Hiera block, in upstream order: ``pool_s`` for the first
    block of stages 1-3, then ``stage_s_k.j``, the j-th layer of the stage's k-th run."""
    paths = []
    for s, (name, kinds) in enumerate(layout(cfg).items()):
        if s:
            paths.append(f"backbone.pool_{s}")
        for k, (_, n) in enumerate(group_runs(kinds)):
            paths += [f"backbone.{name}_{k}.{j}" for j in range(n)]
    return paths


def bindings(cfg: dict) -> Bindings:
    blocks = tuple((_B + rf"blocks\.{i}\.(.+)", path + r".\1") for i, path in enumerate(_block_paths(cfg)))
    lateral = tuple((rf"vision_encoder\.neck\.convs\.{k}\.(weight|bias)", f"neck.lateral_{3 - k}." + r"\1")
                    for k in range(4))
    return Bindings(
        rows=blocks + lateral + (
            (_B + r"patch_embed\.projection\.(weight|bias)", r"backbone.patch_embed.\1"),
            (_B + r"(pos_embed|pos_embed_window)", r"backbone.\1"),
            (r"no_memory_embedding", "no_memory_embedding"),
            (r"shared_image_embedding\.positional_embedding", "positional_embedding"),
            (r"prompt_encoder\.shared_embedding\.positional_embedding", "prompt_positional_embedding"),
            (r"prompt_encoder\.(point_embed|not_a_point_embed|no_mask_embed)\.weight", r"\1"),
            (r"mask_decoder\.(obj_score_token|iou_token|mask_tokens)\.weight", r"mask_decoder.\1"),
            (_TLAYER + r"(" + _ATTN + r"\.(?:q_proj|k_proj|v_proj|o_proj)\.(?:weight|bias))",
             r"mask_decoder.transformer.layer_\1.\2"),
            (_TLAYER + r"((?:layer_norm[1-4]|mlp\.proj_in|mlp\.proj_out)\.(?:weight|bias))",
             r"mask_decoder.transformer.layer_\1.\2"),
            (r"mask_decoder\.transformer\.(final_attn_token_to_image\.(?:q_proj|k_proj|v_proj|o_proj)"
             r"\.(?:weight|bias))", r"mask_decoder.transformer.\1"),
            (r"mask_decoder\.transformer\.layer_norm_final_attn\.(weight|bias)",
             r"mask_decoder.transformer.layer_norm_final_attn.\1"),
            (r"mask_decoder\.(upscale_conv[12]|upscale_layer_norm|conv_s0|conv_s1)\.(weight|bias)",
             r"mask_decoder.\1.\2"),
            (r"mask_decoder\." + _HEAD + r"\.(proj_in|proj_out)\.(weight|bias)", r"mask_decoder.\1.\2.\3"),
            (r"mask_decoder\." + _HEAD + r"\.layers\.0\.(weight|bias)", r"mask_decoder.\1.hidden.\2"),
            *(_VIDEO_ROWS if is_video(cfg) else ()),
        ),
        # the mask-prompt encoder (and mask_downsample) serve mask prompts, which no entry takes;
        # no_memory_positional_encoding is never read upstream. An image config (model_type sam2)
        # binds the image path only: a video checkpoint's memory is then left out too
        unused=(r"prompt_encoder\.mask_embed\..*", r"memory_.*", r"mask_downsample\..*", r"object_pointer_proj\..*",
                r"temporal_positional_encoding_projection_layer\..*", r"no_memory_positional_encoding",
                r"no_object_pointer", r"occlusion_spatial_embedding_parameter"),
    )


_ME = r"memory_encoder\."
_VIDEO_ROWS = (  # a Sam2VideoModel checkpoint's memory (the program's paths, where they differ)
    (_ME + r"mask_downsampler\.layers\.(\d+)\.(conv|layer_norm)\.(weight|bias)",
     r"memory_encoder.mask_downsampler.layer_\1.\2.\3"),
    (_ME + r"memory_fuser\.layers\.(\d+)\.(.+)", r"memory_encoder.memory_fuser.\1.\2"),
    (r"(memory_encoder\.(?:mask_downsampler\.final_conv|feature_projection|projection)\.(?:weight|bias))", r"\1"),
    (r"(memory_attention\.(?:layers\.\d+\.(?:self_attn|cross_attn_image)\.[qkvo]_proj|layers\.\d+\.linear[12]"
     r"|layers\.\d+\.layer_norm[123]|layer_norm)\.(?:weight|bias))", r"\1"),
    (r"(memory_temporal_positional_encoding|no_object_pointer|occlusion_spatial_embedding_parameter)", r"\1"),
    (r"object_pointer_proj\.(proj_in|proj_out)\.(weight|bias)", r"object_pointer_proj.\1.\2"),
    (r"object_pointer_proj\.layers\.0\.(weight|bias)", r"object_pointer_proj.hidden.\1"),
    (r"(temporal_positional_encoding_projection_layer\.(?:weight|bias))", r"\1"),
)


def settings(cfg: dict) -> dict[str, Any]:
    bb = _backbone(cfg)
    decoder = cfg.get("mask_decoder_config") or {}
    out = {"eps": bb.get("layer_norm_eps", 1e-6),
           "stability_delta": decoder.get("dynamic_multimask_stability_delta", 0.05),
           "stability_thresh": decoder.get("dynamic_multimask_stability_thresh", 0.98)}
    if is_video(cfg):
        out.update({"sigmoid_scale": cfg.get("sigmoid_scale_for_mem_enc", 20.0),
                    "sigmoid_bias": cfg.get("sigmoid_bias_for_mem_enc", -10.0),
                    "rope_theta": (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)})
    return out


PREPROCESS = {
    "image_processor_type": "Sam2ImageProcessorFast", "do_resize": True, "size": {"height": 1024, "width": 1024},
    "resample": 2, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
    "image_mean": list(IMAGENET_MEAN), "image_std": list(IMAGENET_STD), "do_convert_rgb": True,
}

FAMILY = Family(
    "sam2", root=lambda cfg: (sam2_video.model_for if is_video(cfg) else sam2.model_for)(layout(cfg)),
    generics=generics, bindings=bindings, settings=settings,
    model_types=("sam2", "sam2_video"),  # the hub checkpoints are the video model's; the image path is the same
    resizable=("E",),
    rebind=lambda cfg, given: generics(cfg, **given),
    preprocess=PREPROCESS,
    description="SAM 2.1: Hiera encoder with FPN neck, point and box prompts, mask decoder; memory for video",
    license="Apache-2.0",
    capabilities=Capabilities(tasks=("segment",), segmenter="sam2", recipe="sam2-edge", processor="sam2"),
)

_TINY = {
    "model_type": "sam2_video",  # the hub repo's config: Sam2VideoModel (the memory's settings are the defaults)
    "vision_config": {
        "model_type": "sam2_vision_model",
        "backbone_config": {
            "model_type": "sam2_hiera_det_model", "hidden_size": 96, "embed_dim_per_stage": [96, 192, 384, 768],
            "num_attention_heads_per_stage": [1, 2, 4, 8], "blocks_per_stage": [1, 2, 7, 2],
            "window_size_per_stage": [8, 4, 14, 7], "global_attention_blocks": [5, 7, 9],
            "window_positional_embedding_background_size": [7, 7], "image_size": [1024, 1024],
            "patch_kernel_size": [7, 7], "patch_stride": [4, 4], "patch_padding": [3, 3], "query_stride": [2, 2],
            "num_query_pool_stages": 3, "mlp_ratio": 4.0, "hidden_act": "gelu", "layer_norm_eps": 1e-6,
        },
        "backbone_channel_list": [768, 384, 192, 96], "backbone_feature_sizes": [[256, 256], [128, 128], [64, 64]],
        "fpn_hidden_size": 256, "fpn_kernel_size": 1, "fpn_stride": 1, "fpn_padding": 0,
        "fpn_top_down_levels": [2, 3], "num_feature_levels": 3,
    },
    "prompt_encoder_config": {"hidden_size": 256, "image_size": 1024, "patch_size": 16, "mask_input_channels": 16,
                              "num_point_embeddings": 4, "scale": 1},
    "mask_decoder_config": {
        "hidden_size": 256, "mlp_dim": 2048, "num_hidden_layers": 2, "num_attention_heads": 8,
        "attention_downsample_rate": 2, "num_multimask_outputs": 3, "iou_head_depth": 3, "iou_head_hidden_dim": 256,
        "dynamic_multimask_via_stability": True, "dynamic_multimask_stability_delta": 0.05,
        "dynamic_multimask_stability_thresh": 0.98,
    },
}

# The other sizes of the family, as their backbone configs differ from tiny's (the published
# checkpoints' values: facebook/sam2.1-hiera-* config.json, and the sam2.1_hiera_*.yaml they come from)
FAMILY_BACKBONES = {
    "small": {"blocks_per_stage": [1, 2, 11, 2], "global_attention_blocks": [7, 10, 13]},
    "base-plus": {"hidden_size": 112, "embed_dim_per_stage": [112, 224, 448, 896],
                  "num_attention_heads_per_stage": [2, 4, 8, 16], "blocks_per_stage": [2, 3, 16, 3],
                  "global_attention_blocks": [12, 16, 20], "window_positional_embedding_background_size": [14, 14]},
    "large": {"hidden_size": 144, "embed_dim_per_stage": [144, 288, 576, 1152],
              "num_attention_heads_per_stage": [2, 4, 8, 16], "blocks_per_stage": [2, 6, 36, 4],
              "global_attention_blocks": [23, 33, 43], "window_size_per_stage": [8, 4, 16, 8]},
}


def _sized(size: str) -> dict[str, Any]:
    """Tiny's config with ``size``'s backbone (and the neck's channel list that follows from it)."""
    cfg = copy.deepcopy(_TINY)
    bb = cfg["vision_config"]["backbone_config"]
    bb.update(FAMILY_BACKBONES[size])
    cfg["vision_config"]["backbone_channel_list"] = list(reversed(bb["embed_dim_per_stage"]))
    return cfg


# tiny's revision is pinned; the others follow the hub's main branch until their revisions are pinned
CARDS = [
    Card("sam2.1-hiera-tiny", FAMILY, "facebook/sam2.1-hiera-tiny", "de431c4043854a71d8101e17995dfe596bf101a5",
         "SAM 2.1 Hiera-tiny", config=_TINY),
    Card("sam2.1-hiera-small", FAMILY, "facebook/sam2.1-hiera-small", "main", "SAM 2.1 Hiera-small",
         config=_sized("small")),
    Card("sam2.1-hiera-base-plus", FAMILY, "facebook/sam2.1-hiera-base-plus", "main", "SAM 2.1 Hiera-base-plus",
         config=_sized("base-plus")),
    Card("sam2.1-hiera-large", FAMILY, "facebook/sam2.1-hiera-large", "main", "SAM 2.1 Hiera-large",
         config=_sized("large")),
]
