"""``kestrel track``: follow objects through a video from clicks and boxes (SAM 2.1's video model)."""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from .options import (
    Choice,
    Command,
    Device,
    ExistingDir,
    ExistingPath,
    Int,
    ModelRef,
    Option,
    OutDir,
    Text,
    register,
    weights_option,
)

EPILOG = """examples:
  kestrel track clip.mp4 --model sam2.1-hiera-tiny --point 0:210,350 --out out/      one click on frame 0
  kestrel track frames/ --model DIR --box 0:80,40,300,260 --out out/                 a box; DIR a Sam2VideoModel save
  kestrel track clip.mp4 --model sam2.1-hiera-tiny --point 0:210,350 --point 40:220,340:0 --out out/
                                                    a background click on frame 40 corrects the track from there
  kestrel track clip.mp4 --model sam2.1-hiera-tiny --object 1 --point 0:210,350 \\
      --object 2 --box 0:400,100,520,260 --out out/                                two objects
  kestrel track clip.mp4 --model sam2.1-hiera-tiny --point 99:210,350 --reverse --out out/   backwards from 99
  kestrel track frames/ --model sam2.1-hiera-tiny --point 0:210,350 --out out/ --eval annotations/   J&F

Prompts: --point FRAME:X,Y[:LABEL] (pixels of that frame; LABEL 1 foreground, the default, or 0
background) and --box FRAME:X0,Y0,X1,Y1. They belong to object 1 unless an --object ID (1 to 255) comes
before them; several objects, and prompts on any frame of the range, are allowed.

Writes, into OUTDIR (all at once at the end: a failure leaves nothing half-written):
  masks/NNNNN.png  one per tracked frame: 8-bit, the frame's size, pixel = object id, 0 background; where
                   objects overlap the lower id wins (the DAVIS / SAM 2 VOS convention)
  masks.json       COCO RLE of every object's whole mask on every frame (overlaps kept)
  overlay.mp4      the clip with each object tinted
  eval.json        with --eval: J, F and J&F per object and overall (the DAVIS benchmark's measures)
"""


def _numbers(text: str, n: int, flag: str, whole: str) -> list[float]:
    from ..pipelines.video_track import TrackError

    try:
        values = [float(p) for p in text.split(",")]
    except ValueError:
        values = []
    if len(values) != n or not all(math.isfinite(v) for v in values):
        raise TrackError(f"{flag} {whole!r}: expected {n} comma-separated finite numbers after the frame")
    return values


def _frame(text: str, flag: str, whole: str, form: str) -> int:
    from ..pipelines.video_track import TrackError

    try:
        frame = int(text)
    except ValueError:
        raise TrackError(f"{flag} {whole!r}: expected {form}, starting with a frame index") from None
    if frame < 0:
        raise TrackError(f"{flag} {whole!r}: frame {frame} is negative")
    return frame


def parse_point(text: str) -> tuple[int, tuple[float, float], int]:
    """``FRAME:X,Y`` or ``FRAME:X,Y:LABEL`` (label 1 by default) as (frame, (x, y), label)."""
    from ..pipelines.video_track import TrackError

    parts = text.split(":")
    if len(parts) not in (2, 3):
        raise TrackError(f"--point {text!r}: expected FRAME:X,Y or FRAME:X,Y:LABEL")
    frame = _frame(parts[0], "--point", text, "FRAME:X,Y[:LABEL]")
    x, y = _numbers(parts[1], 2, "--point", text)
    label = 1
    if len(parts) == 3:
        if parts[2].strip() not in ("0", "1"):
            raise TrackError(f"--point {text!r}: the label after the second ':' is 1 (foreground) or 0 (background)")
        label = int(parts[2])
    return frame, (x, y), label


def parse_box(text: str) -> tuple[int, tuple[float, float, float, float]]:
    """``FRAME:X0,Y0,X1,Y1`` as (frame, box)."""
    from ..pipelines.video_track import TrackError

    parts = text.split(":")
    if len(parts) != 2:
        raise TrackError(f"--box {text!r}: expected FRAME:X0,Y0,X1,Y1")
    frame = _frame(parts[0], "--box", text, "FRAME:X0,Y0,X1,Y1")
    x0, y0, x1, y1 = _numbers(parts[1], 4, "--box", text)
    return frame, (x0, y0, x1, y1)


def build_prompts(events: list[tuple[str, str]]) -> list[Any]:
    """TrackPrompts from the ordered ``--object/--point/--box`` flags: one per (frame, object)."""
    from ..pipelines.video_track import TrackError, _engine

    TrackPrompt = _engine().TrackPrompt
    obj = 1
    order: list[tuple[int, int]] = []
    points: dict[tuple[int, int], list[tuple[float, float]]] = {}
    labels: dict[tuple[int, int], list[int]] = {}
    boxes: dict[tuple[int, int], tuple[float, float, float, float]] = {}
    for flag, text in events:
        if flag == "object":
            try:
                obj = int(text)
            except ValueError:
                raise TrackError(f"--object {text!r}: expected an object id, an integer 1 to 255") from None
            if not 1 <= obj <= 255:
                raise TrackError(f"--object {obj}: object ids are 1 to 255 (0 is background in the mask PNGs)")
            continue
        if flag == "point":
            frame, xy, label = parse_point(text)
            key = (frame, obj)
            points.setdefault(key, []).append(xy)
            labels.setdefault(key, []).append(label)
        else:
            frame, box = parse_box(text)
            key = (frame, obj)
            if key in boxes:
                raise TrackError(f"--box {text!r}: object {obj} already has a box on frame {frame}; one box per "
                                 "object and frame (use --object ID for another object)")
            boxes[key] = box
        if key not in order:
            order.append(key)
    return [TrackPrompt(frame=f, object_id=o, points=tuple(points.get((f, o), ())),
                        labels=tuple(labels.get((f, o), ())), box=boxes.get((f, o)))
            for f, o in sorted(order)]


class _Ordered(argparse.Action):
    """Keeps --object, --point and --box in command-line order (an --object applies to what follows)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        events = getattr(namespace, "prompt_events", None) or []
        events.append((self.dest, values))
        namespace.prompt_events = events


class Staging:
    """A temporary folder beside OUTDIR that becomes OUTDIR only when everything is written."""

    def __init__(self, out: Path) -> None:
        from ..errors import OutputError

        self.out = out
        if out.is_symlink() or (out.exists() and not out.is_dir()):
            raise OutputError(f"--out {out}: exists and is not a directory")
        if out.is_dir() and any(out.iterdir()) and not (out / "masks.json").is_file():
            raise OutputError(f"--out {out}: a folder that is not empty and is not an earlier `kestrel track` output "
                              "(no masks.json); choose a new or empty folder")
        out.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir()

    def commit(self) -> None:
        """Replace OUTDIR by the finished folder (an earlier output there is removed)."""
        old = None
        if self.out.exists():
            old = self.out.parent / f".{self.out.name}.old-{os.getpid()}"
            os.replace(self.out, old)
        os.replace(self.tmp, self.out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def discard(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


def cmd_track(args: argparse.Namespace) -> int:
    """follow objects through a video from clicks and boxes (SAM 2.1)

    Track objects through a video: prompt them with clicks or boxes on any frame, get their masks on
    every frame (DAVIS PNGs, COCO RLE, an overlay video).
    """
    import numpy as np
    from tqdm import tqdm

    from ..pipelines.video_io import TrackWriter, frame_name, open_video, write_overlay
    from ..pipelines.video_track import TrackError, check_prompts, load_video_model, track

    events = getattr(args, "prompt_events", None) or []
    prompts = build_prompts(events)  # before anything is read: a bad prompt costs nothing
    if not prompts:
        raise TrackError("nothing to track: give --point FRAME:X,Y and/or --box FRAME:X0,Y0,X1,Y1")
    if args.start is not None and args.start < 0:
        raise TrackError(f"--start {args.start}: a frame index is 0 or more")
    out = Path(args.out)
    frames = open_video(args.video)
    start = args.start or 0
    span = check_prompts(prompts, frames, start, args.end)
    if args.eval is not None:
        from ..pipelines.video_eval import ground_truth_files

        ground_truth_files(args.eval)
    width, height = frames[span.start].size
    model = load_video_model(args.model, weights=args.weights, device=args.device, dtype=args.dtype)

    objects = sorted({p.object_id for p in prompts})
    staging = Staging(out)
    writer = None
    try:
        writer = TrackWriter(staging.tmp, video=str(args.video), size=(height, width), objects=objects)
        bar = tqdm(total=len(span), desc="tracking", unit="frame", disable=args.quiet, file=sys.stderr)
        empty = np.zeros((height, width), dtype=bool)
        for index, masks in track(frames, model, prompts, reverse=args.reverse, start=start, end=args.end):
            if index not in span:
                raise TrackError(f"the tracker returned frame {index}, outside frames {span.start} to {span.stop - 1}")
            arrays = {obj: masks[obj].cpu().numpy() if obj in masks else empty for obj in objects}
            writer.write(index, arrays)
            bar.update(1)
        for index in span:  # frames the tracker did not reach (before the first prompt): background
            if index not in writer.written:
                writer.write(index, dict.fromkeys(objects, empty))
        bar.close()
        writer.close()
        order = list(span)
        write_overlay(staging.tmp / "overlay.mp4", frames, staging.tmp / "masks", order,
                      fps=getattr(frames, "fps", 24.0), progress=not args.quiet)
        score = None
        if args.eval is not None:
            from ..pipelines.video_eval import evaluate_folder

            score = evaluate_folder(staging.tmp / "masks", args.eval, frames=order)
            (staging.tmp / "eval.json").write_text(json.dumps(score.as_dict(), indent=2) + "\n")
        staging.commit()
    except BaseException:
        if writer is not None:
            writer.abort()
        staging.discard()
        raise
    first, last = span.start, span.stop - 1
    print(f"{len(span)} frames ({first} to {last}{', backwards' if args.reverse else ''}), "
          f"{len(objects)} object(s): {out / 'masks'}/{frame_name(first)}..., {out / 'masks.json'}, "
          f"{out / 'overlay.mp4'}")
    if score is not None:
        print(f"DAVIS scores against {args.eval} ({len(score.frames)} frames):")
        print(score.table())
        if score.untracked:
            print(f"objects in the ground truth that were never tracked (scored 0): {list(score.untracked)}")
        if score.extra:
            print(f"tracked objects absent from the ground truth (not scored): {list(score.extra)}")
        print(f"{out / 'eval.json'}")
    return 0


register(Command(
    "track", run=cmd_track, raw=True, epilog=EPILOG,
    options=[
        Option("video", ExistingPath(expect="an existing video file or folder of frames", metavar="VIDEO"),
               help="an .mp4 (or any format PyAV decodes), or a folder of JPEG/PNG frames sorted by name"),
        Option("--model", ModelRef(metavar="DIR|CARD"), required=True,
               help="a SAM 2.1 card (sam2.1-hiera-tiny...) or a transformers Sam2VideoModel save_pretrained "
                    "directory (model_type sam2_video)"),
        Option("--object", Int(1, 255, "an object id"), action=_Ordered,  # type: ignore[arg-type]
               help="the object (1 to 255) the following --point/--box flags prompt (default 1)"),
        Option("--point", Text(what="click FRAME:X,Y[:LABEL]", metavar="FRAME:X,Y[:LABEL]"),
               action=_Ordered,  # type: ignore[arg-type]
               help="a click on frame FRAME in pixels, label 1 foreground (default) or 0 background; repeatable"),
        Option("--box", Text(what="box FRAME:X0,Y0,X1,Y1", metavar="FRAME:X0,Y0,X1,Y1"),
               action=_Ordered,  # type: ignore[arg-type]
               help="a box around the object on frame FRAME; one per object and frame"),
        Option("--out", OutDir(), required=True,
               help="output folder (new, empty, or an earlier track output, which is replaced)"),
        Option("--reverse", help="propagate backwards, from the last prompted frame"),
        Option("--start", Int(0, 10**9, "a frame index"), help="first frame to track (default 0)"),
        Option("--end", Int(0, 10**9, "a frame index"),
               help="stop before frame N (exclusive; default: the last frame)"),
        Option("--eval", ExistingDir(metavar="GT_DIR"),
               help="score the masks against DAVIS-style ground-truth PNGs (pixel = object id): J, F, J&F"),
        weights_option(),
        Option("--device", Device(), default="cpu", help="cpu (default), cuda, cuda:N or mps"),
        Option("--dtype", Choice(choices=("f32", "bf16", "f16")), default="f32", help="compute dtype (default f32)"),
        Option("--quiet", help="no progress bar"),
    ]))
