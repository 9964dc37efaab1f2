"""Video in and out for tracking: lazy frame sources, and the DAVIS-style masks, COCO RLE and overlay writers.

A source is a random-access sequence of RGB PIL images (``len(source)``, ``source[i]``) that decodes one frame
when asked and keeps no clip in memory:

- :class:`FolderFrames`: a folder of JPEG/PNG frames, in order of file name;
- :class:`AVFrames`: an ``.mp4`` or anything else PyAV decodes. Reading in order decodes each frame once; a jump
  (a prompted frame, ``--reverse``) seeks to the key frame before it and decodes forward, keeping the last few
  frames so that walking backwards decodes each group of pictures about once per :data:`AVFrames.CACHE` frames.

:func:`open_video` picks the source for a path. :class:`TrackWriter` writes ``masks/NNNNN.png`` (8-bit, the
frame's size, pixel = object id, 0 background, the lower id wins where objects overlap) and streams
``masks.json`` (COCO RLE of each object's whole mask, per frame) as frames arrive; :func:`write_overlay`
encodes ``overlay.mp4`` afterwards from the source and the written PNGs, in the clip's order.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from ..errors import KestrelError

FRAME_SUFFIXES = (".jpg", ".jpeg", ".png")


class VideoError(KestrelError, ValueError):
    """A video or frame folder that cannot be read: missing, unreadable, empty, or a frame out of range."""


def frame_name(index: int) -> str:
    """``00042.png``: the DAVIS name of frame ``index`` (5 digits, more when the clip needs them)."""
    return f"{index:05d}.png"


class FolderFrames(Sequence[Image.Image]):
    """The JPEG/PNG files of a folder, sorted by name, read one at a time as RGB images."""

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.path = Path(folder)
        if not self.path.is_dir():
            raise VideoError(f"{self.path}: no such folder")
        self.files = sorted(p for p in self.path.iterdir() if p.suffix.lower() in FRAME_SUFFIXES and p.is_file())
        if not self.files:
            raise VideoError(f"{self.path}: an empty video: the folder holds no .jpg, .jpeg or .png frame")
        self._size: tuple[int, int] | None = None
        self.fps = 24.0  # a folder has no rate; the overlay plays at this one

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> Image.Image:  # type: ignore[override]
        index = _index(index, len(self))
        path = self.files[index]
        try:
            with Image.open(path) as im:
                frame = im.convert("RGB")
        except (OSError, ValueError, Image.DecompressionBombError) as e:
            raise VideoError(f"{path}: cannot read frame {index}: {e}") from None
        if self._size is None:
            self._size = frame.size
        elif frame.size != self._size:
            raise VideoError(f"{path}: frame {index} is {frame.size[0]} x {frame.size[1]} px, the clip's first "
                             f"frame read was {self._size[0]} x {self._size[1]}: every frame must have one size")
        return frame

    def __repr__(self) -> str:
        return f"FolderFrames({str(self.path)!r}, {len(self)} frames)"


class AVFrames(Sequence[Image.Image]):
    """The video stream of a file PyAV can open, frame ``i`` decoded on demand (presentation order).

    Opening reads the packet index only (no decoding) to count the frames and learn their timestamps; a frame
    in order continues the running decoder, any other seeks to the key frame before it.
    """

    CACHE = 16  # decoded frames kept around the last one asked for (bounded: walks backwards cheaply)

    def __init__(self, path: str | os.PathLike[str]) -> None:
        import av

        self.path = Path(path)
        if not self.path.exists():
            raise VideoError(f"{self.path}: no such file or folder")
        try:
            with av.open(str(self.path)) as container:
                if not container.streams.video:
                    raise VideoError(f"{self.path}: no video stream (expected a video such as .mp4, or a folder "
                                     "of JPEG/PNG frames)")
                stream = container.streams.video[0]
                rate = stream.average_rate or stream.guessed_rate
                self.fps = float(rate) if rate else 24.0
                pts = [p.pts for p in container.demux(stream) if p.size]
        except av.FFmpegError as e:
            raise VideoError(f"{self.path}: cannot read the video: {e}") from None
        if not pts:
            raise VideoError(f"{self.path}: an empty video: its video stream has no frame")
        self._pts: list[int] | None = sorted(pts) if all(p is not None for p in pts) else None
        self._count = len(pts)
        self._container: Any = None
        self._decoder: Any = None
        self._next = 0  # index of the frame the running decoder yields next
        self._cache: OrderedDict[int, Image.Image] = OrderedDict()

    def __len__(self) -> int:
        return self._count

    def close(self) -> None:
        if self._container is not None:
            self._container.close()
        self._container = self._decoder = None
        self._cache.clear()

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass

    def __getitem__(self, index: int) -> Image.Image:  # type: ignore[override]
        index = _index(index, len(self))
        if index in self._cache:
            self._cache.move_to_end(index)
            return self._cache[index]
        import av

        try:
            if self._decoder is None or index < self._next or index > self._next + 2 * self.CACHE:
                self._seek(index)
            while True:
                frame = next(self._decoder)
                i = self._frame_index(frame)
                self._next = i + 1
                if i < index - self.CACHE:
                    continue
                image = frame.to_image()
                self._remember(i, image)
                if i >= index:
                    break
        except StopIteration:
            self.close()
            raise VideoError(f"{self.path}: frame {index} could not be decoded (the stream ended early)") from None
        except av.FFmpegError as e:
            self.close()
            raise VideoError(f"{self.path}: cannot decode frame {index}: {e}") from None
        if index not in self._cache:
            raise VideoError(f"{self.path}: frame {index} could not be decoded (no frame has its timestamp)")
        return self._cache[index]

    def _remember(self, i: int, image: Image.Image) -> None:
        self._cache[i] = image
        self._cache.move_to_end(i)
        while len(self._cache) > self.CACHE:
            self._cache.popitem(last=False)

    def _frame_index(self, frame: Any) -> int:
        if self._pts is None:  # no timestamps: count frames from the start of the stream
            return self._next
        import bisect

        pts = frame.pts if frame.pts is not None else self._pts[min(max(self._next, 0), len(self._pts) - 1)]
        return min(bisect.bisect_left(self._pts, pts), len(self._pts) - 1)

    def _seek(self, index: int) -> None:
        import av

        if self._container is None:
            self._container = av.open(str(self.path))
            self._container.streams.video[0].thread_type = "AUTO"
        stream = self._container.streams.video[0]
        if self._pts is None or index == 0:
            if self._decoder is not None:
                self._container.seek(0, stream=stream)
            self._next = 0
        else:
            self._container.seek(self._pts[index], stream=stream, backward=True, any_frame=False)
            self._next = -1  # unknown until the first frame's timestamp is read
        self._decoder = iter(self._container.decode(stream))


def _index(index: int, n: int) -> int:
    if not isinstance(index, int | np.integer):
        raise TypeError(f"frame index must be an integer, got {type(index).__name__}")
    if not 0 <= index < n:
        raise VideoError(f"frame {index} is out of range: the clip has {n} frames (0 to {n - 1})")
    return int(index)


def open_video(path: str | os.PathLike[str]) -> FolderFrames | AVFrames:
    """The frame source for ``path``: a folder of JPEG/PNG frames, or a file PyAV decodes (.mp4, .mov...)."""
    p = Path(path)
    if p.is_dir():
        return FolderFrames(p)
    if not p.exists():
        raise VideoError(f"{p}: no such file or folder (expected a video such as .mp4, or a folder of JPEG/PNG "
                         "frames)")
    return AVFrames(p)


def label_map(masks: Mapping[int, np.ndarray], shape: tuple[int, int]) -> np.ndarray:
    """One 8-bit image: pixel = object id, 0 background; the lower id wins where objects overlap."""
    out = np.zeros(shape, dtype=np.uint8)
    for obj in sorted(masks, reverse=True):  # paint higher ids first: lower ids overwrite them
        if not 0 < obj < 256:
            raise ValueError(f"object id {obj} does not fit an 8-bit mask PNG (1 to 255)")
        m = np.asarray(masks[obj], dtype=bool)
        if m.shape != shape:
            raise ValueError(f"object {obj}'s mask is {m.shape}, the frame {shape}")
        out[m] = obj
    return out


def encode_rle(mask: np.ndarray) -> dict[str, Any]:
    """COCO RLE of a whole boolean mask: ``{"size": [H, W], "counts": str}`` (pycocotools' compressed form)."""
    from pycocotools import mask as coco_mask

    rle = coco_mask.encode(np.asfortranarray(np.asarray(mask, dtype=np.uint8)))
    return {"size": [int(v) for v in rle["size"]], "counts": rle["counts"].decode("ascii")}


def decode_rle(rle: Mapping[str, Any]) -> np.ndarray:
    """The boolean mask of a COCO RLE written by :func:`encode_rle`."""
    from pycocotools import mask as coco_mask

    return coco_mask.decode({"size": list(rle["size"]), "counts": rle["counts"].encode("ascii")}).astype(bool)


class TrackWriter:
    """Writes one frame's results at a time into ``directory``: ``masks/NNNNN.png`` and ``masks.json``.

    ``masks.json`` is streamed (nothing is kept per frame): ``{"video", "height", "width", "objects",
    "frames": {"N": {"ID": {"size": [H, W], "counts": ...}}}}``, one entry per written frame (in the order the
    frames were processed; it is a mapping, keyed by frame index) holding every object's whole mask.
    """

    def __init__(self, directory: Path, *, video: str, size: tuple[int, int], objects: Iterable[int]) -> None:
        self.directory = Path(directory)
        self.height, self.width = size
        self.objects = sorted(set(objects))
        (self.directory / "masks").mkdir(parents=True, exist_ok=True)
        self._json = open(self.directory / "masks.json", "w")
        head = {"video": video, "height": self.height, "width": self.width, "objects": self.objects}
        self._json.write(json.dumps(head)[:-1] + ', "frames": {')
        self._first = True
        self.written: set[int] = set()

    def write(self, index: int, masks: Mapping[int, np.ndarray]) -> None:
        """Frame ``index``'s boolean masks by object id (missing objects are empty)."""
        if index in self.written:
            raise ValueError(f"frame {index} was written twice")
        Image.fromarray(label_map(masks, (self.height, self.width)), mode="L").save(
            self.directory / "masks" / frame_name(index), format="PNG")
        entry = {str(obj): encode_rle(masks[obj]) for obj in sorted(masks)}
        self._json.write(("" if self._first else ", ") + json.dumps(str(index)) + ": " + json.dumps(entry))
        self._first = False
        self.written.add(index)

    def close(self) -> None:
        if not self._json.closed:
            self._json.write("}}\n")
            self._json.close()

    def abort(self) -> None:
        self._json.close()


def read_masks_json(path: str | os.PathLike[str]) -> dict[int, dict[int, np.ndarray]]:
    """``{frame: {object: bool mask}}`` from a ``masks.json`` that :class:`TrackWriter` wrote."""
    data = json.loads(Path(path).read_text())
    return {int(f): {int(o): decode_rle(r) for o, r in objs.items()} for f, objs in data["frames"].items()}


def write_overlay(path: Path, frames: Sequence[Image.Image], mask_dir: Path, indices: Sequence[int], *,
                  fps: float = 24.0, progress: bool = False) -> None:
    """``overlay.mp4`` (H.264): frames ``indices`` of the clip with each object's mask tinted, read back from
    the ``NNNNN.png`` files in ``mask_dir``; one frame in memory at a time. Odd sizes are padded by one pixel."""
    import av
    from tqdm import tqdm

    from .overlay import draw_overlay

    with av.open(str(path), mode="w", format="mp4") as container:
        stream = None
        for index in tqdm(indices, desc="overlay", unit="frame", disable=not progress):
            frame = frames[index]
            labels = np.array(Image.open(mask_dir / frame_name(index)))
            ids = [int(v) for v in np.unique(labels) if v]
            palette_masks = [labels == v for v in ids]
            image = np.asarray(_tinted(draw_overlay, frame, palette_masks, ids).convert("RGB"))
            h, w = image.shape[:2]
            if stream is None:
                stream = container.add_stream("libx264", rate=_rate(fps))
                stream.width, stream.height = w + w % 2, h + h % 2
                stream.pix_fmt = "yuv420p"
                stream.options = {"crf": "20", "preset": "veryfast"}
            if w % 2 or h % 2:
                image = np.pad(image, ((0, h % 2), (0, w % 2), (0, 0)), mode="edge")
            for packet in stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                container.mux(packet)
        if stream is not None:
            for packet in stream.encode():
                container.mux(packet)


def _tinted(draw: Any, frame: Image.Image, masks: list[np.ndarray], ids: list[int]) -> Image.Image:
    """The overlay with object ``k``'s colour fixed by its id (so an object keeps its colour on every frame)."""
    if not masks:
        return frame
    # draw_overlay colours mask i with PALETTE[i]: give it a list whose position i is object id - 1
    slots: list[np.ndarray] = [np.zeros_like(masks[0])] * max(ids)
    for m, obj in zip(masks, ids):
        slots[obj - 1] = m
    return draw(frame, slots)


def _rate(fps: float) -> Any:
    from fractions import Fraction

    return Fraction(fps).limit_denominator(1001) if fps > 0 else Fraction(24)
