"""Drawing masks, points and boxes over a photo (for people who would rather look than read)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from PIL import Image, ImageDraw

# distinct, colour-blind-friendly hues (Okabe-Ito), cycled
PALETTE = [(0, 114, 178), (230, 159, 0), (0, 158, 115), (204, 121, 167), (86, 180, 233), (213, 94, 0),
           (240, 228, 66)]


def draw_overlay(photo: Image.Image, masks: Sequence[np.ndarray], points: Sequence[tuple[float, float, int]] = (),
                 boxes: Sequence[tuple[float, float, float, float]] = (), alpha: float = 0.5) -> Image.Image:
    """The photo with each mask tinted (its own colour, outlined), points (green +, red x) and boxes."""
    base = np.asarray(photo.convert("RGB"), dtype=np.float32).copy()
    for i, mask in enumerate(masks):
        m = np.asarray(mask, dtype=bool)
        if m.shape != base.shape[:2]:
            raise ValueError(f"mask {i} is {m.shape[0]} x {m.shape[1]}, the photo {base.shape[0]} x {base.shape[1]}")
        colour = np.array(PALETTE[i % len(PALETTE)], dtype=np.float32)
        base[m] = base[m] * (1 - alpha) + colour * alpha
        edge = m & ~(_shift(m, 1, 0) & _shift(m, -1, 0) & _shift(m, 0, 1) & _shift(m, 0, -1))
        base[edge] = colour
    image = Image.fromarray(base.clip(0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(image)
    r = max(4, round(max(image.size) / 150))
    width = max(2, r // 2)
    for x0, y0, x1, y1 in boxes:
        draw.rectangle([x0, y0, x1, y1], outline=(0, 255, 0), width=width)
    for x, y, label in points:
        if label == 1:
            draw.ellipse([x - r, y - r, x + r, y + r], fill=(0, 200, 0), outline=(255, 255, 255), width=1)
        elif label == 0:
            draw.line([x - r, y - r, x + r, y + r], fill=(230, 0, 0), width=width)
            draw.line([x - r, y + r, x + r, y - r], fill=(230, 0, 0), width=width)
    return image


def _shift(m: np.ndarray, dy: int, dx: int) -> np.ndarray:
    """``m`` moved by (dy, dx), edges filled with True (so the photo's border is not an outline)."""
    out = np.ones_like(m)
    h, w = m.shape
    out[max(dy, 0): h + min(dy, 0), max(dx, 0): w + min(dx, 0)] = m[max(-dy, 0): h + min(-dy, 0),
                                                                     max(-dx, 0): w + min(-dx, 0)]
    return out
