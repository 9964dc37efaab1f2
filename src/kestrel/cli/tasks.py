"""Commands that run models on images: ``classify`` and ``embed``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..models.cards import CardError
from .datasets import DATASET_HELP, add_dataset_args

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


def _tokenizer(model):
    from ..pipelines.tokenizer import SiglipTextTokenizer

    return SiglipTextTokenizer.from_dir(model.loaded.directory, max_length=model.generics["MaxPositions"])


def _needs_text_model(model, command: str) -> None:
    if not hasattr(model, "text_features"):
        raise CardError(f"{command} needs an image-text model such as siglip-base-patch16-224; "
                        f"{model.loaded.name} has no text tower")


def cmd_embed(args: argparse.Namespace) -> int:
    import torch

    from .datasets import is_dataset_out, run_dataset

    if is_dataset_out(args.out):
        if args.text:
            raise CardError("--text writes one .safetensors file: give --out FILE.safetensors")
        return run_dataset(args, "embed", args.inputs, pool=args.pool, size=args.size)

    from ..pipelines.tasks import embed_images
    from ..pipelines.zero_shot import encode_texts
    from ..runtime.checkpoint import save_tensors

    size = {"Height": args.size, "Width": args.size} if args.size else {}
    model = _load(args, **size)
    if args.text:
        _needs_text_model(model, "embed --text")
        features = encode_texts(model, args.text, _tokenizer(model), args.template).float().cpu()
        done, what = list(args.text), "texts"
    else:
        paths = expand_paths(args.inputs)
        if not paths:
            raise CardError("nothing to embed: give image files or directories (or --text for a text model)")
        feats, done = [], []
        for batch, f in embed_images(model, paths, pool=args.pool, batch_size=args.batch_size,
                                     progress=not args.quiet):
            feats.append(f)
            done += [str(p) for p in batch]
        features, what = torch.cat(feats), "images"
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_tensors({"features": features}, out, metadata={what: json.dumps(done), "pool": args.pool,
                                                        "model": model.loaded.name})
    print(f"wrote {tuple(features.shape)} features of {len(done)} {what} to {out}")
    return 0


def _split_images_and_texts(items: list[str]) -> tuple[list[Path], list[str]]:
    """Leading arguments that name existing files or directories are images; the rest are texts."""
    images: list[Path] = []
    for k, item in enumerate(items):
        if Path(item).exists():
            images += expand_paths([item])
        else:
            return images, items[k:]
    return images, []


def cmd_zero_shot(args: argparse.Namespace) -> int:
    from ..pipelines.tasks import preprocess_for
    from ..pipelines.zero_shot import zero_shot
    from .datasets import is_dataset_out, run_dataset

    if is_dataset_out(args.out):
        if not args.labels:
            raise CardError("dataset mode (--out DIR) takes the texts with --labels A B C")
        return run_dataset(args, "zero-shot", args.items, labels=tuple(args.labels), template=args.template)
    if args.labels:
        images, texts = expand_paths(args.items), list(args.labels)
    else:
        images, texts = _split_images_and_texts(args.items)
    if not images:
        raise CardError(f"no image found among the arguments: {args.items[0]!r} is not a file or directory")
    if not texts:
        raise CardError("give the candidate texts after the images, e.g. kestrel zero-shot cat.jpg \"a cat\" \"a dog\"")
    model = _load(args)
    _needs_text_model(model, "zero-shot")
    probs = zero_shot(model, images, texts, _tokenizer(model), preprocess_for(model), args.template)
    for path, row in zip(images, probs.float().tolist()):
        print(path)
        for p, text in sorted(zip(row, texts), reverse=True):
            print(f"  {p:7.2%}  {text}")
    return 0


def cmd_similarity(args: argparse.Namespace) -> int:
    from ..pipelines.tasks import preprocess_for
    from ..pipelines.zero_shot import similarity_table, zero_shot

    images = expand_paths(args.images)
    model = _load(args)
    _needs_text_model(model, "similarity")
    table_fn = zero_shot if args.probabilities else similarity_table
    table = table_fn(model, images, args.texts, _tokenizer(model), preprocess_for(model), args.template).float()
    names = [p.name for p in images]
    width = max(len(n) for n in names)
    cols = [t if len(t) <= 18 else t[:17] + "…" for t in args.texts]
    cw = max(9, *(len(c) for c in cols))
    print(" " * width + "  " + "  ".join(c.rjust(cw) for c in cols))
    for name, row in zip(names, table.tolist()):
        cells = [f"{v:.2%}" if args.probabilities else f"{v:+.3f}" for v in row]
        print(name.ljust(width) + "  " + "  ".join(c.rjust(cw) for c in cells))
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

    p = sub.add_parser("embed", help="image features to a safetensors file, or a dataset to Parquet shards",
                       description="Features of every image (class token, mean of patch tokens, or all patch "
                                   "tokens). With --out FILE.safetensors: one tensor, the image paths in the "
                                   "file's metadata. With --out DIR: dataset mode (below).",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog=DATASET_HELP + "\nexamples:\n"
                              "  kestrel embed photos/ --model dinov2-base --out feats.safetensors\n"
                              "  kestrel embed photos/ --model dinov2-base --out feats/ --engine ray --workers 2\n"
                              "  kestrel embed index.parquet --model dinov2-base --out feats/ --engine ray "
                              "--address auto")
    p.add_argument("inputs", nargs="*", metavar="SOURCE",
                   help="image files or folders; in dataset mode also list files and .parquet/.csv tables")
    p.add_argument("--text", nargs="+", metavar="TEXT", help="embed these texts instead (SigLIP)")
    p.add_argument("--template", help="format each text with this template, e.g. 'a photo of {}.'")
    p.add_argument("--out", required=True, metavar="FILE|DIR",
                   help="FILE.safetensors: one features tensor; DIR: Parquet shards (dataset mode)")
    p.add_argument("--pool", default="cls", choices=["cls", "mean", "patch"], help="which features (default cls)")
    p.add_argument("--size", type=int, help="run at this square image size (DINOv2: a multiple of the patch)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    _common(p, None)
    add_dataset_args(p)
    p.set_defaults(run=cmd_embed)

    p = sub.add_parser("zero-shot", help="score free-text labels against images (SigLIP)",
                       usage="kestrel zero-shot IMAGE... --labels TEXT... [--template T] [--out DIR] [options]",
                       description="Sigmoid probability that each text describes each image. SigLIP scores pairs "
                                   "independently, so an image's probabilities need not sum to one. With --out "
                                   "DIR: dataset mode (below), a scores column in label order and the best label.",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog=DATASET_HELP + '\nexamples:\n'
                              '  kestrel zero-shot cat.jpg --labels "a cat" "a dog" --template "a photo of {}."\n'
                              '  kestrel zero-shot photos/ --labels cat dog --out scores/ --engine ray')
    p.add_argument("items", nargs="+", metavar="IMAGE",
                   help="image files or folders (dataset mode: also list files and tables); without --labels, "
                        "the texts follow the images")
    p.add_argument("--labels", nargs="+", metavar="TEXT", help="the candidate texts")
    p.add_argument("--template", help="format each text with this template (must contain {})")
    p.add_argument("--out", metavar="DIR", help="dataset mode: write Parquet shards to DIR")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    _common(p, "siglip-base-patch16-224")
    add_dataset_args(p)
    p.set_defaults(run=cmd_zero_shot)

    p = sub.add_parser("similarity", help="a table of image x text scores (SigLIP)",
                       description="Logits (scaled cosine similarity plus bias) of every image against every text.",
                       epilog='example: kestrel similarity --images a.jpg b.jpg --texts "a cat" "a dog"')
    p.add_argument("--images", nargs="+", required=True, metavar="IMAGE", help="image files or directories")
    p.add_argument("--texts", nargs="+", required=True, metavar="TEXT", help="texts")
    p.add_argument("--template", help="format each text with this template (must contain {})")
    p.add_argument("--probabilities", action="store_true", help="print sigmoid probabilities instead of logits")
    _common(p, "siglip-base-patch16-224")
    p.set_defaults(run=cmd_similarity)
