"""DINOv2 backbones (``Dinov2Model`` checkpoints): small, base, large and giant (SwiGLU)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from .. import dinov2
from ..capabilities import Capabilities
from .base import IMAGENET_MEAN, IMAGENET_STD, Bindings, Card, Family, Transform, pair
from .vit import embedding_and_attention_rows, layer_pattern, layer_rows

BINDINGS = Bindings(
    rows=(
        *embedding_and_attention_rows("dinov2"),
        *layer_rows("dinov2", {"norm1": "norm1", "norm2": "norm2", "mlp.fc1": "up", "mlp.fc2": "down",
                               "mlp.weights_in": "mlp.weights_in", "mlp.weights_out": "mlp.weights_out"}),
        (layer_pattern("dinov2") + r"(layer_scale1|layer_scale2)\.lambda1", r"layers.\1.\2.lambda1"),
        (r"(?:dinov2\.)?layernorm\.(weight|bias)", r"norm.\1"),
    ),
    # the mask token only serves masked-image pretraining
    unused=(r"(?:dinov2\.)?embeddings\.mask_token",),
)


def swiglu_hidden(cfg: dict) -> int:
    """The reference's SwiGLU width: two thirds of the MLP width, rounded up to a multiple of 8."""
    hidden = int(cfg["hidden_size"] * cfg.get("mlp_ratio", 4))
    return (int(hidden * 2 / 3) + 7) // 8 * 8


def generics(cfg: dict) -> dict[str, Any]:
    h, w = pair(cfg.get("image_size", 518))
    p, q = pair(cfg.get("patch_size", 14))
    if p != q:
        raise ValueError(f"DINOv2 with a rectangular patch {p}x{q} is not supported")
    out = {
        "Height": h, "Width": w, "Channels": cfg.get("num_channels", 3), "Patch": p,
        "D": cfg["hidden_size"], "Heads": cfg["num_attention_heads"], "Layers": cfg["num_hidden_layers"],
    }
    if cfg.get("use_swiglu_ffn"):
        out["Hidden"] = swiglu_hidden(cfg)
    else:
        out["Inner"] = int(cfg["hidden_size"] * cfg.get("mlp_ratio", 4))
    return out


def settings(cfg: dict) -> dict[str, Any]:
    if cfg.get("hidden_act", "gelu") != "gelu":
        raise ValueError(f"DINOv2 with hidden_act={cfg['hidden_act']!r} is not supported (only gelu)")
    return {"eps": cfg.get("layer_norm_eps", 1e-6)}


def resample_positions(table: torch.Tensor, generics: Mapping[str, Any]) -> torch.Tensor:
    """The reference's position interpolation, done once for the bound size.

    The class position stays; the square grid of patch positions is resampled bicubically (in f32,
    align_corners=False) to ``Height/Patch x Width/Patch``. As the reference, a square input of the
    trained grid size keeps the table unchanged.
    """
    n = table.shape[1] - 1
    side = math.isqrt(n)
    gh, gw = generics["Height"] // generics["Patch"], generics["Width"] // generics["Patch"]
    if gh * gw == n and generics["Height"] == generics["Width"]:
        return table
    dim = table.shape[-1]
    grid = table[:, 1:].reshape(1, side, side, dim).permute(0, 3, 1, 2)
    grid = F.interpolate(grid.to(torch.float32), size=(gh, gw), mode="bicubic", align_corners=False)
    grid = grid.to(table.dtype).permute(0, 2, 3, 1).reshape(1, gh * gw, dim)
    return torch.cat([table[:, :1], grid], dim=1)


def transforms(cfg: dict, bound: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], Transform]]:
    h, w = pair(cfg.get("image_size", 518))
    p = bound["Patch"]
    native = (1, 1 + (h // p) * (w // p), bound["D"])
    return {"positions": (native, resample_positions)}


FAMILY = Family(
    "dinov2", root=lambda cfg: dinov2.SwiGluModel if cfg.get("use_swiglu_ffn") else dinov2.Model,
    generics=generics, bindings=BINDINGS, settings=settings,
    transforms=transforms,
    resizable=("Height", "Width"),
    preprocess={"image_processor_type": "BitImageProcessor", "do_resize": True, "size": {"shortest_edge": 256},
                "resample": 3, "do_center_crop": True, "crop_size": {"height": 224, "width": 224},
                "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
                "image_mean": list(IMAGENET_MEAN), "image_std": list(IMAGENET_STD)},
    description="DINOv2 self-supervised ViT backbone",
    license="Apache-2.0",
    capabilities=Capabilities(tasks=("embed",), features="forward"),
)

_TITLE = "DINOv2-{}: the class token and one token per 14 x 14 patch"


def _config(hidden: int, heads: int, layers: int, swiglu: bool = False) -> dict[str, Any]:
    return {"model_type": "dinov2", "image_size": 518, "patch_size": 14, "num_channels": 3, "hidden_size": hidden,
            "num_attention_heads": heads, "num_hidden_layers": layers, "mlp_ratio": 4, "layer_norm_eps": 1e-6,
            "use_swiglu_ffn": swiglu, "hidden_act": "gelu"}


CARDS = [
    Card("dinov2-small", FAMILY, "facebook/dinov2-small", "ed25f3a31f01632728cabb09d1542f84ab7b0056",
         _TITLE.format("Small"), _config(384, 6, 12)),
    Card("dinov2-base", FAMILY, "facebook/dinov2-base", "f9e44c814b77203eaa57a6bdbbd535f21ede1415",
         _TITLE.format("Base"), _config(768, 12, 12)),
    Card("dinov2-large", FAMILY, "facebook/dinov2-large", "47b73eefe95e8d44ec3623f8890bd894b6ea2d6c",
         _TITLE.format("Large"), _config(1024, 16, 24)),
    Card("dinov2-giant", FAMILY, "facebook/dinov2-giant", "611a9d42f2335e0f921f1e313ad3c1b7178d206d",
         _TITLE.format("Giant (SwiGLU)"), _config(1536, 24, 40, swiglu=True)),
]
