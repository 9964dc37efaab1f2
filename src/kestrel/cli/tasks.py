"""Commands that run models on images: ``classify`` and ``embed``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff"}


def _load(args: argparse.Namespace, **generics: int):
    from ..runtime.load import load

    return load(args.model, weights=args.weights, dtype=args.dtype, device=args.device, **generics)


def expand_paths(items: list[str]) -> list[Path]:
    """Files as given; directories expanded to the image files they contain, sorted."""
    out: list[Path] = []
    for item in items:
        p = Path(item)
        if p.is_dir():
            out += sorted(f for f in p.rglob("*") if f.suffix.lower() in IMAGE_SUFFIXES)
        else:
            out.append(p)
    return out


def cmd_classify(args: argparse.Namespace) -> int:
    from ..pipelines.tasks import classify

    model = _load(args)
    paths = expand_paths(args.images)
    for path, top in zip(paths, classify(model, paths, top=args.top, batch_size=args.batch_size)):
        print(path)
        for label, p in top:
            print(f"  {p:7.2%}  {label}")
    return 0


def cmd_embed(args: argparse.Namespace) -> int:
    import torch

    from ..pipelines.tasks import embed_images
    from ..runtime.checkpoint import save_tensors

    size = {"Height": args.size, "Width": args.size} if args.size else {}
    model = _load(args, **size)
    paths = expand_paths(args.inputs)
    feats, done = [], []
    for batch, f in embed_images(model, paths, pool=args.pool, batch_size=args.batch_size,
                                 progress=not args.quiet):
        feats.append(f)
        done += [str(p) for p in batch]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    features = torch.cat(feats)
    save_tensors({"features": features}, out, metadata={"paths": json.dumps(done), "pool": args.pool,
                                                        "model": model.loaded.name})  # type: ignore[attr-defined]
    print(f"wrote {tuple(features.shape)} {args.pool} features of {len(done)} images to {out}")
    return 0


def _common(p: argparse.ArgumentParser, default_model: str | None) -> None:
    p.add_argument("--model", default=default_model, required=default_model is None, metavar="NAME|DIR",
                   help="card name or save_pretrained directory" + (f" (default {default_model})"
                                                                     if default_model else ""))
    p.add_argument("--weights", metavar="DIR", help="read the card's files from DIR instead of the hub")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--dtype", default="f32", choices=["f32", "bf16", "f16"], help="compute dtype (default f32)")
    p.add_argument("--batch-size", type=int, default=8, help="images per forward pass (default 8)")


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("classify", help="label images with an image classifier",
                       description="Print the top labels (the checkpoint's id2label) with probabilities.",
                       epilog="example: kestrel classify cat.jpg --top 3 --weights ./vit-base-patch16-224")
    p.add_argument("images", nargs="+", metavar="IMAGE", help="image files or directories")
    p.add_argument("--top", type=int, default=5, help="how many labels per image (default 5)")
    _common(p, "vit-base-patch16-224")
    p.set_defaults(run=cmd_classify)

    p = sub.add_parser("embed", help="write image features to a safetensors file",
                       description="Features of every image (class token, mean of patch tokens, or all patch "
                                   "tokens), saved with the image paths in the file's metadata.",
                       epilog="example: kestrel embed photos/ --model dinov2-base --out feats.safetensors")
    p.add_argument("inputs", nargs="+", metavar="PATH", help="image files or directories")
    p.add_argument("--out", required=True, metavar="FILE", help="output .safetensors file")
    p.add_argument("--pool", default="cls", choices=["cls", "mean", "patch"], help="which features (default cls)")
    p.add_argument("--size", type=int, help="run at this square image size (DINOv2: a multiple of the patch)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    _common(p, None)
    p.set_defaults(run=cmd_embed)
