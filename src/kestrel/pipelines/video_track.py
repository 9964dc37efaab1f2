"""``kestrel.track``: objects followed through a clip, one frame at a time (SAM 2.1's video model).

>>> import kestrel
>>> from kestrel.pipelines.video_track import TrackPrompt
>>> prompts = [TrackPrompt(frame=0, object_id=1, points=((210.0, 350.0),), labels=(1,))]
>>> for frame, masks in kestrel.track("clip.mp4", "sam2.1-hiera-tiny", prompts):
...     print(frame, {obj: int(m.sum()) for obj, m in masks.items()})

This module is the user-facing half: it opens the video (a path, or any random-access sequence of PIL
images), loads and vets the model, checks the prompts against the clip, and thresholds the engine's logits.
The engine (:mod:`kestrel.pipelines.video_tracker`) does the tracking.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from ..errors import KestrelError
from .video_io import open_video

TRACKING_FAMILIES = ("sam2",)  # card families with a video model (memory encoder, memory attention)
VIDEO_MODEL_TYPES = ("sam2_video",)  # the config model_type of a save_pretrained directory that tracks


class TrackError(KestrelError, ValueError):
    """A prompt, frame range or model that tracking cannot take."""


def _engine() -> ModuleType:
    """The tracking engine module (kept behind a function so that tests may stand a double in for it)."""
    from . import video_tracker

    return video_tracker


def __getattr__(name: str) -> Any:  # TrackPrompt is the engine's; re-exported here for users
    if name == "TrackPrompt":
        return _engine().TrackPrompt
    raise AttributeError(name)


def load_video_model(name_or_dir: str | os.PathLike[str], *, weights: str | os.PathLike[str] | None = None,
                     device: str = "cpu", dtype: str = "f32") -> Any:
    """Load a model that can track: a SAM 2.1 card, or a ``Sam2VideoModel`` save (model_type ``sam2_video``).

    Anything else (another family, SAM 2's image-only save) is refused before its weights are read.
    """
    from ..runtime.load import load, peek

    seen = peek(name_or_dir, weights)
    if seen is not None:
        family, config = seen
        if family.name not in TRACKING_FAMILIES:
            raise TrackError(f"--model {name_or_dir}: a {family.name} model; tracking needs SAM 2 (a SAM 2.1 card "
                             "such as sam2.1-hiera-tiny, or a transformers Sam2VideoModel save)")
        directory = Path(weights) if weights is not None else Path(name_or_dir)
        model_type = config.get("model_type")
        if directory.is_dir() and model_type not in VIDEO_MODEL_TYPES:
            raise TrackError(f"--model {name_or_dir}: model_type {model_type!r} is SAM 2's image model; tracking "
                             "needs the video model's save (transformers Sam2VideoModel, model_type 'sam2_video'), "
                             "which carries the memory encoder and memory attention")
    model = load(name_or_dir, weights=weights, device=device, dtype=dtype)
    family = model.loaded.family.name  # type: ignore[attr-defined]
    if family not in TRACKING_FAMILIES:
        raise TrackError(f"--model {name_or_dir}: a {family} model; tracking needs SAM 2")
    return model


def frame_range(n: int, start: int = 0, end: int | None = None) -> range:
    """The frames ``start <= i < end`` of an ``n``-frame clip (``end`` None: to the last), checked."""
    if n <= 0:
        raise TrackError("an empty video: no frame to track")
    stop = n if end is None else end
    if not 0 <= start < n:
        raise TrackError(f"--start {start} is out of range: the clip has {n} frames (0 to {n - 1})")
    if not start < stop <= n:
        raise TrackError(f"--end {end} is out of range: it must be after --start {start} and at most {n} "
                         f"(the clip has {n} frames; --end is exclusive)")
    return range(start, stop)


def check_prompts(prompts: Sequence[Any], frames: Sequence[Any], start: int = 0, end: int | None = None) -> range:
    """Refuse prompts tracking cannot take; return the frame range. Reads each prompted frame (for its size)."""
    span = frame_range(len(frames), start, end)
    if not prompts:
        raise TrackError("no prompt: give at least one --point FRAME:X,Y or --box FRAME:X0,Y0,X1,Y1")
    seen: set[tuple[int, int]] = set()
    for p in prompts:
        what = f"object {p.object_id} on frame {p.frame}"
        if not isinstance(p.object_id, int) or not 1 <= p.object_id <= 255:
            raise TrackError(f"object id {p.object_id!r}: object ids are integers 1 to 255 (0 is background)")
        if not isinstance(p.frame, int) or p.frame not in span:
            raise TrackError(f"a prompt for object {p.object_id} is on frame {p.frame}, outside the tracked frames "
                             f"{span.start} to {span.stop - 1}")
        if (p.frame, p.object_id) in seen:
            raise TrackError(f"{what}: two prompts; give all of an object's points and its box on a frame as one")
        seen.add((p.frame, p.object_id))
        if not p.points and p.box is None:
            raise TrackError(f"{what}: no point and no box")
        if len(p.points) != len(p.labels):
            raise TrackError(f"{what}: {len(p.points)} points but {len(p.labels)} labels")
        width, height = frames[p.frame].size
        for (x, y), label in zip(p.points, p.labels):
            if label not in (0, 1):
                raise TrackError(f"{what}: point {x:g},{y:g} has label {label}; labels are 1 (foreground) or "
                                 "0 (background)")
            if not (math.isfinite(x) and math.isfinite(y) and 0 <= x <= width and 0 <= y <= height):
                raise TrackError(f"{what}: point {x:g},{y:g} lies outside the {width} x {height} frame")
        if p.box is not None:
            x0, y0, x1, y1 = p.box
            if not all(math.isfinite(v) for v in p.box) or not (x0 < x1 and y0 < y1):
                raise TrackError(f"{what}: box {x0:g},{y0:g},{x1:g},{y1:g} needs x0 < x1 and y0 < y1")
            if not (0 <= x0 and 0 <= y0 and x1 <= width and y1 <= height):
                raise TrackError(f"{what}: box {x0:g},{y0:g},{x1:g},{y1:g} lies outside the {width} x {height} "
                                 "frame")
    return span


def track(video: str | os.PathLike[str] | Sequence[Any], model: Any, prompts: Sequence[Any], *,
          reverse: bool = False, start: int = 0, end: int | None = None,
          weights: str | os.PathLike[str] | None = None, device: str = "cpu", dtype: str = "f32"
          ) -> Iterator[tuple[int, dict[int, torch.Tensor]]]:
    """Track the prompted objects through a clip: yields ``(frame index, {object id: bool mask [H, W]})``.

    ``video`` is a path (an ``.mp4`` or anything PyAV decodes, or a folder of JPEG/PNG frames sorted by name)
    or a random-access sequence of RGB PIL images. ``model`` is a loaded SAM 2 model, a SAM 2.1 card name or
    a ``Sam2VideoModel`` save directory. ``prompts`` are :class:`TrackPrompt` (frame, object id, points in
    pixels with labels 1/0, and/or a box); a prompt on a later frame corrects that object's track from there.
    Frames ``start <= i < end`` are tracked, backwards with ``reverse``; frames come in processing order, each
    decoded and encoded when its turn comes (memory does not grow with the clip). Masks are each object's
    logits at the frame's size thresholded at > 0 (objects may overlap).
    """
    frames = open_video(video) if isinstance(video, str | os.PathLike) else video
    check_prompts(prompts, frames, start, end)
    if isinstance(model, str | os.PathLike):
        model = load_video_model(model, weights=weights, device=device, dtype=dtype)
    loaded = getattr(model, "loaded", None)
    if loaded is not None and loaded.family.name not in TRACKING_FAMILIES:
        raise TrackError(f"{loaded.name}: a {loaded.family.name} model; tracking needs SAM 2")
    engine = _engine()
    for index, logits in engine.track_frames(frames, model, prompts, reverse=reverse, start=start, end=end):
        yield index, {obj: value > 0 for obj, value in logits.items()}
