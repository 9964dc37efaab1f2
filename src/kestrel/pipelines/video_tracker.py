"""Track objects through a video with SAM 2.1's memory, one frame at a time.

``track_frames`` is a generator: each frame is fetched, pre-processed exactly as ``segment`` does for
SAM 2.1 (PIL bilinear to the model's size, aspect not kept, ``/ 255``, ImageNet mean and std),
encoded, conditioned on each object's memory bank, decoded, and its memory encoded; then the frame is
dropped. What stays is bounded by the prompts, never by the clip's length: per object its
conditioning frames (the frames it was prompted on), the memories of the last ``num_maskmem - 1``
tracked frames and the object pointers of the last ``max_object_pointers_in_encoder - 1``.

The semantics are transformers' ``Sam2VideoModel`` driven through its inference session, frame by
frame in processing order, with each frame's prompts added just before the frame is run:

- An object starts on the first frame that has a prompt for it; frames before that do not list it.
- A frame with prompts for an object is a *conditioning frame* for it (the object has not been
  tracked on that frame yet): its mask comes from the prompts and the frame's features with the
  no-memory embedding, no memory attention; it enters the object's bank as a conditioning frame,
  kept for the rest of the clip (temporal encoding ``num_maskmem - 1``, pointer offset from it).
  So a prompt on a later frame corrects the track from there: later frames attend to both
  conditioning frames and to the corrected recent memories.
- Other frames are tracked: memory attention over the selected conditioning frames (all of them
  unless ``max_cond_frame_num`` limits it to the nearest), the last ``num_maskmem - 1`` frames and
  the object pointers; then the decoder without prompts, multimask, the output of best predicted IoU.
- A prompted frame uses multimask when it has at most ``multimask_max_pt_num`` points (a box counts
  as two), else upstream's single-mask choice by stability.
- Memories are encoded for all objects of a frame together; as upstream, when any of them had
  prompts on that frame, every one of them is encoded from its thresholded mask (else from sigmoid
  probabilities).
- A frame where the object score is not positive gives logits of -1024 everywhere and the
  no-object pointer (occlusion).

Several prompts for one object on one frame are merged: the box (at most one) first, then the
points in order. With ``reverse`` the frames run from ``end - 1`` down to ``start`` and memories
are looked up ahead instead of behind.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import PIL.Image
import torch
import torch.nn.functional as F

from ..errors import KestrelError
from ..models.sam2 import Model as Sam2ImageModel
from ..models.sam2_video import VideoModel
from .images import to_rgb
from .sam2_segment import preprocess_for

# the dtype a frame's memory is kept in: bfloat16, as upstream keeps it (half the bank's memory)
MEMORY_DTYPE = torch.bfloat16


class TrackError(KestrelError, ValueError):
    """A tracking request that cannot run: a bad prompt, frame range or model."""


@dataclass(frozen=True)
class TrackPrompt:
    """A prompt for one object on one frame, in pixels of the frame's original size."""

    frame: int  # index in the video
    object_id: int  # >= 1
    points: tuple[tuple[float, float], ...] = ()  # pixel (x, y) in the frame's original size
    labels: tuple[int, ...] = ()  # 1 foreground, 0 background, one per point
    box: tuple[float, float, float, float] | None = None  # x0, y0, x1, y1 pixels


@dataclass(frozen=True)
class TrackSettings:
    """Upstream's tracking settings (``Sam2VideoConfig``), read from the checkpoint's config."""

    num_maskmem: int = 7
    max_object_pointers: int = 16
    max_cond_frame_num: int = -1
    multimask_in_sam: bool = True
    multimask_min_points: int = 0
    multimask_max_points: int = 1
    multimask_for_tracking: bool = True

    @classmethod
    def from_config(cls, cfg: dict) -> TrackSettings:
        return cls(num_maskmem=int(cfg.get("num_maskmem", 7)),
                   max_object_pointers=int(cfg.get("max_object_pointers_in_encoder", 16)),
                   max_cond_frame_num=int(cfg.get("max_cond_frame_num", -1)),
                   multimask_in_sam=bool(cfg.get("multimask_output_in_sam", True)),
                   multimask_min_points=int(cfg.get("multimask_min_pt_num", 0)),
                   multimask_max_points=int(cfg.get("multimask_max_pt_num", 1)),
                   multimask_for_tracking=bool(cfg.get("multimask_output_for_tracking", True)))

    def multimask(self, points: int, conditioning: bool) -> bool:
        return (self.multimask_in_sam and (conditioning or self.multimask_for_tracking)
                and self.multimask_min_points <= points <= self.multimask_max_points)


@dataclass
class FrameMemory:
    """What one frame leaves in an object's bank: its memory (bfloat16, as upstream keeps it; None
    once it is too old to be attended) and its object pointer."""

    memory: torch.Tensor | None  # [Mem, E, E] bf16
    pointer: torch.Tensor  # [Hd]


@dataclass
class ObjectTrack:
    """One object's bank: its conditioning frames and its recent tracked frames."""

    conditioning: dict[int, FrameMemory] = field(default_factory=dict)  # in the order they were added
    recent: dict[int, FrameMemory] = field(default_factory=dict)

    def forget(self, frame: int, settings: TrackSettings) -> None:
        """Drop what frames after ``frame`` (in processing order) can no longer use."""
        keep_memory = max(settings.num_maskmem - 1, 0)
        keep_pointer = max(settings.max_object_pointers - 1, 0)
        for f in list(self.recent):
            age = abs(frame - f)
            if age >= keep_pointer and age >= keep_memory:
                del self.recent[f]
            elif age >= keep_memory:
                self.recent[f].memory = None

    def size(self) -> int:
        """How many frames the bank holds (conditioning and recent)."""
        return len(self.conditioning) + len(self.recent)


def check_prompts(prompts: Sequence[TrackPrompt], frames: int) -> None:
    """Refuse a prompt that cannot be run, with one line naming it."""
    boxes: set[tuple[int, int]] = set()
    for p in prompts:
        what = f"prompt for object {p.object_id} on frame {p.frame}"
        if isinstance(p.frame, bool) or not isinstance(p.frame, int) or not 0 <= p.frame < frames:
            raise TrackError(f"{what}: frame {p.frame} is out of range, the video has {frames} frames "
                             f"(0..{frames - 1})")
        if isinstance(p.object_id, bool) or not isinstance(p.object_id, int) or p.object_id < 1:
            raise TrackError(f"{what}: object ids are integers >= 1, got {p.object_id!r}")
        if len(p.points) != len(p.labels):
            raise TrackError(f"{what}: {len(p.points)} point(s) but {len(p.labels)} label(s); give one label per "
                             "point")
        for xy in p.points:
            if len(xy) != 2 or not all(_finite(v) for v in xy):
                raise TrackError(f"{what}: a point is (x, y) in pixels, got {xy!r}")
        for lab in p.labels:
            if isinstance(lab, bool) or lab not in (0, 1):
                raise TrackError(f"{what}: a point label is 1 (foreground) or 0 (background), got {lab!r}")
        if p.box is not None:
            b = p.box
            if len(b) != 4 or not all(_finite(v) for v in b) or not (b[0] < b[2] and b[1] < b[3]):
                raise TrackError(f"{what}: a box is x0,y0,x1,y1 in pixels with x0 < x1 and y0 < y1, got {b!r}")
            if (p.frame, p.object_id) in boxes:
                raise TrackError(f"{what}: one box per object and frame, got two")
            boxes.add((p.frame, p.object_id))
        if not p.points and p.box is None:
            raise TrackError(f"{what}: give at least one point or a box")


def _finite(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and v == v and abs(v) != float("inf")


def _video_model(model: torch.nn.Module) -> VideoModel:
    name = getattr(getattr(model, "loaded", None), "name", type(model).__name__)
    if isinstance(model, VideoModel):
        return model
    if isinstance(model, Sam2ImageModel):
        raise TrackError(f"model {name} is SAM 2's image model (config model_type sam2): tracking needs a "
                         "Sam2VideoModel checkpoint (model_type sam2_video), which holds the memory weights")
    raise TrackError(f"model {name} is not SAM 2: tracking needs a SAM 2.1 video checkpoint (a sam2.1-hiera-* "
                     "card or a save_pretrained directory with model_type sam2_video)")


class VideoTracker:
    """The streaming engine behind :func:`track_frames` (one clip, one pass)."""

    def __init__(self, model: torch.nn.Module, num_frames: int) -> None:
        self.model = _video_model(model)
        loaded = getattr(model, "loaded", None)
        self.settings = TrackSettings.from_config(getattr(loaded, "config", None) or {})
        self.num_frames = num_frames
        self.size = 16 * int(self.model.E)
        self.preprocess = preprocess_for(self.size)
        p = next(self.model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.objects: dict[int, ObjectTrack] = {}  # by object id, in the order they started

    def bank_size(self) -> int:
        """Frames held in every object's bank together (bounded by prompts, not by the clip)."""
        return sum(o.size() for o in self.objects.values())

    def step(self, frame: int, image: PIL.Image.Image, prompts: Sequence[TrackPrompt], reverse: bool,
             ) -> dict[int, torch.Tensor]:
        """Run one frame: its prompts (if any) first, then every started object; returns each
        object's logits at the frame's size."""
        img = to_rgb(image)
        pixels = self.preprocess(img).to(self.device, self.dtype)
        m, s = self.model, self.settings
        with torch.no_grad():
            raw, hr0, hr1 = m.encode_frame(pixels)
            prompted = _merge(prompts)
            for oid in prompted:
                self.objects.setdefault(oid, ObjectTrack())
            low: dict[int, torch.Tensor] = {}
            scores: dict[int, torch.Tensor] = {}
            pointers: dict[int, torch.Tensor] = {}
            for oid, track in self.objects.items():
                if oid in prompted:
                    points, labels = self._prompt_tensors(prompted[oid], img)
                    features = m.without_memory(raw)
                    multi = s.multimask(labels.shape[-1], conditioning=True)
                else:
                    points = torch.zeros(1, 1, 1, 2, dtype=self.dtype, device=self.device)
                    labels = torch.full((1, 1, 1), -1, dtype=torch.int32, device=self.device)
                    features = self._attend(raw, track, frame, reverse)
                    multi = s.multimask(0, conditioning=False)
                flag = torch.full((1, 1, 1), 1.0 if multi else 0.0, dtype=self.dtype, device=self.device)
                mask, score, pointer = m.track_step(features, hr0, hr1, points, labels, flag)
                low[oid], scores[oid], pointers[oid] = mask[0, 0], score[0, 0], pointer[0, 0]
            if low:
                ids = list(low)
                binarize = torch.full((len(ids), 1), 1.0 if prompted else 0.0, dtype=self.dtype, device=self.device)
                memories = m.encode_memory(raw.expand(len(ids), *raw.shape[1:]), torch.stack([low[i] for i in ids]),
                                           torch.stack([scores[i] for i in ids]), binarize)
                for k, oid in enumerate(ids):
                    entry = FrameMemory(memories[k].to(MEMORY_DTYPE), pointers[oid])
                    track = self.objects[oid]
                    if oid in prompted:
                        track.conditioning[frame] = entry
                    else:
                        track.recent[frame] = entry
            for track in self.objects.values():
                track.forget(frame, s)
            h, w = img.height, img.width
            return {oid: F.interpolate(low[oid][None].float(), size=(h, w), mode="bilinear",
                                       align_corners=False)[0, 0] for oid in low}

    def _prompt_tensors(self, prompt: TrackPrompt, img: PIL.Image.Image) -> tuple[torch.Tensor, torch.Tensor]:
        """Points in the model frame (each axis scaled on its own), the box first as corners 2 and 3."""
        sx, sy = self.size / img.width, self.size / img.height
        coords: list[tuple[float, float]] = []
        labels: list[int] = []
        if prompt.box is not None:
            x0, y0, x1, y1 = prompt.box
            coords += [(x0, y0), (x1, y1)]
            labels += [2, 3]
        coords += [tuple(p) for p in prompt.points]  # type: ignore[misc]
        labels += list(prompt.labels)
        xy = torch.tensor(coords, dtype=torch.float32) * torch.tensor([sx, sy], dtype=torch.float32)
        return (xy.reshape(1, 1, -1, 2).to(self.device, self.dtype),
                torch.tensor(labels, dtype=torch.int32, device=self.device).reshape(1, 1, -1))

    def _attend(self, raw: torch.Tensor, track: ObjectTrack, frame: int, reverse: bool) -> torch.Tensor:
        """The frame's features conditioned on the object's bank (upstream's memory selection)."""
        s, sign = self.settings, (-1 if reverse else 1)
        chosen = _closest_conditioning(frame, track.conditioning, s.max_cond_frame_num)
        memories, slots = [], []
        for entry in chosen.values():
            memories.append(entry.memory)
            slots.append(s.num_maskmem - 1)  # upstream's offset 0: the last temporal encoding
        for t in range(s.num_maskmem - 1, 0, -1):
            prev = frame - t * sign
            entry = track.recent.get(prev)
            if entry is None and prev in track.conditioning and prev not in chosen:
                entry = track.conditioning[prev]
            if entry is not None and entry.memory is not None:
                memories.append(entry.memory)
                slots.append(t - 1)
        offsets, pointers = [], []
        for f, entry in track.conditioning.items():
            if (f >= frame) if reverse else (f <= frame):
                offsets.append((frame - f) * sign)
                pointers.append(entry.pointer)
        window = min(self.num_frames, s.max_object_pointers)
        for t in range(1, window):
            ref = frame - t * sign
            if ref < 0 or ref >= self.num_frames:
                break
            entry = track.recent.get(ref)
            if entry is not None:
                offsets.append(t)
                pointers.append(entry.pointer)
        if not memories or not pointers:  # unreachable: a tracked object always has a conditioning frame
            raise RuntimeError(f"internal: frame {frame} has no memory to attend to")
        memory = torch.stack(memories).to(self.dtype)[None]
        slot = torch.tensor(slots, dtype=torch.int64, device=self.device)
        scale = float(max(window - 1, 1)) if window > 1 else 1.0
        off = torch.tensor(offsets, dtype=torch.float32, device=self.device) / scale
        return self.model.attend_memory(raw, memory, slot, torch.stack(pointers)[None], off.to(self.dtype))


def _closest_conditioning(frame: int, conditioning: dict[int, FrameMemory], limit: int) -> dict[int, FrameMemory]:
    """Upstream's choice of conditioning frames: all, or up to ``limit``: the nearest before, the
    nearest at or after, then the temporally closest."""
    if limit == -1 or len(conditioning) <= limit:
        return conditioning
    out: dict[int, FrameMemory] = {}
    before = max((t for t in conditioning if t < frame), default=None)
    if before is not None:
        out[before] = conditioning[before]
    after = min((t for t in conditioning if t >= frame), default=None)
    if after is not None:
        out[after] = conditioning[after]
    rest = sorted((t for t in conditioning if t not in out), key=lambda t: abs(t - frame))[:limit - len(out)]
    out.update((t, conditioning[t]) for t in rest)
    return out


def _merge(prompts: Sequence[TrackPrompt]) -> dict[int, TrackPrompt]:
    """One prompt per object: its box (at most one) and all its points, in order."""
    out: dict[int, TrackPrompt] = {}
    for p in prompts:
        q = out.get(p.object_id)
        if q is None:
            out[p.object_id] = p
        else:
            out[p.object_id] = TrackPrompt(p.frame, p.object_id, q.points + tuple(p.points), q.labels + tuple(p.labels),
                                           q.box if q.box is not None else p.box)
    return out


def track_frames(frames: Sequence[PIL.Image.Image], model: torch.nn.Module, prompts: Sequence[TrackPrompt], *,
                 reverse: bool = False, start: int = 0, end: int | None = None,
                 ) -> Iterator[tuple[int, dict[int, torch.Tensor]]]:
    """Yields (frame_index, {object_id: float32 logits [H, W] at that frame's original size}) in processing
    order (start..end-1, or backwards with reverse). `frames` is a lazy random-access sequence (len, getitem)
    of RGB images; frames are fetched, pre-processed and encoded one at a time; only the memory bank and
    per-object state are kept (memory must not grow with clip length). Raises kestrel errors (KestrelError
    subclasses with one clear message) for bad prompts (frame out of range, object id < 1, label not 0/1,
    point count/label count mismatch, box malformed) and for a model that is not SAM 2.

    An object appears in the dicts from the first processed frame that has a prompt for it; a frame
    before any prompt yields an empty dict. Logits > 0 are the object's mask.
    """
    n = len(frames)
    tracker = VideoTracker(model, n)
    check_prompts(prompts, n)
    stop = n if end is None else end
    if not (isinstance(start, int) and isinstance(stop, int)) or not 0 <= start < stop <= n:
        raise TrackError(f"frame range {start}..{stop}: the video has {n} frames, need 0 <= start < end <= {n}")
    outside = [p for p in prompts if not start <= p.frame < stop]
    if outside:
        p = outside[0]
        raise TrackError(f"prompt for object {p.object_id} on frame {p.frame} is outside the frames tracked "
                         f"({start}..{stop - 1})")
    by_frame: dict[int, list[TrackPrompt]] = {}
    for p in prompts:
        by_frame.setdefault(p.frame, []).append(p)
    return _run(tracker, frames, by_frame, range(stop - 1, start - 1, -1) if reverse else range(start, stop), reverse)


def _run(tracker: VideoTracker, frames: Sequence[PIL.Image.Image], by_frame: dict[int, list[TrackPrompt]],
         order: range, reverse: bool) -> Iterator[tuple[int, dict[int, torch.Tensor]]]:
    for f in order:
        yield f, tracker.step(f, frames[f], by_frame.get(f, ()), reverse)
