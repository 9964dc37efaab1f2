"""Commands about programs: ``check``, ``inspect``, ``export``."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shutil
import sys
import traceback
from pathlib import Path

from ..blocks import Block
from ..blocks.block import REGISTRY
from ..checker.check import Report, check_program
from ..errors import KestrelError, UsageError
from ..inspect import format_parameters, format_program, program_json
from ..inspect.manifest import parameter_rows
from ..models import capabilities
from ..models.cards import CARDS, Card, CardError, family_for_config, find_card
from .options import (
    Choice,
    Command,
    GenericNames,
    Int,
    ModelRef,
    NewFile,
    Option,
    OutDir,
    PixelSize,
    PositiveInt,
    Text,
    register,
    weights_option,
)

EXPORT_TARGETS = ("executorch-webgpu", "executorch-portable", "executorch-xnnpack", "onnx")


def _card(name: str) -> Card:
    card = find_card(name)
    if card is None:
        raise CardError(f"unknown model {name!r}; known models: {', '.join(sorted(CARDS))}")
    return card


def _import_error(path: Path, e: BaseException) -> UsageError:
    """A one-line description of why a user's Python file could not be imported, with its line."""
    if isinstance(e, SyntaxError):
        where = f"{path}:{e.lineno}" if e.lineno else str(path)
        return UsageError(f"{where}: syntax error: {e.msg}")
    line = next((f.lineno for f in reversed(traceback.extract_tb(e.__traceback__))
                 if Path(f.filename).resolve() == path.resolve()), None)
    where = f"{path}:{line}" if line else str(path)
    return UsageError(f"{where}: importing it failed: {type(e).__name__}: {e}")


def _blocks_in_file(path: Path) -> list[type[Block]]:
    if not path.is_file():
        raise UsageError(f"no such file: {path}")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    if spec is None or spec.loader is None:
        raise UsageError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    before = {id(c) for blocks in REGISTRY.values() for c in blocks}  # a file of the same name seen earlier
    try:
        spec.loader.exec_module(module)
    except KestrelError:
        raise
    except (Exception, SystemExit) as e:  # the user's module: any error it raises is theirs
        sys.modules.pop(path.stem, None)
        raise _import_error(path, e) from e
    return [c for blocks in REGISTRY.values() for c in blocks
            if c.__module__ == module.__name__ and id(c) not in before]


def _targets(names: list[str]) -> list[tuple[str, type[Block]]]:
    """(label, root block) for each card name, or every block of a Python file or directory."""
    if not names:
        seen: dict[type[Block], list[str]] = {}
        for card in CARDS.values():
            seen.setdefault(card.family.root(card.config), []).append(card.name)
        return [(", ".join(labels), root) for root, labels in seen.items()]
    out: list[tuple[str, type[Block]]] = []
    for name in names:
        path = Path(name)
        if path.suffix == ".py" or path.is_dir():
            files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
            if not files:
                raise UsageError(f"{path} holds no Python files")
            found = [(f"{f}:{b.__name__}", b) for f in files for b in _blocks_in_file(f)]
            if not found:
                raise UsageError(f"{path} defines no blocks (classes deriving from kestrel.blocks.Block): "
                                 "nothing to check")
            out += found
        else:
            card = _card(name)
            out.append((card.name, card.family.root(card.config)))
    return out


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def cmd_check(args: argparse.Namespace) -> int:
    """type-check models without any weights

    Run every function of each model symbolically and prove its declared types. Exits 1 with diagnostics
    (file:line, both shapes, the missing where fact).
    """
    failed = 0
    for label, root in _targets(args.models):
        report: Report = check_program(root)
        status = "ok" if report.ok else f"{len(report.diagnostics)} error(s)"
        print(f"{label}: {root.decl().qualname}: {_count(len(report.blocks), 'block')}, "
              f"{_count(report.checked, 'function')} checked: {status}")
        for d in report.diagnostics:
            print("  " + d.format().replace("\n", "\n  "))
        failed += not report.ok
    return 1 if failed else 0


def _program(name: str) -> tuple[str, str, str, type[Block], dict]:
    """(label, title, source, root block, generics) of a card name, its hub id, or a save_pretrained directory."""
    card = find_card(name)
    if card is not None:
        return (card.name, f"{card.name}: {card.title}\n{card.repo} @ {card.revision}", card.repo,
                card.family.root(card.config), card.generics())
    path = Path(name)
    if path.is_dir():
        from ..runtime.load import read_config

        config = read_config(path)
        family = family_for_config(config, path)
        try:
            generics = {**family.generics(config), "T": "f32"}
        except (KeyError, TypeError, ValueError) as e:
            raise CardError(f"{path}/config.json does not describe a {family.name} model: {e}") from None
        return str(path), f"{path}: a {family.name} checkpoint", str(path), family.root(config), generics
    raise CardError(f"unknown model {name!r} (not a save_pretrained directory either); known models: "
                    f"{', '.join(sorted(CARDS))}")


def _parameter_count(root: type[Block], generics: dict) -> int:
    return sum(math.prod(row["shape"]) for row in parameter_rows(root, generics))


def cmd_summary() -> int:
    """One line per model: whether it type-checks, its parameter count, its entries."""
    rows, reports = [], {}
    for card in CARDS.values():
        root = card.family.root(card.config)
        if root not in reports:
            reports[root] = check_program(root)
        report = reports[root]
        entries = ", ".join(fn.name for fn in root.decl().entries)
        rows.append((card.name, "ok" if report.ok else f"{len(report.diagnostics)} error(s)",
                     f"{_parameter_count(root, card.generics()):,}", entries))
    head = ("model", "checked", "parameters", "entries")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(3)]
    for r in [head, *rows]:
        print(f"{r[0].ljust(widths[0])}  {r[1].ljust(widths[1])}  {r[2].rjust(widths[2])}  {r[3]}")
    failed = any(not rep.ok for rep in reports.values())
    print("\nfull listing: kestrel inspect --all (or kestrel inspect MODEL); parameter paths: --parameters"
          + ("\ndiagnostics: kestrel check" if failed else ""))
    return 1 if failed else 0


def cmd_inspect(args: argparse.Namespace) -> int:
    """print a model's architecture as blocks

    Print the entries, the generics as the checkpoint binds them, and every block of the program,
    derived from the declarations. Without a model: one line per model (checked, parameters, entries).
    """
    from ..inspect.exported import inspect_exported, is_export_file

    if args.model and is_export_file(args.model):  # an exported .onnx/.pte or an export's manifest.json
        print(inspect_exported(args.model, as_json=args.json))
        return 0
    if args.all and args.model:
        raise UsageError("give a model or --all, not both")
    if not args.all and not args.model:
        if args.parameters or args.json:
            raise UsageError("name a model (or --all) for --parameters or --json; known models: "
                             + ", ".join(sorted(CARDS)))
        return cmd_summary()
    names = sorted(CARDS) if args.all else [args.model]
    docs = []
    for i, name in enumerate(names):
        label, title, source, root, generics = _program(name)
        if args.json:
            docs.append(program_json(root, generics, label))
            continue
        if i:
            print("\n" + "=" * 100 + "\n")
        if args.parameters:
            print(f"{label}: parameters of {root.decl().qualname} as {source} binds them\n")
            print(format_parameters(root, generics))
            continue
        print(format_program(root, generics, title))
    if args.json:
        print(json.dumps(docs if args.all else docs[0], indent=2))
    return 0


def cmd_diagram(args: argparse.Namespace) -> int:
    """draw an entry's graph with every edge's inferred type

    Draw the entry's typed graph, laid out by Graphviz: sub-block calls expanded as labelled groups
    (--expand levels), untyped helpers grouped under their name, loops over layers drawn once; every
    edge is labelled with the type the checker inferred, in the model's own generics.
    """
    from ..inspect.diagram import entry_diagram, write_diagram
    from ..runtime.output import prepare_output

    card = _card(args.model)
    root = card.family.root(card.config)
    entry = args.entry or root.decl().entries[0].name
    out = prepare_output(args.output or f"{card.name}.{entry}.svg")
    write_diagram(entry_diagram(root, entry, expand=args.expand), out, theme=args.theme)
    print(f"wrote {out}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """export deployable programs (ExecuTorch, ONNX)

    Write one program per entry (SAM 2.1: the encoder/decoder split of seed 002), the prompt tables,
    manifest.json (shapes, sha256, op counts read back from the programs) and validation.json (the
    programs run on this CPU against Kestrel eager and, for SAM 2.1, transformers). A failed export
    leaves no new --out folder.
    """
    from ..runtime.load import check_model_name
    from ..runtime.output import prepare_output_dir
    from .tasks import check_size

    check_model_name(args.model)
    if args.size is not None:
        check_size(args.model, args.weights, args.size)  # the rule embed, segment and serve apply
    created = not os.path.lexists(args.out)
    out = prepare_output_dir(args.out)  # before the work
    try:
        return _export(args, out)
    except BaseException:
        if created:  # a failed export leaves no new folder behind (an existing one keeps what it had)
            shutil.rmtree(out, ignore_errors=True)
        raise


def _export(args: argparse.Namespace, out: Path) -> int:
    from ..export.edge import export_edge
    from ..runtime.load import load

    model = load(args.model, weights=args.weights, **_size_generics(args))
    if args.target == "onnx" and capabilities.of(model).recipe == "entries":
        from ..export.onnx import export_onnx

        for path in export_onnx(model, out, batch=args.batch, dynamic=args.dynamic, verify=not args.no_validate,
                                progress=lambda msg: print(msg, file=sys.stderr, flush=True)):
            print(path)
        return 0
    if args.dynamic is not None or args.batch is not None:
        split = capabilities.of(model).recipe != "entries"
        raise UsageError(f"--dynamic and --batch apply to plain ONNX exports; {args.target} programs "
                         f"{'of the SAM 2.1 split ' if split else ''}have fixed shapes (batch 1)")
    manifest = export_edge(model, out, args.target, validate=not args.no_validate,
                           progress=lambda msg: print(msg, file=sys.stderr, flush=True))
    for name, row in manifest["files"].items():
        print(f"{out / name}  {row['bytes']} bytes")
    print(out / "manifest.json")
    if not args.no_validate:
        summary = json.loads((out / "validation.json").read_text())["summary"]
        print(f"validation: {summary['cases']} cases, worst relative {summary['worst_relative']}, lowest mask IoU "
              f"{summary['lowest_mask_iou']}: {'passed' if summary['passed'] else 'FAILED'}")
        return 0 if summary["passed"] else 1
    return 0


def _size_generics(args: argparse.Namespace) -> dict[str, int]:
    """``--size N``: the generics that bind the input size (SAM 2's ``E = N / 16``, DINOv2's Height/Width)."""
    if args.size is None:
        return {}
    from ..models.cards import family_for_config
    from ..pipelines.input_rules import size_problem
    from ..runtime.load import read_config, resolve

    directory, _ = resolve(args.model, args.weights)
    config = read_config(directory)
    family = family_for_config(config, directory)
    try:
        generics = family.generics(config)
    except (KeyError, TypeError, ValueError):
        generics = {}
    problem = size_problem(family.name, family.resizable, generics, args.size, model=args.model)
    if problem is not None:
        raise CardError(problem)
    if "E" in family.resizable:
        return {"E": args.size // 16}
    return {"Height": args.size, "Width": args.size}


register(Command(
    "check", run=cmd_check,
    options=[Option("models", Text(what="model name or path", metavar="MODEL"), nargs="*",
                    help="card names (default: every model), or Python files/directories of your own blocks")]))

register(Command(
    "inspect", run=cmd_inspect, raw=True,
    epilog="examples:\n  kestrel inspect\n  kestrel inspect sam-vit-base --parameters\n"
           "  kestrel inspect ./my-dinov2-checkpoint\n  kestrel inspect --all\n"
           "  kestrel inspect out/decode_points.onnx   the signature an export carries",
    options=[Option("model", ModelRef(metavar="MODEL", exported=True), nargs="?",
                    help="a card name (sam-vit-base), its hub id, or a save_pretrained directory; an exported "
                         "FILE.onnx, FILE.pte or an export's manifest.json (the signatures they carry); "
                         "none: one summary line per model"),
             Option("--all", help="every known model"),
             Option("--parameters", help="every parameter path with its bound shape"),
             Option("--json", help="blocks, generics and parameters as JSON")]))

register(Command(
    "diagram", run=cmd_diagram, epilog="example: kestrel diagram sam-vit-base --entry encode_image -o preview.svg",
    options=[Option("model", Text(what="card name", metavar="MODEL"), help="a card name"),
             Option("--entry", Text(what="entry name", metavar="ENTRY"),
                    help="entry or function to draw (default: the first entry)"),
             Option("--expand", Int(0, 64, "a depth"), default=1,
                    help="expand sub-block calls as groups down to N levels, one node each below (default 1)"),
             Option("--theme", Choice(choices=("light", "dark")), default="light", help="colours (default light)"),
             Option("-o --output", NewFile(),
                    help="FILE.svg (default MODEL.ENTRY.svg), FILE.png, or FILE.dot (Graphviz source)")]))

register(Command(
    "export", run=cmd_export, raw=True,
    epilog="targets:\n"
           "  executorch-webgpu    WebGPUPartitioner programs + portable twins that validate here\n"
           "  executorch-portable  ExecuTorch portable kernels (no delegate)\n"
           "  executorch-xnnpack   XNNPACK-delegated programs, for CPUs\n"
           "  onnx                 ONNX (onnxruntime validates)\n"
           "ExecuTorch targets need the extra: pip install 'kestrel[edge]'\n\n"
           "example: kestrel export sam2.1-hiera-tiny --target executorch-webgpu --size 512 --out out/",
    options=[Option("model", ModelRef(metavar="MODEL"), help="card name or save_pretrained directory"),
             Option("--target", Choice(choices=EXPORT_TARGETS), default="onnx",
                    help="executorch-webgpu, executorch-portable, executorch-xnnpack or onnx (default)"),
             Option("--out", OutDir(), required=True, help="output directory"),
             weights_option(help="read the card's weights from this directory"),
             Option("--size", PixelSize(),
                    help="input image size to bind (SAM 2.1: a multiple of 32, 512 or 1024; ViT/DINOv2: a "
                         "multiple of the patch size)"),
             Option("--batch", PositiveInt(4096),
                    help="fix the batch B of plain ONNX exports at N, 1 to 4096 (default: B stays dynamic)"),
             Option("--dynamic", GenericNames(),
                    help="the entry generics that stay dynamic axes in ONNX exports, named after them (default: "
                         "each entry's own, its batch and prompt counts; 'none' fixes all, at 1 or --batch)"),
             Option("--no-validate", help="skip validation.json (no programs are run)")]))
