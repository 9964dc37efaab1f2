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
from .datasets import DATASET_HELP, dataset_options
from .options import (
    PATH_LIMIT,
    Choice,
    Command,
    Device,
    ImagePath,
    ModelRef,
    NewFileOrDir,
    Option,
    OutDir,
    PixelSize,
    PositiveInt,
    Template,
    Text,
    register,
    shown,
    weights_option,
)

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff"}


def _load(args: argparse.Namespace, **generics: int):
    from ..runtime.load import load

    return load(args.model, weights=args.weights, dtype=args.dtype, device=args.device,
                compile=getattr(args, "compile", False), quantize=getattr(args, "quantize", None), **generics)


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
    """``--size`` must be a size the model can take (:func:`check_size`)."""
    check_size(args.model, args.weights, args.size)


def check_size(model: str, weights: str | None, size: int) -> None:
    """Refuse ``--size`` when the model cannot run at it, by :func:`kestrel.pipelines.input_rules.size_problem`:
    the one rule of ``embed``, ``export``, ``segment`` and ``serve`` (read from config.json, before loading)."""
    from ..pipelines.input_rules import size_problem
    from ..runtime.load import peek

    seen = peek(model, weights)
    if seen is None:
        return  # a hub model not in the cache: load binds the size and the checker refuses what does not fit
    family, config = seen
    try:
        generics = family.generics(config)
    except (KeyError, TypeError, ValueError):
        return  # load names the problem with the config
    problem = size_problem(family.name, family.resizable, generics, size, model=model)
    if problem is not None:
        raise UsageError(problem)


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


def _images(items: list[str], strict: bool = False) -> list[Path]:
    """The image files named by ``items`` (folders expanded). Files named one by one have their header
    read now, before any model loads: with ``strict`` the first unreadable one is refused, and when none
    can be read the command stops here, naming the first."""
    from ..pipelines.images import ImageError, check_image_header
    from ..pipelines.readers import ReadError

    paths = expand_paths(items)
    missing = [p for p in paths if not os.path.exists(p)]
    if missing:
        raise UsageError(f"no such image file or folder: {shown(missing[0], 160)}"
                         + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    if not paths:
        raise UsageError(f"no image files (*{', *'.join(sorted(IMAGE_SUFFIXES))}) in "
                         f"{', '.join(shown(i, PATH_LIMIT) for i in items)}")
    named = {os.fspath(Path(i)) for i in items if not os.path.isdir(i)}
    bad: list[ImageError | ReadError] = []
    for p in paths:
        if os.fspath(p) in named:
            try:
                check_image_header(p)
            except ImageError as e:
                if strict:
                    raise
                bad.append(e)
    if bad and len(bad) == len(paths):
        raise UsageError(f"none of the {len(paths)} input image(s) can be read; the first: {bad[0]}")
    return paths


NOT_A_CLASSIFIER = ("classify needs an image classifier (a checkpoint with a classification head and id2label, "
                    "e.g. vit-base-patch16-224); {model} is a {family} model without one: try `kestrel embed` for "
                    "its features")
NOT_IMAGE_TEXT = ("{command} needs an image-text model such as siglip-base-patch16-224; {model} is a {family} "
                  "model with no text tower")


def cmd_classify(args: argparse.Namespace) -> int:
    """label images with an image classifier

    Print the top labels (the checkpoint's id2label) with probabilities. Unreadable images are skipped
    and listed on stderr (see --strict).
    """
    from ..pipelines.tasks import classify

    paths = _images(args.images, strict=args.strict)
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
    """image features to a safetensors file, or a dataset to Parquet shards

    Features of every image (class token, mean of patch tokens, or all patch tokens). With --out
    FILE.safetensors: one tensor, saved with the image paths in the file's metadata; unreadable images
    are skipped, listed on stderr and in the metadata ('skipped'); see --strict; the output is checked
    before any work and replaced atomically. With --out DIR: dataset mode (below).
    """
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
    paths = [] if args.text else _images(args.inputs, strict=args.strict)
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
    """score free-text labels against images (SigLIP)

    Sigmoid probability that each label describes each image. SigLIP scores pairs independently, so an
    image's probabilities need not sum to one. With --out DIR: dataset mode (below), a scores column in
    label order and the best label.
    """
    from ..pipelines.tasks import preprocess_for
    from ..pipelines.zero_shot import zero_shot

    if not args.labels:
        missing = [i for i in args.images if not os.path.exists(i)]
        hint = f" ({shown(missing[0])} is not a file: is it a label?)" if missing else ""
        raise UsageError(f"missing --labels{hint}; {OLD_ZERO_SHOT}")
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
    """a table of image x text scores (SigLIP)

    Logits (scaled cosine similarity plus bias) of every image against every text.
    """
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


def model_options(default_model: str | None, batch: bool = True) -> list[Option]:
    """``--model``, ``--weights``, ``--device``, ``--dtype``, the speed options and (``batch``) ``--batch-size``."""
    out = [
        Option("--model", ModelRef(), default=default_model, required=default_model is None,
               help="card name, hub id (org/name) or save_pretrained directory"
                    + (f" (default {default_model})" if default_model else "")),
        weights_option(),
        Option("--device", Device(), default="cpu", help="cpu (default), cuda, cuda:N or mps"),
        Option("--dtype", Choice(choices=("f32", "bf16", "f16")), default="f32", help="compute dtype (default f32)"),
        *speed_options(),
    ]
    if batch:
        out.append(Option("--batch-size", PositiveInt(4096), default=8,
                          help="images per forward pass, 1 to 4096 (default 8)"))
    return out


def speed_options() -> list[Option]:
    """``--compile`` and ``--quantize``: the speed options of ``kestrel.load`` (README, Speed)."""
    return [
        Option("--compile", help="run the model under torch.compile (static shapes, inductor freezing): the first "
                                 "call compiles (tens of seconds); pays on large inputs, see `kestrel bench DIR "
                                 "--compile`"),
        Option("--quantize", Choice(choices=("int8",)),
               help="int8 dynamic quantisation of every linear layer (opt-in, not exact: README has its "
                    "accuracy against f32)"),
    ]


STRICT = Option("--strict", help="stop at the first unreadable image (default: skip it, say so, and go on)")
QUIET = Option("--quiet", help="no progress bar")
IMAGES = Option("images", ImagePath(), nargs="+",
                help="image files or folders")

register(Command(
    "classify", run=cmd_classify, epilog="example: kestrel classify cat.jpg --top 3 --weights ./vit-base-patch16-224",
    options=[IMAGES,
             Option("--top", PositiveInt(metavar="K"), default=5, help="how many labels per image, >= 1 (default 5)"),
             STRICT, *model_options("vit-base-patch16-224")]))

register(Command(
    "embed", run=cmd_embed, raw=True,
    epilog=DATASET_HELP + "\nexamples:\n"
           "  kestrel embed photos/ --model dinov2-base --out feats.safetensors\n"
           "  kestrel embed photos/ --model dinov2-base --out feats/ --engine ray --workers 2\n"
           "  kestrel embed index.parquet --model dinov2-base --out feats/ --engine ray --address auto",
    options=[
        Option("inputs", ImagePath(expect="an image file or folder; in dataset mode a list file or table too",
                                   metavar="SOURCE"), nargs="*",
               help="image files or folders; in dataset mode also list files and .parquet/.csv tables"),
        Option("--text", Text(what="text"), nargs="+", help="embed these texts instead (SigLIP)"),
        Option("--template", Template(), help="format each text with this template, e.g. 'a photo of {}.'"),
        Option("--out", NewFileOrDir(), required=True,
               help="FILE.safetensors: one features tensor (parent folders are created); DIR: Parquet shards "
                    "(dataset mode)"),
        Option("--pool", Choice(choices=("cls", "mean", "patch")), default="cls", help="which features (default cls)"),
        Option("--size", PixelSize(), help="run at this square image size (DINOv2: a multiple of the patch size)"),
        QUIET, STRICT, *model_options(None), *dataset_options()]))

register(Command(
    "zero-shot", run=cmd_zero_shot, raw=True,
    epilog=DATASET_HELP + '\nexamples:\n'
           '  kestrel zero-shot cat.jpg dog.png --labels "a cat" "a dog" --template "a photo of {}."\n'
           '  kestrel zero-shot photos/ --labels cat dog --out scores/ --engine ray',
    options=[
        Option("images", ImagePath(), nargs="+",
               help="image files or folders (dataset mode: also list files and .parquet/.csv tables)"),
        Option("--labels", Text(what="label", metavar="LABEL"), nargs="+", help="the candidate labels (required)"),
        Option("--template", Template(), help="format each label with this template (must contain {})"),
        Option("--out", OutDir(), help="dataset mode: write Parquet shards to DIR"),
        Option("--quiet", help="no progress bar (dataset mode)"),
        *model_options("siglip-base-patch16-224", batch=False), *dataset_options(batch=True)]))

register(Command(
    "similarity", run=cmd_similarity, epilog='example: kestrel similarity --images a.jpg b.jpg --texts "a cat" "a dog"',
    options=[
        Option("--images", ImagePath(), nargs="+", required=True,
               help="image files or folders"),
        Option("--texts", Text(what="text"), nargs="+", required=True, help="texts"),
        Option("--template", Template(), help="format each text with this template (must contain {})"),
        Option("--probabilities", help="print sigmoid probabilities instead of logits"),
        *model_options("siglip-base-patch16-224", batch=False)]))
