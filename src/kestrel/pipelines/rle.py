"""COCO run-length encoding of binary masks (the format ``pycocotools.mask`` reads), written here.

A mask is read in column-major (Fortran) order; ``counts`` alternates run lengths starting with a run
of zeros (possibly empty). The compressed string form writes each count (from the third on, as the
difference from the count two before) in 5-bit groups, low group first, each group plus 48 as one
character, bit 0x20 set while more groups follow (the sign is carried by bit 0x10 of the last group).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def mask_to_counts(mask: np.ndarray | torch.Tensor) -> list[int]:
    """Uncompressed COCO counts of one ``[H, W]`` binary mask."""
    m = torch.as_tensor(np.asarray(mask)).bool()
    flat = m.t().reshape(-1)
    n = flat.numel()
    if n == 0:
        return [0]
    change = torch.nonzero(flat[1:] != flat[:-1]).flatten() + 1
    edges = torch.cat([torch.zeros(1, dtype=torch.long), change, torch.tensor([n])])
    runs = (edges[1:] - edges[:-1]).tolist()
    return ([0] if bool(flat[0]) else []) + runs


def counts_to_string(counts: list[int]) -> str:
    """The compressed (LEB128-like) string of uncompressed counts."""
    out = []
    for i, count in enumerate(counts):
        x = count - counts[i - 2] if i > 2 else count
        more = True
        while more:
            c = x & 0x1F
            x >>= 5  # arithmetic shift: a negative difference ends at -1
            more = (x != -1) if (c & 0x10) else (x != 0)
            if more:
                c |= 0x20
            out.append(chr(c + 48))
    return "".join(out)


def string_to_counts(s: str) -> list[int]:
    """Inverse of :func:`counts_to_string`."""
    counts: list[int] = []
    i = 0
    while i < len(s):
        x, k, more = 0, 0, True
        while more:
            c = ord(s[i]) - 48
            x |= (c & 0x1F) << (5 * k)
            more = bool(c & 0x20)
            i += 1
            k += 1
            if not more and (c & 0x10):
                x |= -1 << (5 * k)
        if len(counts) > 2:
            x += counts[-2]
        counts.append(x)
    return counts


def encode(mask: np.ndarray | torch.Tensor) -> dict[str, Any]:
    """``{"size": [H, W], "counts": str}``: what ``pycocotools.mask.decode`` reads back."""
    h, w = np.asarray(mask).shape
    return {"size": [int(h), int(w)], "counts": counts_to_string(mask_to_counts(mask))}


def decode(rle: dict[str, Any]) -> np.ndarray:
    """A bool ``[H, W]`` mask from :func:`encode`'s output (or uncompressed ``counts``)."""
    h, w = rle["size"]
    counts = rle["counts"]
    if isinstance(counts, bytes):
        counts = counts.decode()
    if isinstance(counts, str):
        counts = string_to_counts(counts)
    flat = np.zeros(h * w, dtype=bool)
    pos, value = 0, False
    for c in counts:
        if value:
            flat[pos: pos + c] = True
        pos += c
        value = not value
    return flat.reshape(w, h).T


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
