"""Segment everything: automatic mask generation as transformers' ``mask-generation`` pipeline does it.

For the whole image (and, with ``crops_n_layers``, for 2 x 2, 4 x 4 ... overlapping crops of it):

1. a ``points_per_side`` x ``points_per_side`` grid of points at cell centres (fewer per side in
   deeper crop layers with ``crop_n_points_downscale_factor``), each its own one-point prompt;
2. the crop encoded once, the points decoded ``points_per_batch`` at a time with three masks each;
3. masks upsampled to the crop's size; kept when the predicted IoU > ``pred_iou_thresh`` and the
   stability score (IoU of the mask thresholded at +offset and at -offset) > ``stability_score_thresh``;
4. thresholded, boxed, dropped when the box touches a crop edge that is not an image edge, placed in
   the full image and run-length encoded (so memory holds RLEs, not masks);
5. box non-maximum suppression over everything kept (IoU > ``crops_nms_thresh`` suppresses the lower
   predicted IoU), best first.

Memory is bounded by ``points_per_batch`` (the decoder's activations: about 30 MiB a point for SAM at
1024, so 16 points at once peak near 0.5 GiB where transformers' 64 take 2 GiB, at the same speed as measured
in bench/sam.py) and ``mask_chunk`` (full-size masks alive at once). The results do not depend on either.
The reference does no small-region cleanup by default, and neither does this.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import product
from typing import Any

import numpy as np
import torch

from . import coco


@dataclass
class MaskGenerationResult:
    """Every mask found, best predicted IoU first."""

    size: tuple[int, int]  # (height, width) of the image
    rles: list[dict[str, Any]] = field(default_factory=list)  # COCO RLE of each mask
    scores: list[float] = field(default_factory=list)  # predicted IoU
    stability: list[float] = field(default_factory=list)
    boxes: list[list[float]] = field(default_factory=list)  # x0, y0, x1, y1 (inclusive pixel edges)
    areas: list[int] = field(default_factory=list)
    points: list[list[float]] = field(default_factory=list)  # the prompt point, in pixels of the image
    crop_boxes: list[list[int]] = field(default_factory=list)  # x0, y0, x1, y1 of the crop it came from

    @property
    def masks(self) -> list[np.ndarray]:
        """The masks as bool ``[H, W]`` arrays (decoded from the RLEs)."""
        return [coco.decode(r) for r in self.rles]


def point_grid(n_per_side: int) -> np.ndarray:
    """``[n * n, 2]`` (x, y) cell centres of an ``n x n`` grid over [0, 1]^2, row by row."""
    offset = 1 / (2 * n_per_side)
    side = np.linspace(offset, 1 - offset, n_per_side)
    return np.stack([np.tile(side[None, :], (n_per_side, 1)), np.tile(side[:, None], (1, n_per_side))],
                    axis=-1).reshape(-1, 2)


def crop_boxes(size: tuple[int, int], crops_n_layers: int, overlap_ratio: float) -> tuple[list[list[int]], list[int]]:
    """The whole image, then layer ``i``'s ``2^i x 2^i`` overlapping crops: ``(x0, y0, x1, y1)`` and layer."""
    h, w = size
    boxes, layers = [[0, 0, w, h]], [0]
    for i in range(crops_n_layers):
        n = 2 ** (i + 1)
        overlap = int(overlap_ratio * min(h, w) * (2 / n))
        cw = math.ceil((overlap * (n - 1) + w) / n)
        ch = math.ceil((overlap * (n - 1) + h) / n)
        for x0, y0 in product([int((cw - overlap) * k) for k in range(n)], [int((ch - overlap) * k) for k in range(n)]):
            boxes.append([x0, y0, min(x0 + cw, w), min(y0 + ch, h)])
            layers.append(i + 1)
    return boxes, layers


def check_crops(width: int, height: int, crops_n_layers: int, overlap_ratio: float = 512 / 1500) -> None:
    """Refuse ``crops_n_layers`` when an image of ``width x height`` is too small for every crop to hold a pixel."""
    from .input_rules import InputRuleError

    crops, layers = crop_boxes((height, width), crops_n_layers, overlap_ratio)
    empty = next((layer for box, layer in zip(crops, layers) if box[2] <= box[0] or box[3] <= box[1]), None)
    if empty is not None:
        side = 2 ** empty
        raise InputRuleError(f"--crops-n-layers {crops_n_layers}: the image is {width} x {height} pixels, too small "
                             f"to cut into {side} x {side} crops (layer {empty} would have empty crops); use a "
                             "lower --crops-n-layers")


def stability_score(logits: torch.Tensor, threshold: float, offset: float) -> torch.Tensor:
    """Area above ``threshold + offset`` over area above ``threshold - offset``, per mask."""
    inter = (logits > threshold + offset).sum(-1, dtype=torch.int16).sum(-1, dtype=torch.int32)
    union = (logits > threshold - offset).sum(-1, dtype=torch.int16).sum(-1, dtype=torch.int32)
    return inter / union


def mask_boxes(masks: torch.Tensor) -> torch.Tensor:
    """``[N, H, W]`` bool to ``[N, 4]`` (x0, y0, x1, y1) of the set pixels; ``0, 0, 0, 0`` when empty."""
    if masks.numel() == 0:
        return torch.zeros(*masks.shape[:-2], 4, dtype=torch.long)
    h, w = masks.shape[-2:]
    rows, cols = masks.any(-1), masks.any(-2)
    ys, xs = torch.arange(h), torch.arange(w)
    bottom = (rows * ys).amax(-1)
    top = (rows * ys + h * ~rows).amin(-1)
    right = (cols * xs).amax(-1)
    left = (cols * xs + w * ~cols).amin(-1)
    box = torch.stack([left, top, right, bottom], -1)
    empty = (right < left) | (bottom < top)
    return box * ~empty[:, None]


def near_crop_edge(boxes: torch.Tensor, crop: Sequence[int], image: Sequence[int], atol: float = 20.0) -> torch.Tensor:
    """Boxes (in crop coordinates) within ``atol`` of an edge of the crop that is not an edge of the image."""
    left, top = crop[0], crop[1]
    b = (boxes + torch.tensor([left, top, left, top])).float()
    crop_t, image_t = torch.tensor(crop, dtype=torch.float), torch.tensor(image, dtype=torch.float)
    near_crop = torch.isclose(b, crop_t[None], atol=atol, rtol=0)
    near_image = torch.isclose(b, image_t[None], atol=atol, rtol=0)
    return (near_crop & ~near_image).any(1)


def box_nms(boxes: torch.Tensor, scores: torch.Tensor, iou_threshold: float) -> list[int]:
    """Greedy non-maximum suppression: indices kept, highest score first (ties in input order)."""
    order = torch.sort(scores, descending=True, stable=True).indices
    b = boxes.double()
    area = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    suppressed = torch.zeros(len(b), dtype=torch.bool)
    keep: list[int] = []
    for i in order.tolist():
        if suppressed[i]:
            continue
        keep.append(i)
        xx0, yy0 = torch.maximum(b[i, 0], b[:, 0]), torch.maximum(b[i, 1], b[:, 1])
        xx1, yy1 = torch.minimum(b[i, 2], b[:, 2]), torch.minimum(b[i, 3], b[:, 3])
        inter = (xx1 - xx0).clamp(min=0) * (yy1 - yy0).clamp(min=0)
        iou = inter / (area[i] + area - inter)
        suppressed |= iou > iou_threshold
    return keep


def generate_masks(segmenter: Any, image: Any, points_per_side: int = 32, points_per_batch: int = 16,
                   pred_iou_thresh: float = 0.88, stability_score_thresh: float = 0.95,
                   stability_score_offset: float = 1.0, mask_threshold: float = 0.0, crops_nms_thresh: float = 0.7,
                   crops_n_layers: int = 0, crop_overlap_ratio: float = 512 / 1500,
                   crop_n_points_downscale_factor: int = 1, mask_chunk: int = 16,
                   progress: bool = False) -> MaskGenerationResult:
    """Every object in ``image`` (a path or PIL image): masks as COCO RLE with scores, best first.

    ``segmenter`` is any :class:`~kestrel.pipelines.segmenter.Segmenter` (SAM, SAM 2.1). The defaults are the
    transformers pipeline's (and Segment Anything's automatic generator's, bar its per-crop NMS), but for
    ``points_per_batch`` (16 against its 64: a quarter of the decoder's memory, no slower).
    """
    from PIL import Image
    from tqdm import tqdm

    from .images import load_image, to_rgb
    from .input_rules import InputRuleError

    if points_per_side < 1 or points_per_batch < 1:
        raise InputRuleError(f"points_per_side and points_per_batch must be positive, got {points_per_side}, "
                             f"{points_per_batch}")
    if crops_n_layers < 0:
        raise InputRuleError(f"crops_n_layers must be 0 or more, got {crops_n_layers}")
    photo = to_rgb(image if isinstance(image, Image.Image) else load_image(image))
    size = (photo.height, photo.width)
    check_crops(photo.width, photo.height, crops_n_layers, crop_overlap_ratio)
    crops, layers = crop_boxes(size, crops_n_layers, crop_overlap_ratio)
    grids = [point_grid(int(points_per_side / crop_n_points_downscale_factor ** i)) for i in range(crops_n_layers + 1)]

    kept: dict[str, list[Any]] = {k: [] for k in ("rles", "scores", "stability", "boxes", "areas", "points", "crops")}
    total = sum(len(grids[layer]) for layer in layers)
    bar = tqdm(total=total, unit="pt", desc="segment everything", disable=not progress)
    for crop, layer in zip(crops, layers):
        x0, y0, x1, y1 = crop
        crop_image = photo.crop((x0, y0, x1, y1))
        emb = segmenter.encode(crop_image)
        ch, cw = emb.original_size
        pts_px = grids[layer] * np.array([cw, ch])[None, :]  # in pixels of the crop
        pts = segmenter.frame_points(pts_px, (ch, cw))  # in the model frame (float64 as upstream)
        for b0 in range(0, len(pts), points_per_batch):
            batch = torch.from_numpy(pts[b0: b0 + points_per_batch]).float()
            n = batch.shape[0]
            masks, iou = segmenter.decode_grid(emb, batch)  # the three multimask outputs of each point
            low_res, iou = masks.flatten(0, 1), iou.flatten(0, 1)
            owner = torch.arange(n).repeat_interleave(3) + b0
            keep = iou > pred_iou_thresh if pred_iou_thresh > 0 else torch.ones_like(iou, dtype=torch.bool)
            for c0 in range(0, len(low_res), mask_chunk):  # full-size masks a chunk at a time
                sel = torch.nonzero(keep[c0: c0 + mask_chunk]).flatten() + c0
                if len(sel) == 0:
                    continue
                full = segmenter.postprocess(low_res[sel][None], emb, threshold=None)[0]  # [k, H, W] logits
                stab = stability_score(full, mask_threshold, stability_score_offset)
                ok = stab > stability_score_thresh if stability_score_thresh > 0 else torch.ones_like(stab).bool()
                full, sel, stab = full[ok], sel[ok], stab[ok]
                binary = full > mask_threshold
                del full
                boxes = mask_boxes(binary)
                edge = near_crop_edge(boxes, crop, [0, 0, size[1], size[0]])
                for j in torch.nonzero(~edge).flatten().tolist():
                    m = binary[j]
                    if (x0, y0, x1, y1) != (0, 0, size[1], size[0]):
                        m = torch.nn.functional.pad(m, (x0, size[1] - x1, y0, size[0] - y1))
                    kept["rles"].append(coco.encode(m))
                    kept["scores"].append(float(iou[sel[j]]))
                    kept["stability"].append(float(stab[j]))
                    kept["boxes"].append((boxes[j] + torch.tensor([x0, y0, x0, y0])).tolist())
                    kept["areas"].append(int(m.sum()))
                    px = pts_px[int(owner[sel[j]])]
                    kept["points"].append([float(px[0]) + x0, float(px[1]) + y0])
                    kept["crops"].append(list(crop))
            bar.update(n)
    bar.close()

    result = MaskGenerationResult(size)
    if not kept["scores"]:
        return result
    order = box_nms(torch.tensor(kept["boxes"], dtype=torch.float), torch.tensor(kept["scores"]), crops_nms_thresh)
    for i in order:
        result.rles.append(kept["rles"][i])
        result.scores.append(kept["scores"][i])
        result.stability.append(kept["stability"][i])
        result.boxes.append(kept["boxes"][i])
        result.areas.append(kept["areas"][i])
        result.points.append(kept["points"][i])
        result.crop_boxes.append(kept["crops"][i])
    return result
