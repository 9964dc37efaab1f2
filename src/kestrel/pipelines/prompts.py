"""One prompt and one prompt error for every segmenter: labelled points and at most one box, in photo pixels."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..errors import KestrelError

LABELS = {1: "foreground", 0: "background", -1: "not a point", -10: "padding (ignored)"}
PAD = -10  # the processor's point_pad_value


class PromptError(KestrelError, ValueError):
    """A prompt that a segmenter cannot take: names the prompt, what was expected and what was given."""


@dataclass
class Prompt:
    """One object to segment: labelled points, at most one box, in pixels of the original image.

    Labels: 1 foreground, 0 background, -1 not a point, -10 ignored (padding).
    """

    points: list[tuple[float, float]] = field(default_factory=list)
    labels: list[int] = field(default_factory=list)
    box: tuple[float, float, float, float] | None = None

    def check(self, name: str = "prompt") -> None:
        if len(self.points) != len(self.labels):
            raise PromptError(f"{name}: {len(self.points)} points but {len(self.labels)} labels; give one label "
                              "per point")
        if not self.points and self.box is None:
            raise PromptError(f"{name}: no point and no box")
        for i, (p, label) in enumerate(zip(self.points, self.labels)):
            if len(p) != 2 or not all(isinstance(v, int | float) and math.isfinite(v) for v in p):
                raise PromptError(f"{name}: point {i} must be two finite numbers (x, y), got {tuple(p)}")
            if label not in LABELS:
                raise PromptError(f"{name}: point {i} has label {label!r}; labels are "
                                  + ", ".join(f"{k} ({v})" for k, v in LABELS.items()))
        if self.box is not None:
            b = self.box
            if len(b) != 4 or not all(isinstance(v, int | float) and math.isfinite(v) for v in b):
                raise PromptError(f"{name}: the box must be four finite numbers (x0, y0, x1, y1), got {tuple(b)}")
            if b[2] < b[0] or b[3] < b[1]:
                raise PromptError(f"{name}: box {tuple(b)} has x1 < x0 or y1 < y0; give (x0, y0, x1, y1) with "
                                  "x0 <= x1 and y0 <= y1")
