"""COCO output of segment-everything: masks as COCO RLE through ``pycocotools`` (the field's own library), and
the annotation records Segment Anything's automatic generator writes.

An encoded mask is ``{"size": [H, W], "counts": str}``: pycocotools' compressed counts as text, so it goes into
JSON and Parquet as is, and ``pycocotools.mask.decode`` reads it back.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from pycocotools import mask as coco_mask


def encode(mask: np.ndarray | torch.Tensor) -> dict[str, Any]:
    """``{"size": [H, W], "counts": str}`` of one ``[H, W]`` binary mask."""
    m = np.asfortranarray(np.asarray(torch.as_tensor(np.asarray(mask)).bool(), dtype=np.uint8))
    rle = coco_mask.encode(m)
    return {"size": [int(v) for v in rle["size"]], "counts": rle["counts"].decode("ascii")}


def decode(rle: dict[str, Any]) -> np.ndarray:
    """A bool ``[H, W]`` mask from :func:`encode`'s output (compressed counts as text or bytes, or a list)."""
    counts = rle["counts"]
    h, w = (int(v) for v in rle["size"])
    if isinstance(counts, list):
        counts = coco_mask.frPyObjects({"size": [h, w], "counts": counts}, h, w)["counts"]
    elif isinstance(counts, str):
        counts = counts.encode("ascii")
    return coco_mask.decode({"size": [h, w], "counts": counts}).astype(bool)


def coco_annotations(result: Any, image: str = "") -> dict[str, Any]:
    """Segment-everything output as JSON: one record per mask, ``segmentation`` in COCO RLE.

    Records carry ``area``, ``bbox`` (x, y, w, h), ``predicted_iou``, ``stability_score``,
    ``point_coords`` and ``crop_box`` (x, y, w, h), as Segment Anything's automatic generator writes them.
    """
    h, w = result.size
    anns = []
    for k in range(len(result.scores)):
        x0, y0, x1, y1 = (float(v) for v in result.boxes[k])
        cx0, cy0, cx1, cy1 = (float(v) for v in result.crop_boxes[k])
        anns.append({
            "id": k, "segmentation": result.rles[k], "area": int(result.areas[k]),
            "bbox": [x0, y0, x1 - x0, y1 - y0], "predicted_iou": float(result.scores[k]),
            "stability_score": float(result.stability[k]),
            "point_coords": [[float(v) for v in result.points[k]]], "crop_box": [cx0, cy0, cx1 - cx0, cy1 - cy0],
        })
    return {"image": image, "height": int(h), "width": int(w), "annotations": anns}
