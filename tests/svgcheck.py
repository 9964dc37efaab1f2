"""Reading a Graphviz SVG back: its text boxes (for overlap checks) and its edges with their labels."""

from __future__ import annotations

import re
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


def text_boxes(svg: str | ET.Element) -> list[Box]:
    """Every text element's box from its anchor, font size and (monospace) length."""
    boxes = []
    for t in (ET.fromstring(svg) if isinstance(svg, str) else svg).iter("{http://www.w3.org/2000/svg}text"):
        text = "".join(t.itertext())
        size = float(t.get("font-size", "14"))
        x, y = float(t.get("x", "0")), float(t.get("y", "0"))
        w = len(text) * size * ADVANCE
        anchor = t.get("text-anchor", "start")
        x0 = x - w / 2 if anchor == "middle" else x - w if anchor == "end" else x
        boxes.append(Box(text, x0, y - 0.78 * size, x0 + w, y + 0.22 * size))
    return boxes


def overlapping(boxes: list[Box]) -> list[tuple[Box, Box]]:
    """Every overlapping pair (a sweep along x: only boxes that start before one ends can meet it)."""
    ordered = sorted(boxes, key=lambda b: b.x0)
    out = []
    for i, a in enumerate(ordered):
        for b in ordered[i + 1:]:
            if b.x0 >= a.x1:
                break
            if a.overlaps(b):
                out.append((a, b))
    return out


def edges(svg: str) -> list[tuple[str, list[str]]]:
    """(title ``a->b``, the texts drawn with it) for every edge group."""
    out = []
    for g in ET.fromstring(svg).iter("{http://www.w3.org/2000/svg}g"):
        if "edge" in (g.get("class") or "").split():
            title = g.find("svg:title", NS)
            texts = ["".join(t.itertext()) for t in g.iter("{http://www.w3.org/2000/svg}text")]
            out.append((title.text if title is not None else "", texts))
    return out


def _groups(svg: str | ET.Element, kind: str) -> list[ET.Element]:
    root = ET.fromstring(svg) if isinstance(svg, str) else svg
    return [g for g in root.iter("{http://www.w3.org/2000/svg}g") if kind in (g.get("class") or "").split()]


def edge_label_boxes(svg: str | ET.Element) -> list[Box]:
    """The boxes of the type labels Graphviz set on edges."""
    return [b for g in _groups(svg, "edge") for b in text_boxes(g)]


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def node_boxes(svg: str | ET.Element) -> list[Box]:
    """Each node's outline (its path, polygon or polyline points), named by the node's first text."""
    out = []
    for g in _groups(svg, "node"):
        xs: list[float] = []
        ys: list[float] = []
        for shape in g.iter():  # the outline's points (a path's curve control points stay within a box)
            tag = shape.tag.rsplit("}", 1)[-1]
            coords = shape.get("d") if tag == "path" else shape.get("points") if tag in ("polygon", "polyline") else ""
            if coords:
                values = [float(v) for v in _NUMBER.findall(coords)]
                xs += values[0::2]
                ys += values[1::2]
        if xs:
            texts = ["".join(t.itertext()) for t in g.iter("{http://www.w3.org/2000/svg}text")]
            out.append(Box(" ".join(texts), min(xs), min(ys), max(xs), max(ys)))
    return out


def label_clashes(svg: str) -> list[str]:
    """Edge labels that run into each other or into a node's outline (a point of slack each way)."""
    root = ET.fromstring(svg)
    labels, nodes = edge_label_boxes(root), node_boxes(root)
    bad = [f"{a.text!r} / {b.text!r}" for a, b in overlapping(labels)]
    bad += [f"{a.text!r} on node {n.text!r}" for a in labels for n in nodes if a.overlaps(n, slack=1.0)]
    return bad
