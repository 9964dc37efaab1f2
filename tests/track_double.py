"""A TEST DOUBLE of the tracking engine (``kestrel.pipelines.video_tracker``), for the CLI's plumbing tests.

It follows the engine's interface (``TrackPrompt``, ``track_frames``) but tracks nothing: each object's
logits are +1 inside its latest prompt's box (or a square of side ``2 * HALF`` around its first point) and
-1 elsewhere, carried along in processing order from the first prompted frame. The end-to-end tests run
the real engine.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

HALF = 6


@dataclass(frozen=True)
class TrackPrompt:
    frame: int
    object_id: int
    points: tuple[tuple[float, float], ...] = ()
    labels: tuple[int, ...] = ()
    box: tuple[float, float, float, float] | None = None


def region(p: TrackPrompt) -> tuple[int, int, int, int]:
    if p.box is not None:
        return tuple(round(v) for v in p.box)  # type: ignore[return-value]
    x, y = p.points[0]
    return int(x) - HALF, int(y) - HALF, int(x) + HALF, int(y) + HALF


def track_frames(frames: Sequence, model, prompts: Sequence[TrackPrompt], *, reverse: bool = False, start: int = 0,
                 end: int | None = None) -> Iterator[tuple[int, dict[int, torch.Tensor]]]:
    stop = len(frames) if end is None else end
    order = range(stop - 1, start - 1, -1) if reverse else range(start, stop)
    by_frame: dict[int, list[TrackPrompt]] = {}
    for p in prompts:
        by_frame.setdefault(p.frame, []).append(p)
    current: dict[int, tuple[int, int, int, int]] = {}
    for i in order:
        for p in by_frame.get(i, []):
            current[p.object_id] = region(p)
        if not current:
            continue
        w, h = frames[i].size
        out = {}
        for obj, (x0, y0, x1, y1) in current.items():
            logits = torch.full((h, w), -1.0)
            logits[max(y0, 0): y1, max(x0, 0): x1] = 1.0
            out[obj] = logits
        yield i, out
