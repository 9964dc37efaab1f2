"""Reading a Graphviz SVG back: its text boxes (for overlap checks) and its edges with their labels."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from dataclasses import dataclass

NS = {"svg": "http://www.w3.org/2000/svg"}
ADVANCE = 0.602  # DejaVu Sans Mono: every glyph advances 1233/2048 em


@dataclass
class Box:
    text: str
    x0: float
    y0: float
    x1: float
    y1: float

    def overlaps(self, o: Box, slack: float = 0.5) -> bool:
        return (self.x0 + slack < o.x1 and o.x0 + slack < self.x1 and
                self.y0 + slack < o.y1 and o.y0 + slack < self.y1)


def text_boxes(svg: str) -> list[Box]:
    """Every text element's box from its anchor, font size and (monospace) length."""
    boxes = []
    for t in ET.fromstring(svg).iter("{http://www.w3.org/2000/svg}text"):
        text = "".join(t.itertext())
        size = float(t.get("font-size", "14"))
        x, y = float(t.get("x", "0")), float(t.get("y", "0"))
        w = len(text) * size * ADVANCE
        anchor = t.get("text-anchor", "start")
        x0 = x - w / 2 if anchor == "middle" else x - w if anchor == "end" else x
        boxes.append(Box(text, x0, y - 0.78 * size, x0 + w, y + 0.22 * size))
    return boxes


def overlapping(boxes: list[Box]) -> list[tuple[Box, Box]]:
    return [(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:] if a.overlaps(b)]


def edges(svg: str) -> list[tuple[str, list[str]]]:
    """(title ``a->b``, the texts drawn with it) for every edge group."""
    out = []
    for g in ET.fromstring(svg).iter("{http://www.w3.org/2000/svg}g"):
        if "edge" in (g.get("class") or "").split():
            title = g.find("svg:title", NS)
            texts = ["".join(t.itertext()) for t in g.iter("{http://www.w3.org/2000/svg}text")]
            out.append((title.text if title is not None else "", texts))
    return out
