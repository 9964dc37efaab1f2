"""``kestrel segment``: masks from clicks and boxes, or every object in the image."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from .datasets import dataset_options
from .options import (
    Box,
    Choice,
    Command,
    Device,
    ExistingPath,
    Int,
    ModelRef,
    NewFile,
    NpyFile,
    Option,
    OutDir,
    PixelSize,
    Point,
    PositiveInt,
    Probability,
    register,
    weights_option,
)
from .tasks import speed_options

EPILOG = """examples:
  kestrel segment photo.jpg --point 500,375                 one foreground click
  kestrel segment photo.jpg --point 500,375 --point 80,60:0 a click and a background click
  kestrel segment photo.jpg --box 75,275,1725,850 --box 425,600,700,875   two objects, one box each
  kestrel segment photo.jpg --point 500,375 --box 400,300,700,500         a click inside a box
  kestrel segment photo.jpg --point 500,375 --multimask     three candidate masks, best IoU first
  kestrel segment photo.jpg --point 500,375 --mask-input out/lowres_0.npy   refine a previous mask
  kestrel segment photo.jpg --point 500,375 --embeddings photo.emb.safetensors   encode once, reuse
  kestrel segment photo.jpg --everything --out everything/  every object: PNGs and COCO RLE JSON
  kestrel segment photo.jpg --point 300,200 --model sam2.1-hiera-tiny --size 512   SAM 2.1 at 512 px
  kestrel segment photos/ --everything --out masks/ --engine ray   a dataset: Parquet shards, COCO RLE per image

Points and boxes are in pixels of the photo. Labels: 1 foreground (default), 0 background,
-1 not a point, -10 ignored. Writes mask_K.png (white = object), lowres_K.npy (the 256 x 256 logits,
for --mask-input), overlay.png (the photo with every mask, point and box) and segment.json, and
prints each mask's predicted IoU.
"""


def build_prompts(points: list[tuple[tuple[float, float], int]], boxes: list[tuple[float, float, float, float]]
                  ) -> list[Any]:
    """``--point``s make one object; each ``--box`` one object, sharing the points when both are given.

    Points and boxes come parsed by their option kinds (:class:`~kestrel.cli.options.Point`, ``Box``)."""
    from ..pipelines.prompts import Prompt

    xy, labels = [p for p, _ in points], [lab for _, lab in points]
    if not boxes:
        return [Prompt(xy, labels)]
    return [Prompt(list(xy), list(labels), b) for b in boxes]


def _describe(prompt: Any) -> str:
    parts = [f"--point {x:g},{y:g}:{lab}" for (x, y), lab in zip(prompt.points, prompt.labels)]
    if prompt.box is not None:
        parts.append("--box " + ",".join(f"{v:g}" for v in prompt.box))
    return " ".join(parts)


def _write(path: Path, write: Any) -> None:
    """Write through a temporary file in the same directory, then rename: never a half-written file."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _save_png(image: Any, path: Path) -> None:
    _write(path, lambda t: image.save(t, format="PNG"))


def cmd_segment(args: argparse.Namespace) -> int:
    """masks from points and boxes, or every object (SAM)

    Segment the object at a click or in a box, or every object in the image. Writes one PNG per mask, an
    overlay and a JSON summary; prints the predicted IoU. Points and boxes must lie inside the photo
    (refused, not clipped).
    """
    import numpy as np
    import torch
    from PIL import Image

    from ..pipelines.images import load_image, read_mask
    from ..pipelines.input_rules import check_prompts_inside
    from ..pipelines.overlay import draw_overlay
    from ..pipelines.prompts import PromptError
    from ..pipelines.segment import load_embedding, save_embedding, segmenter_for
    from ..pipelines.segmenter import image_digest
    from .tasks import _load, check_size

    if args.everything and _dataset_mode(args):
        return _everything_dataset(args)
    if args.engine or args.address or args.workers:
        raise PromptError("--engine, --address and --workers are for --everything over a dataset")
    out = Path(args.out)
    if not args.everything and not args.point and not args.box:
        raise PromptError("nothing to segment: give --point X,Y and/or --box X0,Y0,X1,Y1, or --everything")
    if args.everything and (args.point or args.box or args.mask_input):
        raise PromptError("--everything places its own grid of points: drop --point, --box and --mask-input")
    prompts = build_prompts(args.point or [], args.box or []) if not args.everything else []
    for i, prompt in enumerate(prompts):  # before the model loads: a bad prompt costs nothing
        prompt.check(f"prompt {i} ({_describe(prompt)})")
    photo = load_image(args.image)
    check_prompts_inside(prompts, photo.width, photo.height)  # refused, not clipped (README: prompts)
    if args.everything:
        from ..pipelines.mask_generation import check_crops

        check_crops(photo.width, photo.height, args.crops_n_layers)
    mask_array = read_mask(args.mask_input) if args.mask_input else None
    if args.size is not None:
        check_size(args.model, args.weights, args.size)
    model = _load(args, **({"E": args.size // 16} if args.size else {}))
    seg = segmenter_for(model)
    if args.everything:
        return _everything(args, seg, photo, out)

    digest = image_digest(photo)
    emb_path = Path(args.embeddings) if args.embeddings else None
    if emb_path is not None and emb_path.exists():
        emb = load_embedding(emb_path, seg, digest)
        print(f"reused the image embedding in {emb_path}")
    else:
        emb = seg.encode(photo)
        emb.image_digest = digest
        if emb_path is not None:
            save_embedding(emb, emb_path)
            print(f"saved the image embedding to {emb_path}")

    mask_input = None
    if mask_array is not None:
        mask_input = seg.mask_prompt(mask_array, emb.original_size)

    decoded = seg.decode(emb, prompts, multimask=args.multimask, mask_input=mask_input)
    order = torch.argsort(decoded.iou, dim=1, descending=True)  # best first within each prompt
    low_res = torch.gather(decoded.low_res, 1, order[..., None, None].expand_as(decoded.low_res))
    iou = torch.gather(decoded.iou, 1, order)
    masks = seg.postprocess(low_res, emb)

    out.mkdir(parents=True, exist_ok=True)
    rows, shown = [], []
    k = 0
    for p in range(masks.shape[0]):
        for m in range(masks.shape[1]):
            name = f"mask_{k}.png"
            mask = masks[p, m].cpu().numpy()
            _save_png(Image.fromarray((mask * 255).astype(np.uint8), mode="L"), out / name)
            lowres = low_res[p, m].float().cpu().numpy()
            _write(out / f"lowres_{k}.npy", lambda t, a=lowres: np.save(open(t, "wb"), a))
            rows.append({"file": name, "prompt": p, "rank": m, "predicted_iou": float(iou[p, m]),
                         "area": int(mask.sum()), "lowres": f"lowres_{k}.npy"})
            if m == 0:
                shown.append(mask)
            print(f"{out / name}  prompt {p}  rank {m}  predicted IoU {float(iou[p, m]):.3f}  area {int(mask.sum())}")
            k += 1
    pts = [(x, y, lab) for pr in prompts for (x, y), lab in zip(pr.points, pr.labels)]
    boxes = [pr.box for pr in prompts if pr.box is not None]
    _save_png(draw_overlay(photo, shown, points=pts, boxes=boxes), out / "overlay.png")
    info = {"image": str(args.image), "model": seg.name, "revision": seg.revision,
            "size": list(emb.original_size), "masks": rows}
    _write(out / "segment.json", lambda t: Path(t).write_text(json.dumps(info, indent=2) + "\n"))
    print(f"{out / 'overlay.png'}  the photo with {len(shown)} mask(s)")
    return 0


def _everything(args: argparse.Namespace, seg: Any, photo: Any, out: Path) -> int:
    import numpy as np
    from PIL import Image

    from ..pipelines.coco import coco_annotations
    from ..pipelines.mask_generation import generate_masks
    from ..pipelines.overlay import draw_overlay

    result = generate_masks(seg, photo, points_per_side=args.points_per_side, points_per_batch=args.points_per_batch,
                            pred_iou_thresh=args.pred_iou_thresh, stability_score_thresh=args.stability_score_thresh,
                            crops_n_layers=args.crops_n_layers, crops_nms_thresh=args.nms_thresh,
                            progress=not args.quiet)
    out.mkdir(parents=True, exist_ok=True)
    for k, mask in enumerate(result.masks):
        _save_png(Image.fromarray(mask.astype(np.uint8) * 255, mode="L"), out / f"mask_{k}.png")
    coco = coco_annotations(result, image=str(args.image))
    _write(out / "masks.json", lambda t: Path(t).write_text(json.dumps(coco) + "\n"))
    _save_png(draw_overlay(photo, result.masks), out / "overlay.png")
    print(f"{len(result.masks)} masks: {out}/mask_*.png, {out / 'masks.json'} (COCO RLE), {out / 'overlay.png'}")
    for k, score in enumerate(result.scores[:10]):
        print(f"  mask_{k}.png  predicted IoU {score:.3f}  area {int(result.masks[k].sum())}")
    if len(result.scores) > 10:
        print(f"  ... and {len(result.scores) - 10} more (see masks.json)")
    return 0


def _dataset_mode(args: argparse.Namespace) -> bool:
    """--everything over a dataset: SOURCE is a folder, a list file or a table, or --engine is given."""
    from ..pipelines.datasets import IMAGE_SUFFIXES

    return bool(args.engine) or Path(args.image).suffix.lower() not in IMAGE_SUFFIXES


def _everything_dataset(args: argparse.Namespace) -> int:
    """Every object of every image of a dataset: Parquet shards, one row per image with COCO RLE masks."""
    from ..pipelines.prompts import PromptError
    from .datasets import run_dataset

    if args.point or args.box or args.mask_input or args.embeddings:
        raise PromptError("--everything over a dataset takes no --point, --box, --mask-input or --embeddings")
    options = (("points_per_side", args.points_per_side), ("points_per_batch", args.points_per_batch),
               ("pred_iou_thresh", args.pred_iou_thresh), ("stability_score_thresh", args.stability_score_thresh),
               ("crops_n_layers", args.crops_n_layers), ("crops_nms_thresh", args.nms_thresh))
    args.batch_size = 1
    return run_dataset(args, "segment-everything", [args.image], options=options)


EVERYTHING = "--everything (every object)"

register(Command(
    "segment", run=cmd_segment, raw=True, epilog=EPILOG,
    options=[
        Option("image", ExistingPath("an image, or with --everything a dataset SOURCE", "IMAGE"),
               help="the photo; with --everything also a dataset SOURCE (a folder, list file or .parquet/.csv "
                    "table): Parquet shards with COCO RLE masks per image in --out DIR"),
        Option("--point", Point(), action="append",
               help="a click in pixels of the photo, label 1 (default) foreground or 0 background; repeatable"),
        Option("--box", Box(), action="append",
               help="a box around one object; repeatable (one object each; the points apply to every box)"),
        Option("--mask-input", NpyFile(),
               help="a previous mask as a dense prompt: lowres_K.npy from an earlier run (256 x 256 logits) "
                    "or a mask image of the photo's size"),
        Option("--multimask", help="three candidate masks per object instead of one (best predicted IoU first)"),
        Option("--embeddings", NewFile(),
               help="reuse the image embedding saved in FILE, or save it there (safetensors); a file of "
                    "another model, revision or image is refused"),
        Option("--everything", help="segment every object: a grid of points, filtered and de-duplicated "
                                    "(COCO RLE JSON)"),
        Option("--points-per-side", PositiveInt(1024), default=32, group=EVERYTHING,
               help="grid points per side, 1 to 1024 (32)"),
        Option("--points-per-batch", PositiveInt(65536), default=16, group=EVERYTHING,
               help="points decoded at once; bounds memory, about 30 MiB a point for SAM (16)"),
        Option("--pred-iou-thresh", Probability(), default=0.88, group=EVERYTHING,
               help="keep predicted IoU above, 0 to 1 (0.88)"),
        Option("--stability-score-thresh", Probability(), default=0.95, group=EVERYTHING,
               help="keep stability score above, 0 to 1 (0.95)"),
        Option("--nms-thresh", Probability(), default=0.7, group=EVERYTHING, help="box NMS IoU threshold (0.7)"),
        Option("--crops-n-layers", Int(0, 6, "a layer count"), default=0, group=EVERYTHING,
               help="also run on 2x2, 4x4... crops, this many layers, 0 to 6 (0)"),
        Option("--quiet", help="no progress bar"),
        Option("--out", OutDir(), default="segment-out", help="output directory (default segment-out)"),
        Option("--model", ModelRef(), default="sam-vit-base",
               help="card name or save_pretrained directory (default sam-vit-base)"),
        weights_option(),
        Option("--size", PixelSize(), help="SAM 2: run at PX x PX (1024 upstream, 512 the edge recipe; a multiple "
                                           "of 32)"),
        Option("--device", Device(), default="cpu", help="cpu (default) or cuda"),
        Option("--dtype", Choice(choices=("f32", "bf16", "f16")), default="f32", help="compute dtype (default f32)"),
        *speed_options(), *dataset_options()]))
