"""COCO run-length encoding of binary masks (the ``{"size": [h, w], "counts": str}`` of COCO results).

Runs are counted over the mask in column-major order (down the first column, then the next),
starting with a run of zeros (possibly empty). The compressed ``counts`` string stores each run,
from the third on as the difference from the run two before, in 5-bit groups, low group first,
each group + 48 as one ASCII character with bit 0x20 marking that another group follows; this is
the format of the COCO API's ``mask.encode``.
"""

from __future__ import annotations

import numpy as np


def runs(mask: np.ndarray) -> list[int]:
    """Run lengths of a 2-D boolean mask in column-major order, starting with zeros."""
    if mask.ndim != 2:
        raise ValueError(f"a mask is 2-D [height, width], got shape {mask.shape}")
    flat = np.asarray(mask, dtype=bool).reshape(-1, order="F")
    if flat.size == 0:
        return []
    change = np.flatnonzero(flat[1:] != flat[:-1]) + 1
    bounds = np.concatenate([[0], change, [flat.size]])
    counts = np.diff(bounds).tolist()
    return [0, *counts] if flat[0] else counts


def encode_counts(counts: list[int]) -> str:
    """The COCO compressed string of run lengths."""
    out = []
    for i, run in enumerate(counts):
        x = run - counts[i - 2] if i > 2 else run
        more = True
        while more:
            c = x & 0x1F
            x >>= 5
            more = x != -1 if c & 0x10 else x != 0
            if more:
                c |= 0x20
            out.append(chr(c + 48))
    return "".join(out)


def decode_counts(text: str) -> list[int]:
    """Run lengths from a COCO compressed string (the inverse of :func:`encode_counts`)."""
    counts: list[int] = []
    p = 0
    while p < len(text):
        x = k = 0
        more = True
        while more:
            c = ord(text[p]) - 48
            x |= (c & 0x1F) << (5 * k)
            more = bool(c & 0x20)
            p += 1
            k += 1
            if not more and c & 0x10:
                x |= -1 << (5 * k)
        if len(counts) > 2:
            x += counts[-2]
        counts.append(x)
    return counts


def encode(mask: np.ndarray) -> dict:
    """``{"size": [h, w], "counts": str}`` of a 2-D boolean mask."""
    return {"size": [int(mask.shape[0]), int(mask.shape[1])], "counts": encode_counts(runs(mask))}


def decode(rle: dict) -> np.ndarray:
    """The boolean mask of a COCO RLE dict with a compressed (str) or uncompressed (list) ``counts``."""
    h, w = rle["size"]
    counts = rle["counts"]
    counts = decode_counts(counts) if isinstance(counts, str) else list(counts)
    if sum(counts) != h * w:
        raise ValueError(f"RLE runs cover {sum(counts)} pixels, size {h}x{w} has {h * w}")
    values = np.zeros(len(counts), dtype=bool)
    values[1::2] = True
    return np.repeat(values, counts).reshape((h, w), order="F")
