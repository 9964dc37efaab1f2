"""SAM's pre- and post-processing, with the arithmetic of transformers' ``SamProcessor``.

1. **Image.** RGB (EXIF-upright, alpha composited as the other processors do), the longest side
   resized to 1024 with PIL (bilinear by default) at ``int(side * 1024 / longest + 0.5)``, rescaled
   (``float64(pixel) / 255`` rounded to float32), normalised, then zero-padded at the bottom and right
   to 1024 x 1024. The resized size is ``reshaped_input_size``.
2. **Prompts.** Point and box coordinates are in pixels of the original image; each x is scaled by
   ``new_w / old_w`` and each y by ``new_h / old_h`` (float64, then float32). Prompts of one image with
   different point counts are padded with points at ``(-10, -10)`` labelled ``-10`` (ignored).
3. **Masks.** Low-resolution logits ``[..., 256, 256]`` are upsampled bilinearly to 1024, cropped to
   ``reshaped_input_size``, resized bilinearly to the original size and thresholded at 0.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from ..models.cards.base import IMAGENET_MEAN, IMAGENET_STD
from .images import RESAMPLE, ImageSource, load_image, to_rgb
from .input_rules import check_prompts_inside
from .prompts import PAD, Prompt, PromptError


def preprocess_shape(height: int, width: int, longest_edge: int) -> tuple[int, int]:
    """The (height, width) that scales the longer side to ``longest_edge`` (rounded half up)."""
    scale = longest_edge * 1.0 / max(height, width)
    return int(height * scale + 0.5), int(width * scale + 0.5)


@dataclass(frozen=True)
class SamImage:
    """One image as the model takes it, with the sizes post-processing needs."""

    pixel_values: torch.Tensor  # float32 [1, 3, pad, pad]
    original_size: tuple[int, int]  # (height, width) of the photo
    reshaped_input_size: tuple[int, int]  # (height, width) after the resize, before the pad


@dataclass(frozen=True)
class SamImageProcessor:
    """``SamImageProcessor``'s settings; ``from_config`` reads a ``preprocessor_config.json`` dict."""

    longest_edge: int = 1024
    pad_size: tuple[int, int] = (1024, 1024)
    resample: str = "bilinear"
    rescale: float = 1 / 255
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    mask_size: int = 256  # the decoder's low-resolution mask side

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> SamImageProcessor:
        size = cfg.get("size") or {}
        longest = size.get("longest_edge", 1024) if isinstance(size, dict) else int(size)
        pad = cfg.get("pad_size") or {"height": 1024, "width": 1024}
        resample = {int(v): k for k, v in RESAMPLE.items()}.get(int(cfg.get("resample", 2)), "bilinear")
        mean, std = cfg.get("image_mean") or cls.mean, cfg.get("image_std") or cls.std
        if cfg.get("do_normalize") is False:
            mean, std = (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)
        rescale = float(cfg.get("rescale_factor") or 1 / 255) if cfg.get("do_rescale", True) else 1.0
        return cls(int(longest), (int(pad["height"]), int(pad["width"])), resample, rescale,
                   tuple(float(m) for m in mean), tuple(float(s) for s in std))  # type: ignore[arg-type]

    @classmethod
    def from_dir(cls, directory: str | os.PathLike[str] | None) -> SamImageProcessor:
        path = Path(directory) / "preprocessor_config.json" if directory is not None else None
        if path is None or not os.path.lexists(path):
            return cls()
        from .readers import ReadError, read_json_object

        config = read_json_object(path, "preprocessor config")
        try:
            return cls.from_config(config)
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise ReadError(path, f"not a usable SAM image processor config: {e}") from None

    def __call__(self, image: ImageSource | np.ndarray) -> SamImage:
        if isinstance(image, np.ndarray):
            image = Image.fromarray(image)
        elif not isinstance(image, Image.Image):
            image = load_image(image)
        image = to_rgb(image)
        original = (image.height, image.width)
        h, w = preprocess_shape(*original, self.longest_edge)
        resized = image.resize((w, h), resample=RESAMPLE[self.resample])
        pixels = torch.from_numpy(np.array(resized)).permute(2, 0, 1).to(torch.float64) * self.rescale
        pixels = pixels.to(torch.float32)
        mean = torch.tensor(self.mean, dtype=torch.float32).view(3, 1, 1)
        std = torch.tensor(self.std, dtype=torch.float32).view(3, 1, 1)
        pixels = (pixels - mean) / std
        ph, pw = self.pad_size
        if h > ph or w > pw:
            raise ValueError(f"the resized image {h} x {w} does not fit the pad size {ph} x {pw}")
        pixels = F.pad(pixels, (0, pw - w, 0, ph - h))
        return SamImage(pixels.unsqueeze(0), original, (h, w))

    # ------------------------------------------------------------------------------ coordinates

    def scale_coords(self, coords: np.ndarray, original_size: tuple[int, int]) -> np.ndarray:
        """``[..., 2]`` (x, y) pixels of the photo to pixels of the model frame."""
        old_h, old_w = original_size
        new_h, new_w = preprocess_shape(old_h, old_w, self.longest_edge)
        out = np.array(coords, dtype=np.float64, copy=True)
        out[..., 0] *= new_w / old_w
        out[..., 1] *= new_h / old_h
        return out

    # ---------------------------------------------------------------------------- masks

    def post_process_masks(self, masks: torch.Tensor, original_size: tuple[int, int],
                           reshaped_input_size: tuple[int, int], threshold: float | None = 0.0) -> torch.Tensor:
        """``[P, M, 256, 256]`` logits to ``[P, M, H, W]`` at the photo's size (bool unless ``threshold`` is None)."""
        x = F.interpolate(masks.float(), self.pad_size, mode="bilinear", align_corners=False)
        x = x[..., : reshaped_input_size[0], : reshaped_input_size[1]]
        x = F.interpolate(x, original_size, mode="bilinear", align_corners=False)
        return x if threshold is None else x > threshold

    def mask_prompt(self, mask: np.ndarray | torch.Tensor, original_size: tuple[int, int]) -> torch.Tensor:
        """A dense prompt ``[1, 1, 256, 256]`` from low-resolution logits, or from a photo-sized binary mask.

        A ``256 x 256`` array is taken as the logits a previous decode returned. A photo-sized mask is
        resized into the model frame (nearest, the image's resize then pad, at a quarter of the size)
        and mapped to logits +10 inside, -10 outside.
        """
        m = torch.as_tensor(np.asarray(mask))
        side = self.mask_size
        if m.dim() != 2:
            raise PromptError(f"mask prompt: expected a 2-D mask, got shape {tuple(m.shape)}")
        if tuple(m.shape) == (side, side):
            return m.float().reshape(1, 1, side, side)
        if tuple(m.shape) != tuple(original_size):
            raise PromptError(f"mask prompt: expected {side} x {side} logits or a mask of the image's size "
                              f"{original_size[0]} x {original_size[1]}, got {m.shape[0]} x {m.shape[1]}")
        h, w = preprocess_shape(*original_size, side)
        small = F.interpolate((m > 0).float()[None, None], (h, w), mode="nearest")
        small = F.pad(small, (0, side - w, 0, side - h))
        return small * 20 - 10


# ------------------------------------------------------------------------------------- prompts


@dataclass(frozen=True)
class PromptTensors:
    """One image's prompts in the model frame, padded as the processor pads them."""

    points: torch.Tensor | None  # float32 [1, P, N, 2]
    labels: torch.Tensor | None  # int32 [1, P, N]
    boxes: torch.Tensor | None  # float32 [1, P, 4]


def prompt_tensors(prompts: Sequence[Prompt], original_size: tuple[int, int],
                   processor: SamImageProcessor) -> PromptTensors:
    """Check ``prompts`` and turn them into the model's tensors.

    Either every prompt has a box or none has; prompts with fewer points are padded with ``-10`` points
    (as ``SamProcessor`` pads ragged lists). A prompt without points, among prompts with points, is
    all padding.
    """
    if not prompts:
        raise PromptError("no prompt: give at least one point or box")
    for i, p in enumerate(prompts):
        p.check(f"prompt {i}" if len(prompts) > 1 else "prompt")
    check_prompts_inside(prompts, original_size[1], original_size[0])  # refused, not clipped: input_rules
    with_box = [p.box is not None for p in prompts]
    if any(with_box) and not all(with_box):
        missing = with_box.index(False)
        raise PromptError(f"prompt {missing} has no box while others have one: SAM decodes the prompts of one "
                          "image together, so either every prompt has a box or none has")
    n = max(len(p.points) for p in prompts)
    points = labels = boxes = None
    if n:
        pts = np.full((len(prompts), n, 2), float(PAD))
        lab = np.full((len(prompts), n), PAD, dtype=np.int64)
        for i, p in enumerate(prompts):
            if p.points:
                pts[i, : len(p.points)] = processor.scale_coords(np.array(p.points, dtype=np.float64), original_size)
                lab[i, : len(p.points)] = p.labels
        points = torch.from_numpy(pts).float().unsqueeze(0)
        labels = torch.from_numpy(lab).to(torch.int32).unsqueeze(0)
    if all(with_box):
        b = np.array([p.box for p in prompts], dtype=np.float64).reshape(-1, 2, 2)
        boxes = torch.from_numpy(processor.scale_coords(b, original_size).reshape(-1, 4)).float().unsqueeze(0)
    return PromptTensors(points, labels, boxes)
