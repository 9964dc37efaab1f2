"""Commands that run models on images: ``classify``, ``embed``, ``zero-shot`` and ``similarity``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from ..errors import UsageError
from ..models import capabilities
from ..models.cards import CardError
from . import args as types
from .datasets import DATASET_HELP, add_dataset_args

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff"}


def _load(args: argparse.Namespace, **generics: int):
    from ..runtime.load import load

    return load(args.model, weights=args.weights, dtype=args.dtype, device=args.device,
                compile=getattr(args, "compile", False), quantize=getattr(args, "quantize", None), **generics)


def add_speed_args(p: argparse.ArgumentParser) -> None:
    """``--compile`` and ``--quantize``: the speed options of ``kestrel.load`` (README, Speed)."""
    p.add_argument("--compile", action="store_true",
                   help="run the model under torch.compile (static shapes, inductor freezing): the first call "
                        "compiles (tens of seconds); pays on large inputs, see `kestrel bench DIR --compile`")
    p.add_argument("--quantize", choices=["int8"], default=None,
                   help="int8 dynamic quantisation of every linear layer (opt-in, not exact: README has its "
                        "accuracy against f32)")


def _generics_before_load(args: argparse.Namespace) -> tuple[str, dict] | None:
    """(family name, generics) of ``--model`` read without weights or network; None when that needs the hub."""
    from ..runtime.load import peek

    seen = peek(args.model, args.weights)
    if seen is None:
        return None
    family, config = seen
    try:
        return family.name, family.generics(config)
    except (KeyError, TypeError, ValueError):
        return None  # load names the problem with the config


def _require(args: argparse.Namespace, generic: str, message: str) -> None:
    """Refuse a model that lacks ``generic`` (e.g. a classifier's Classes) before anything is loaded."""
    seen = _generics_before_load(args)
    if seen is not None and generic not in seen[1]:
        raise UsageError(message.format(model=args.model, family=seen[0]))


def _check_size(args: argparse.Namespace) -> None:
    """``--size`` must be a whole number of patches of a model that can be rebound to a new size."""
    from ..models.cards import FAMILIES

    seen = _generics_before_load(args)
    if seen is None:
        return
    family, generics = seen
    resizable = [f.name for f in FAMILIES if "Height" in f.resizable]
    if family not in resizable:
        raise UsageError(f"--size: {args.model} is a {family} model, which runs at its checkpoint's image size; "
                         f"--size is for {', '.join(resizable)} models")
    patch = generics.get("Patch")
    if isinstance(patch, int) and args.size % patch:
        lower, upper = max(patch, args.size // patch * patch), (args.size // patch + 1) * patch
        raise UsageError(f"--size {args.size}: {args.model} cuts images into {patch} x {patch} patches, so the "
                         f"size must be a multiple of {patch} (e.g. {lower} or {upper})")


def expand_paths(items: list[str]) -> list[Path]:
    """Files as given; directories expanded to the image files they contain, sorted."""
    out: list[Path] = []
    for item in items:
        p = Path(item)
        if os.path.isdir(p):  # os.path: False, not an exception, for a name too long to exist
            out += sorted(f for f in p.rglob("*") if f.suffix.lower() in IMAGE_SUFFIXES)
        else:
            out.append(p)
    return out


def _report_skipped(command: str, skipped: list[tuple[str, str]], total: int) -> None:
    """One line per unreadable input on stderr, then a count."""
    if not skipped:
        return
    for path, reason in skipped:
        print(f"kestrel {command}: skipped {path}: {reason}", file=sys.stderr)
    print(f"kestrel {command}: skipped {len(skipped)} of {total} input(s) that could not be read "
          "(--strict stops at the first)", file=sys.stderr)


def _nothing_read(skipped: list[tuple[str, str]]) -> UsageError:
    first = f"; the first: {skipped[0][0]}: {skipped[0][1]}" if skipped else ""
    return UsageError(f"none of the {len(skipped)} input image(s) could be read{first}")


def _short(text: object, limit: int = 80) -> str:
    """``repr`` of a user's argument, cut to ``limit`` characters (a label pasted where a path goes)."""
    shown = repr(str(text))
    return shown if len(shown) <= limit else shown[: limit - 5] + "...'" + f" ({len(str(text))} characters)"


def _images(items: list[str]) -> list[Path]:
    paths = expand_paths(items)
    missing = [p for p in paths if not os.path.exists(p)]
    if missing:
        raise UsageError(f"no such image file or folder: {_short(missing[0])}"
                         + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    if not paths:
        raise UsageError(f"no image files (*{', *'.join(sorted(IMAGE_SUFFIXES))}) in {', '.join(items)}")
    return paths


NOT_A_CLASSIFIER = ("classify needs an image classifier (a checkpoint with a classification head and id2label, "
                    "e.g. vit-base-patch16-224); {model} is a {family} model without one: try `kestrel embed` for "
                    "its features")
NOT_IMAGE_TEXT = ("{command} needs an image-text model such as siglip-base-patch16-224; {model} is a {family} "
                  "model with no text tower")


def cmd_classify(args: argparse.Namespace) -> int:
    from ..pipelines.tasks import classify

    paths = _images(args.images)
    _require(args, "Classes", NOT_A_CLASSIFIER)
    model = _load(args)
    if "Classes" not in model.generics or not model.loaded.labels:
        raise UsageError(NOT_A_CLASSIFIER.format(model=model.loaded.name, family=model.loaded.family.name))
    skipped: list[tuple[str, str]] | None = None if args.strict else []
    results = classify(model, paths, top=args.top, batch_size=args.batch_size, skipped=skipped)
    for path, top in results:
        print(path)
        for label, p in top:
            print(f"  {p:7.2%}  {label}")
    _report_skipped("classify", skipped or [], len(paths))
    if not results:
        raise _nothing_read(skipped or [])
    return 0


def _tokenizer(model):
    from ..pipelines.tokenizer import SiglipTextTokenizer

    return SiglipTextTokenizer.from_dir(model.loaded.directory, max_length=model.generics["MaxPositions"])


def _needs_text_model(model, command: str) -> None:
    if not capabilities.of(model).text:
        raise CardError(f"{command} needs an image-text model such as siglip-base-patch16-224; "
                        f"{model.loaded.name} has no text tower")


def cmd_embed(args: argparse.Namespace) -> int:
    import torch

    from ..pipelines.tasks import embed_images
    from ..pipelines.zero_shot import encode_texts
    from ..runtime.checkpoint import save_tensors
    from ..runtime.output import prepare_output
    from .datasets import is_dataset_out, run_dataset

    if is_dataset_out(args.out):
        if args.text:
            raise UsageError("--text writes one .safetensors file: give --out FILE.safetensors")
        if args.size:
            _check_size(args)
        return run_dataset(args, "embed", args.inputs, pool=args.pool, size=args.size)
    if args.text and args.inputs:
        raise UsageError("give image paths or --text, not both")
    if not args.text and not args.inputs:
        raise UsageError("nothing to embed: give image files or folders (or --text for a text model)")
    paths = [] if args.text else _images(args.inputs)
    if args.text:
        _require(args, "MaxPositions", NOT_IMAGE_TEXT.replace("{command}", "embed --text"))
    if args.size:
        _check_size(args)
    from ..runtime.load import check_model_name

    check_model_name(args.model)
    out = prepare_output(args.out)  # before the work: a bad destination fails now, not after it
    size = {"Height": args.size, "Width": args.size} if args.size else {}
    model = _load(args, **size)
    skipped: list[tuple[str, str]] = []
    if args.text:
        _needs_text_model(model, "embed --text")
        features = encode_texts(model, args.text, _tokenizer(model), args.template).float().cpu()
        done, what = list(args.text), "texts"
    else:
        feats, done = [], []
        for batch, f in embed_images(model, paths, pool=args.pool, batch_size=args.batch_size,
                                     progress=not args.quiet, skipped=None if args.strict else skipped):
            feats.append(f)
            done += [str(p) for p in batch]
        _report_skipped("embed", skipped, len(paths))
        if not feats:
            raise _nothing_read(skipped)
        features, what = torch.cat(feats), "images"
    metadata = {what: json.dumps(done), "pool": args.pool, "model": model.loaded.name}
    if what == "images":
        metadata["skipped"] = json.dumps([{"path": p, "reason": r} for p, r in skipped])
    save_tensors({"features": features}, out, metadata=metadata)
    print(f"wrote {tuple(features.shape)} features of {len(done)} {what} to {out}"
          + (f" ({len(skipped)} skipped: see the file's 'skipped' metadata)" if skipped else ""))
    return 0


OLD_ZERO_SHOT = ('the labels now follow --labels: kestrel zero-shot IMAGE... --labels "a cat" "a dog" '
                 '(the old form, images then labels as positional arguments, is no longer accepted)')


def cmd_zero_shot(args: argparse.Namespace) -> int:
    from ..pipelines.tasks import preprocess_for
    from ..pipelines.zero_shot import zero_shot

    if not args.labels:
        missing = [i for i in args.images if not os.path.exists(i)]
        hint = f" ({_short(missing[0])} is not a file: is it a label?)" if missing else ""
        raise UsageError(f"missing --labels{hint}; {OLD_ZERO_SHOT}")
    empty = [k for k, label in enumerate(args.labels) if not label.strip()]
    if empty:
        raise UsageError(f"--labels: label {empty[0] + 1} is empty")
    from .datasets import is_dataset_out, run_dataset

    if is_dataset_out(args.out):
        return run_dataset(args, "zero-shot", args.images, labels=tuple(args.labels), template=args.template)
    try:
        images = _images(args.images)
    except UsageError as e:
        raise UsageError(f"{e}; labels go after --labels, e.g. {OLD_ZERO_SHOT.split(': ', 1)[1]}") from None
    _require(args, "MaxPositions", NOT_IMAGE_TEXT.replace("{command}", "zero-shot"))
    model = _load(args)
    _needs_text_model(model, "zero-shot")
    probs = zero_shot(model, images, args.labels, _tokenizer(model), preprocess_for(model), args.template)
    for path, row in zip(images, probs.float().tolist()):
        print(path)
        for p, text in sorted(zip(row, args.labels), reverse=True):
            print(f"  {p:7.2%}  {text}")
    return 0


def cmd_similarity(args: argparse.Namespace) -> int:
    from ..pipelines.tasks import preprocess_for
    from ..pipelines.zero_shot import similarity_table, zero_shot

    images = _images(args.images)
    _require(args, "MaxPositions", NOT_IMAGE_TEXT.replace("{command}", "similarity"))
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


def _common(p: argparse.ArgumentParser, default_model: str | None, batch: bool = True) -> None:
    p.add_argument("--model", default=default_model, required=default_model is None, metavar="NAME|DIR",
                   help="card name, hub id (org/name) or save_pretrained directory"
                        + (f" (default {default_model})" if default_model else ""))
    p.add_argument("--weights", metavar="DIR", type=types.existing_dir,
                   help="read the card's files from DIR instead of the hub")
    p.add_argument("--device", default="cpu", type=types.device, help="cpu (default), cuda, cuda:N or mps")
    p.add_argument("--dtype", default="f32", choices=["f32", "bf16", "f16"], help="compute dtype (default f32)")
    add_speed_args(p)
    if batch:
        p.add_argument("--batch-size", type=types.positive_int, default=8, metavar="N",
                       help="images per forward pass, >= 1 (default 8)")


def _strict(p: argparse.ArgumentParser) -> None:
    p.add_argument("--strict", action="store_true",
                   help="stop at the first unreadable image (default: skip it, say so, and go on)")


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("classify", help="label images with an image classifier",
                       description="Print the top labels (the checkpoint's id2label) with probabilities. "
                                   "Unreadable images are skipped and listed on stderr (see --strict).",
                       epilog="example: kestrel classify cat.jpg --top 3 --weights ./vit-base-patch16-224")
    p.add_argument("images", nargs="+", metavar="IMAGE", help="image files or folders")
    p.add_argument("--top", type=types.positive_int, default=5, metavar="K",
                   help="how many labels per image, >= 1 (default 5)")
    _strict(p)
    _common(p, "vit-base-patch16-224")
    p.set_defaults(run=cmd_classify)

    p = sub.add_parser("embed", help="image features to a safetensors file, or a dataset to Parquet shards",
                       description="Features of every image (class token, mean of patch tokens, or all patch "
                                   "tokens). With --out FILE.safetensors: one tensor, saved with the image paths in "
                                   "the file's metadata; unreadable images are skipped, listed on stderr and in the "
                                   "metadata ('skipped'); see --strict; the output is checked before any work and "
                                   "replaced atomically. With --out DIR: dataset mode (below).",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog=DATASET_HELP + "\nexamples:\n"
                              "  kestrel embed photos/ --model dinov2-base --out feats.safetensors\n"
                              "  kestrel embed photos/ --model dinov2-base --out feats/ --engine ray --workers 2\n"
                              "  kestrel embed index.parquet --model dinov2-base --out feats/ --engine ray "
                              "--address auto")
    p.add_argument("inputs", nargs="*", metavar="SOURCE",
                   help="image files or folders; in dataset mode also list files and .parquet/.csv tables")
    p.add_argument("--text", nargs="+", metavar="TEXT", help="embed these texts instead (SigLIP)")
    p.add_argument("--template", type=types.template, help="format each text with this template, e.g. 'a photo of {}.'")
    p.add_argument("--out", required=True, metavar="FILE|DIR", help="FILE.safetensors: one features tensor (parent "
                   "folders are created); DIR: Parquet shards (dataset mode)")
    p.add_argument("--pool", default="cls", choices=["cls", "mean", "patch"], help="which features (default cls)")
    p.add_argument("--size", type=types.positive_int, metavar="PIXELS",
                   help="run at this square image size (DINOv2: a multiple of the patch size)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    _strict(p)
    _common(p, None)
    add_dataset_args(p)
    p.set_defaults(run=cmd_embed)

    p = sub.add_parser("zero-shot", help="score free-text labels against images (SigLIP)",
                       description="Sigmoid probability that each label describes each image. SigLIP scores pairs "
                                   "independently, so an image's probabilities need not sum to one. With --out DIR: "
                                   "dataset mode (below), a scores column in label order and the best label.",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog=DATASET_HELP + '\nexamples:\n'
                              '  kestrel zero-shot cat.jpg dog.png --labels "a cat" "a dog" '
                              '--template "a photo of {}."\n'
                              '  kestrel zero-shot photos/ --labels cat dog --out scores/ --engine ray')
    p.add_argument("images", nargs="+", metavar="IMAGE",
                   help="image files or folders (dataset mode: also list files and .parquet/.csv tables)")
    p.add_argument("--labels", nargs="+", metavar="LABEL", help="the candidate labels (required)")
    p.add_argument("--template", type=types.template, help="format each label with this template (must contain {})")
    p.add_argument("--out", metavar="DIR", help="dataset mode: write Parquet shards to DIR")
    p.add_argument("--quiet", action="store_true", help="no progress bar (dataset mode)")
    _common(p, "siglip-base-patch16-224", batch=False)
    add_dataset_args(p, batch=True)
    p.set_defaults(run=cmd_zero_shot)

    p = sub.add_parser("similarity", help="a table of image x text scores (SigLIP)",
                       description="Logits (scaled cosine similarity plus bias) of every image against every text.",
                       epilog='example: kestrel similarity --images a.jpg b.jpg --texts "a cat" "a dog"')
    p.add_argument("--images", nargs="+", required=True, metavar="IMAGE", help="image files or folders")
    p.add_argument("--texts", nargs="+", required=True, metavar="TEXT", help="texts")
    p.add_argument("--template", type=types.template, help="format each text with this template (must contain {})")
    p.add_argument("--probabilities", action="store_true", help="print sigmoid probabilities instead of logits")
    _common(p, "siglip-base-patch16-224", batch=False)
    p.set_defaults(run=cmd_similarity)
