"""``kestrel segment``: masks from clicks and boxes, or every object in the image."""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path
from typing import Any

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


def _numbers(text: str, n: int, what: str) -> list[float]:
    from ..pipelines.prompts import PromptError

    parts = text.split(",")
    try:
        values = [float(p) for p in parts]
    except ValueError:
        values = []
    if len(values) != n:
        raise PromptError(f"{what} {text!r}: expected {n} comma-separated numbers")
    if not all(math.isfinite(v) for v in values):
        raise PromptError(f"{what} {text!r}: coordinates must be finite numbers")
    return values


def parse_point(text: str) -> tuple[tuple[float, float], int]:
    """``X,Y`` or ``X,Y:LABEL`` (label 1 by default)."""
    from ..pipelines.prompts import PromptError

    xy, _, label = text.partition(":")
    x, y = _numbers(xy, 2, "--point")
    try:
        lab = int(label) if label else 1
    except ValueError:
        raise PromptError(f"--point {text!r}: the label after ':' must be an integer (1, 0, -1 or -10)") from None
    return (x, y), lab


def parse_box(text: str) -> tuple[float, float, float, float]:
    x0, y0, x1, y1 = _numbers(text, 4, "--box")
    return x0, y0, x1, y1


def build_prompts(points: list[str], boxes: list[str]) -> list[Any]:
    """``--point``s make one object; each ``--box`` one object, sharing the points when both are given."""
    from ..pipelines.prompts import Prompt

    parsed = [parse_point(p) for p in points]
    xy, labels = [p for p, _ in parsed], [lab for _, lab in parsed]
    if not boxes:
        return [Prompt(xy, labels)]
    return [Prompt(list(xy), list(labels), parse_box(b)) for b in boxes]


def _describe(prompt: Any) -> str:
    parts = [f"--point {x:g},{y:g}:{lab}" for (x, y), lab in zip(prompt.points, prompt.labels)]
    if prompt.box is not None:
        parts.append("--box " + ",".join(f"{v:g}" for v in prompt.box))
    return " ".join(parts)


def _check_out(out: Path) -> None:
    from ..pipelines.prompts import PromptError

    if out.exists() and not out.is_dir():
        raise PromptError(f"--out {out}: exists and is not a directory")


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
    import numpy as np
    import torch
    from PIL import Image

    from ..pipelines.images import load_image
    from ..pipelines.overlay import draw_overlay
    from ..pipelines.prompts import PromptError
    from ..pipelines.segment import load_embedding, save_embedding, segmenter_for
    from ..pipelines.segmenter import image_digest
    from .tasks import _load

    if args.everything and _dataset_mode(args):
        return _everything_dataset(args)
    if args.engine or args.address or args.workers:
        raise PromptError("--engine, --address and --workers are for --everything over a dataset")
    out = Path(args.out)
    _check_out(out)
    if not args.everything and not args.point and not args.box:
        raise PromptError("nothing to segment: give --point X,Y and/or --box X0,Y0,X1,Y1, or --everything")
    if args.everything and (args.point or args.box or args.mask_input):
        raise PromptError("--everything places its own grid of points: drop --point, --box and --mask-input")
    prompts = build_prompts(args.point or [], args.box or []) if not args.everything else []
    for i, prompt in enumerate(prompts):  # before the model loads: a bad prompt costs nothing
        prompt.check(f"prompt {i} ({_describe(prompt)})")
    photo = load_image(args.image)
    mask_file = Path(args.mask_input) if args.mask_input else None
    if mask_file is not None and not mask_file.is_file():
        raise FileNotFoundError(f"--mask-input {mask_file}: no such file")

    if args.size is not None and (args.size <= 0 or args.size % 32):
        raise PromptError(f"--size {args.size}: SAM 2 runs at a positive multiple of 32 px (1024 or 512)")
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
    if mask_file is not None:
        if mask_file.suffix == ".npy":
            array = np.load(mask_file, allow_pickle=False)
        else:
            array = np.array(Image.open(mask_file).convert("L"))
        mask_input = seg.mask_prompt(array, emb.original_size)

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


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("segment", help="masks from points and boxes, or every object (SAM)",
                       description="Segment the object at a click or in a box, or every object in the image. "
                                   "Writes one PNG per mask, an overlay and a JSON summary; prints the predicted IoU.",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("image", metavar="IMAGE", help="the photo; with --everything also a dataset SOURCE (a folder, "
                   "list file or .parquet/.csv table): Parquet shards with COCO RLE masks per image in --out DIR")
    p.add_argument("--point", action="append", metavar="X,Y[:LABEL]",
                   help="a click in pixels of the photo, label 1 (default) foreground or 0 background; repeatable")
    p.add_argument("--box", action="append", metavar="X0,Y0,X1,Y1",
                   help="a box around one object; repeatable (one object each; the points apply to every box)")
    p.add_argument("--mask-input", metavar="FILE",
                   help="a previous mask as a dense prompt: lowres_K.npy from an earlier run (256 x 256 logits) "
                        "or a mask image of the photo's size")
    p.add_argument("--multimask", action="store_true",
                   help="three candidate masks per object instead of one (best predicted IoU first)")
    p.add_argument("--embeddings", metavar="FILE",
                   help="reuse the image embedding saved in FILE, or save it there (safetensors); a file of "
                        "another model, revision or image is refused")
    p.add_argument("--everything", action="store_true",
                   help="segment every object: a grid of points, filtered and de-duplicated (COCO RLE JSON)")
    p.add_argument("--points-per-side", type=int, default=32, help="--everything: grid points per side (32)")
    p.add_argument("--points-per-batch", type=int, default=64,
                   help="--everything: points decoded at once; bounds memory (64)")
    p.add_argument("--pred-iou-thresh", type=float, default=0.88, help="--everything: keep predicted IoU above (0.88)")
    p.add_argument("--stability-score-thresh", type=float, default=0.95,
                   help="--everything: keep stability score above (0.95)")
    p.add_argument("--nms-thresh", type=float, default=0.7, help="--everything: box NMS IoU threshold (0.7)")
    p.add_argument("--crops-n-layers", type=int, default=0,
                   help="--everything: also run on 2x2, 4x4... crops, this many layers (0)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--out", default="segment-out", metavar="DIR", help="output directory (default segment-out)")
    p.add_argument("--model", default="sam-vit-base", metavar="NAME|DIR",
                   help="card name or save_pretrained directory (default sam-vit-base)")
    p.add_argument("--weights", metavar="DIR", help="read the card's files from DIR instead of the hub")
    p.add_argument("--size", type=int, metavar="PX",
                   help="SAM 2: run at PX x PX (1024 upstream, 512 the edge recipe; a multiple of 32)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--dtype", default="f32", choices=["f32", "bf16", "f16"], help="compute dtype (default f32)")
    from .datasets import add_dataset_args
    from .tasks import add_speed_args

    add_speed_args(p)

    add_dataset_args(p)
    p.set_defaults(run=cmd_segment)
