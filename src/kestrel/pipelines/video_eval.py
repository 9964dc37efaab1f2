"""DAVIS-style scores of a tracked clip: J (region similarity), F (boundary accuracy) and J&F.

The measures are the DAVIS benchmark's (Perazzi et al. 2016, Pont-Tuset et al. 2017):

- **J** of one object on one frame is the IoU of the predicted and true masks, 1 when both are empty.
- **F** is the F-measure of the two masks' boundaries. A mask's boundary is the set of its pixels whose right,
  lower or lower-right neighbour differs (the benchmark's ``seg2bmap``, last row and column compared along
  the edge). A boundary pixel counts as matched when the other boundary lies within a disk of radius
  ``ceil(0.008 * diagonal)`` pixels (``diagonal`` = the frame's diagonal). Precision = matched predicted
  boundary pixels / predicted boundary pixels, recall = matched true / true; both boundaries empty is
  precision = recall = 1, one of them empty gives 0 to the other side's measure, and F = 2PR / (P + R)
  (0 when P + R = 0).
- Per object, J and F are means over the scored frames; the clip's J and F are means over objects, and J&F
  is (J + F) / 2. An object of the ground truth that was never tracked scores 0 where it is present.

Ground truth is a folder of DAVIS PNGs (palette or grey, pixel = object id, 0 background, 255 void: left
out of J and of both boundaries), one per frame, named by frame index (``00000.png``) or, failing that, in
order of name.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from .video_io import VideoError

BOUNDARY_TOLERANCE = 0.008  # of the image diagonal, as in the DAVIS benchmark
VOID = 255


def region_similarity(pred: np.ndarray, true: np.ndarray, void: np.ndarray | None = None) -> float:
    """J: IoU of two boolean masks (pixels in ``void`` ignored); 1 when both are empty."""
    pred, true = np.asarray(pred, dtype=bool), np.asarray(true, dtype=bool)
    keep = ~np.asarray(void, dtype=bool) if void is not None else np.ones_like(pred)
    union = np.count_nonzero((pred | true) & keep)
    if union == 0:
        return 1.0
    return np.count_nonzero(pred & true & keep) / union


def boundary(mask: np.ndarray) -> np.ndarray:
    """The DAVIS boundary map of a boolean mask: pixels whose right, lower or lower-right neighbour differs."""
    m = np.asarray(mask, dtype=bool)
    right = np.zeros_like(m)
    below = np.zeros_like(m)
    diag = np.zeros_like(m)
    right[:, :-1] = m[:, 1:]
    below[:-1, :] = m[1:, :]
    diag[:-1, :-1] = m[1:, 1:]
    b = (m ^ right) | (m ^ below) | (m ^ diag)
    b[-1, :] = m[-1, :] ^ right[-1, :]
    b[:, -1] = m[:, -1] ^ below[:, -1]
    b[-1, -1] = False
    return b


def disk_offsets(radius: int) -> list[tuple[int, int]]:
    """Integer offsets (dy, dx) with dy^2 + dx^2 <= radius^2: the benchmark's disk structuring element."""
    return [(dy, dx) for dy in range(-radius, radius + 1) for dx in range(-radius, radius + 1)
            if dy * dy + dx * dx <= radius * radius]


def dilate(mask: np.ndarray, radius: int) -> np.ndarray:
    """Binary dilation of ``mask`` by a disk of ``radius`` pixels (outside the image counts as empty)."""
    m = np.asarray(mask, dtype=bool)
    h, w = m.shape
    out = np.zeros_like(m)
    for dy, dx in disk_offsets(radius):
        out[max(dy, 0): h + min(dy, 0), max(dx, 0): w + min(dx, 0)] |= m[max(-dy, 0): h + min(-dy, 0),
                                                                         max(-dx, 0): w + min(-dx, 0)]
    return out


def tolerance_pixels(shape: tuple[int, int], tolerance: float = BOUNDARY_TOLERANCE) -> int:
    """The match radius: ``ceil(tolerance * diagonal)`` pixels (a tolerance >= 1 is taken as pixels)."""
    return int(tolerance) if tolerance >= 1 else math.ceil(tolerance * math.hypot(*shape))


def boundary_f(pred: np.ndarray, true: np.ndarray, void: np.ndarray | None = None,
               tolerance: float = BOUNDARY_TOLERANCE) -> float:
    """F: the boundary F-measure of two boolean masks, DAVIS's definition (module docstring)."""
    pred, true = np.asarray(pred, dtype=bool), np.asarray(true, dtype=bool)
    if void is not None:
        v = np.asarray(void, dtype=bool)
        pred, true = pred & ~v, true & ~v
    radius = tolerance_pixels(pred.shape, tolerance)
    bp, bt = boundary(pred), boundary(true)
    n_pred, n_true = np.count_nonzero(bp), np.count_nonzero(bt)
    if n_pred == 0 and n_true == 0:
        precision = recall = 1.0
    elif n_pred == 0:
        precision, recall = 1.0, 0.0
    elif n_true == 0:
        precision, recall = 0.0, 1.0
    else:
        precision = np.count_nonzero(bp & dilate(bt, radius)) / n_pred
        recall = np.count_nonzero(bt & dilate(bp, radius)) / n_true
    if precision + recall == 0:
        return 0.0
    return 2 * precision * recall / (precision + recall)


@dataclass(frozen=True)
class ObjectScore:
    """One object's mean J and F over the scored frames."""

    object_id: int
    j: float
    f: float
    frames: int

    @property
    def jf(self) -> float:
        return (self.j + self.f) / 2


@dataclass(frozen=True)
class ClipScore:
    """Per-object scores and the clip's J, F and J&F (means over objects)."""

    objects: tuple[ObjectScore, ...]
    frames: tuple[int, ...]
    untracked: tuple[int, ...] = ()  # object ids in the ground truth with no predicted mask on any frame
    extra: tuple[int, ...] = ()  # predicted object ids absent from the ground truth (not scored)

    @property
    def j(self) -> float:
        return float(np.mean([o.j for o in self.objects])) if self.objects else float("nan")

    @property
    def f(self) -> float:
        return float(np.mean([o.f for o in self.objects])) if self.objects else float("nan")

    @property
    def jf(self) -> float:
        return (self.j + self.f) / 2

    def as_dict(self) -> dict:
        return {"J&F": self.jf, "J": self.j, "F": self.f, "frames": list(self.frames),
                "objects": {str(o.object_id): {"J&F": o.jf, "J": o.j, "F": o.f, "frames": o.frames}
                            for o in self.objects},
                "untracked": list(self.untracked), "not_in_ground_truth": list(self.extra)}

    def table(self) -> str:
        rows = [f"{'object':>8}  {'J&F':>6}  {'J':>6}  {'F':>6}  frames"]
        rows += [f"{o.object_id:>8}  {o.jf:6.3f}  {o.j:6.3f}  {o.f:6.3f}  {o.frames}" for o in self.objects]
        rows.append(f"{'mean':>8}  {self.jf:6.3f}  {self.j:6.3f}  {self.f:6.3f}  {len(self.frames)}")
        return "\n".join(rows)


def score_label_maps(pred: Mapping[int, np.ndarray], true: Mapping[int, np.ndarray],
                     tolerance: float = BOUNDARY_TOLERANCE) -> ClipScore:
    """Scores of predicted label maps against true ones, both ``{frame: uint8 [H, W]}`` (id per pixel).

    The frames scored are those of ``true`` (each must be in ``pred``); the objects are the ids present in
    ``true`` (255 is void). An object is scored on every scored frame, present or not (J = F = 1 where both
    masks are empty).
    """
    frames = sorted(true)
    gt_ids = {int(v) for f in frames for v in np.unique(true[f]) if v not in (0, VOID)}
    return score_frames(((f, pred.get(f), true[f]) for f in frames), gt_ids, tolerance)


def score_frames(items: Iterable[tuple[int, np.ndarray | None, np.ndarray]], gt_ids: set[int],
                 tolerance: float = BOUNDARY_TOLERANCE) -> ClipScore:
    """Scores from ``(frame, predicted label map, true label map)`` triples, one frame in memory at a time.

    ``gt_ids`` are the objects to score (every id of the ground truth); a missing prediction is an error.
    """
    if not gt_ids:
        raise VideoError("the ground truth marks no object (every pixel is 0 or 255)")
    j_sum = dict.fromkeys(gt_ids, 0.0)
    f_sum = dict.fromkeys(gt_ids, 0.0)
    frames: list[int] = []
    pred_ids: set[int] = set()
    for f, p, t in items:
        if p is None:
            raise VideoError(f"no predicted mask for ground-truth frame {f}")
        if p.shape != t.shape:
            raise VideoError(f"frame {f}: the ground truth is {t.shape[1]} x {t.shape[0]} px, the "
                             f"prediction {p.shape[1]} x {p.shape[0]}")
        pred_ids.update(int(v) for v in np.unique(p) if v)
        void = t == VOID
        for obj in gt_ids:
            j_sum[obj] += region_similarity(p == obj, t == obj, void)
            f_sum[obj] += boundary_f(p == obj, t == obj, void, tolerance)
        frames.append(f)
    if not frames:
        raise VideoError("no frame to score")
    n = len(frames)
    scores = tuple(ObjectScore(obj, j_sum[obj] / n, f_sum[obj] / n, n) for obj in sorted(gt_ids))
    return ClipScore(scores, tuple(frames), tuple(sorted(gt_ids - pred_ids)), tuple(sorted(pred_ids - gt_ids)))


def read_label_png(path: str | os.PathLike[str]) -> np.ndarray:
    """A DAVIS mask PNG as ``uint8 [H, W]`` object ids (palette indices, or grey values)."""
    try:
        with Image.open(path) as im:
            if im.mode not in ("P", "L", "1", "I", "I;16"):
                raise VideoError(f"{path}: a {im.mode} image; a DAVIS mask is a palette or grey PNG whose pixel is "
                                 "the object id")
            array = np.array(im)
    except (OSError, ValueError) as e:
        if isinstance(e, VideoError):
            raise
        raise VideoError(f"{path}: cannot read the mask: {e}") from None
    if array.max(initial=0) > 255:
        raise VideoError(f"{path}: object id {int(array.max())} does not fit a DAVIS mask (0 to 255)")
    return array.astype(np.uint8)


def ground_truth_files(folder: str | os.PathLike[str]) -> dict[int, Path]:
    """``{frame index: PNG}`` of a DAVIS annotation folder: by number when every name is one, else by order."""
    root = Path(folder)
    if not root.is_dir():
        raise VideoError(f"--eval {root}: no such folder (expected DAVIS-style ground-truth PNGs)")
    files = sorted(p for p in root.iterdir() if p.suffix.lower() == ".png" and p.is_file())
    if not files:
        raise VideoError(f"--eval {root}: the folder holds no .png mask")
    if all(p.stem.isdigit() for p in files):
        return {int(p.stem): p for p in files}
    return dict(enumerate(files))


def evaluate_folder(pred_dir: str | os.PathLike[str], gt_dir: str | os.PathLike[str],
                    frames: Sequence[int] | None = None) -> ClipScore:
    """Scores of the ``NNNNN.png`` label maps in ``pred_dir`` against the ground truth in ``gt_dir``.

    ``frames`` limits the scored frames (those tracked); ground truth outside it is ignored, and frames of
    ``frames`` without ground truth are not scored.
    """
    from .video_io import frame_name

    gt = ground_truth_files(gt_dir)
    wanted = sorted(gt) if frames is None else sorted(set(frames) & set(gt))
    if not wanted:
        raise VideoError(f"--eval {gt_dir}: no ground-truth frame among the tracked frames "
                         f"(ground truth for frames {min(gt)} to {max(gt)})")
    gt_ids = {int(v) for f in wanted for v in np.unique(read_label_png(gt[f])) if v not in (0, VOID)}

    def triples() -> Iterator[tuple[int, np.ndarray | None, np.ndarray]]:
        for f in wanted:
            path = Path(pred_dir) / frame_name(f)
            yield f, (read_label_png(path) if path.is_file() else None), read_label_png(gt[f])

    return score_frames(triples(), gt_ids)
