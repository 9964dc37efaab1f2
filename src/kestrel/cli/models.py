"""Commands about programs: ``check``, ``inspect``, ``export``."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

from ..blocks import Block
from ..blocks.block import REGISTRY
from ..checker.check import Report, check_program
from ..inspect import format_parameters, format_program, program_json
from ..models.cards import CARDS, Card, CardError


def _card(name: str) -> Card:
    if name not in CARDS:
        raise CardError(f"unknown model {name!r}; known models: {', '.join(sorted(CARDS))}")
    return CARDS[name]


def _blocks_in_file(path: Path) -> list[type[Block]]:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    if spec is None or spec.loader is None:
        raise CardError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return [c for blocks in REGISTRY.values() for c in blocks if c.__module__ == module.__name__]


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
            for f in files:
                out += [(f"{f}:{b.__name__}", b) for b in _blocks_in_file(f)]
        else:
            card = _card(name)
            out.append((card.name, card.family.root(card.config)))
    return out


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def cmd_check(args: argparse.Namespace) -> int:
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


def cmd_inspect(args: argparse.Namespace) -> int:
    names = sorted(CARDS) if args.all else [args.model]
    if not names or names == [None]:
        raise CardError("name a model (or --all); known models: " + ", ".join(sorted(CARDS)))
    docs = []
    for i, name in enumerate(names):
        card = _card(name)
        root = card.family.root(card.config)
        generics = card.generics()
        if args.json:
            docs.append(program_json(root, generics, card.name))
            continue
        if i:
            print("\n" + "=" * 100 + "\n")
        if args.parameters:
            print(f"{card.name}: parameters of {root.decl().qualname} as {card.repo} binds them\n")
            print(format_parameters(root, generics))
            continue
        title = f"{card.name}: {card.title}\n{card.repo} @ {card.revision}"
        print(format_program(root, generics, title))
    if args.json:
        print(json.dumps(docs if args.all else docs[0], indent=2))
    return 0


def cmd_diagram(args: argparse.Namespace) -> int:
    from ..inspect.diagram import entry_diagram, write_diagram

    card = _card(args.model)
    root = card.family.root(card.config)
    entry = args.entry or root.decl().entries[0].name
    out = Path(args.output or f"{card.name}.{entry}.svg")
    write_diagram(entry_diagram(root, entry), out)
    print(f"wrote {out}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from ..runtime.load import load

    model = load(args.model, weights=args.weights, **_size_generics(args))
    if args.target == "onnx" and not _is_edge_split(model):
        from ..export.onnx import export_onnx

        for path in export_onnx(model, Path(args.out), batch=args.batch):
            print(path)
        return 0
    from ..export.edge import TARGETS, export_edge

    if args.target not in TARGETS:
        raise CardError(f"unknown export target {args.target!r}; expected one of {', '.join(TARGETS)}")
    manifest = export_edge(model, Path(args.out), args.target, validate=not args.no_validate,
                           progress=lambda msg: print(msg, file=sys.stderr, flush=True))
    for name, row in manifest["files"].items():
        print(f"{Path(args.out) / name}  {row['bytes']} bytes")
    print(Path(args.out) / "manifest.json")
    if not args.no_validate:
        summary = json.loads((Path(args.out) / "validation.json").read_text())["summary"]
        print(f"validation: {summary['cases']} cases, worst relative {summary['worst_relative']}, lowest mask IoU "
              f"{summary['lowest_mask_iou']}: {'passed' if summary['passed'] else 'FAILED'}")
        return 0 if summary["passed"] else 1
    return 0


def _size_generics(args: argparse.Namespace) -> dict[str, int]:
    """``--size N``: the generics that bind the input size (SAM 2's ``E = N / 16``, DINOv2's Height/Width)."""
    if args.size is None:
        return {}
    from ..models.cards import family_for_config
    from ..runtime.load import read_config, resolve

    directory, _ = resolve(args.model, args.weights)
    family = family_for_config(read_config(directory), directory)
    if "E" in family.resizable:
        if args.size % 32:
            raise CardError(f"--size {args.size}: {family.name} needs a multiple of 32")
        return {"E": args.size // 16}
    if {"Height", "Width"} <= set(family.resizable):
        return {"Height": args.size, "Width": args.size}
    raise CardError(f"--size: {family.name} is bound at its checkpoint's image size (it cannot be rebound)")


def _is_edge_split(model: object) -> bool:
    from ..export.edge_sam2 import is_sam2

    return is_sam2(model)


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("check", help="type-check models without any weights",
                       description="Run every function of each model symbolically and prove its declared types. "
                                   "Exits 1 with diagnostics (file:line, both shapes, the missing where fact).")
    p.add_argument("models", nargs="*", metavar="MODEL",
                   help="card names (default: every model), or Python files/directories of your own blocks")
    p.set_defaults(run=cmd_check)

    p = sub.add_parser("inspect", help="print a model's architecture as blocks",
                       description="Print the entries, the generics as the checkpoint binds them, and every block "
                                   "of the program, derived from the declarations.")
    p.add_argument("model", nargs="?", metavar="MODEL", help="a card name, e.g. sam-vit-base")
    p.add_argument("--all", action="store_true", help="every known model")
    p.add_argument("--parameters", action="store_true", help="every parameter path with its bound shape")
    p.add_argument("--json", action="store_true", help="blocks, generics and parameters as JSON")
    p.set_defaults(run=cmd_inspect)

    p = sub.add_parser("diagram", help="draw an entry's graph with every edge's inferred type",
                       description="Draw the entry with one level of sub-block calls expanded; every edge is "
                                   "labelled with the type the checker inferred, in the model's own generics.",
                       epilog="example: kestrel diagram sam-vit-base --entry encode_image -o preview.svg")
    p.add_argument("model", metavar="MODEL", help="a card name")
    p.add_argument("--entry", help="entry or function to draw (default: the first entry)")
    p.add_argument("-o", "--output", metavar="FILE", help="FILE.svg (default) or FILE.dot for Graphviz")
    p.set_defaults(run=cmd_diagram)

    p = sub.add_parser("export", help="export deployable programs (ExecuTorch, ONNX)",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Write one program per entry (SAM 2.1: the encoder/decoder split of seed 002), "
                                   "the prompt tables, manifest.json (shapes, sha256, op counts read back from the "
                                   "programs) and validation.json (the programs run on this CPU against Kestrel "
                                   "eager and, for SAM 2.1, transformers).",
                       epilog="targets:\n"
                              "  executorch-webgpu    WebGPUPartitioner programs + portable twins that validate here\n"
                              "  executorch-portable  ExecuTorch portable kernels (no delegate)\n"
                              "  executorch-xnnpack   XNNPACK-delegated programs, for CPUs\n"
                              "  onnx                 ONNX (onnxruntime validates)\n"
                              "ExecuTorch targets need the extra: pip install 'kestrel[edge]'\n\n"
                              "example: kestrel export sam2.1-hiera-tiny --target executorch-webgpu --size 512 "
                              "--out out/")
    p.add_argument("model", metavar="MODEL", help="card name or save_pretrained directory")
    p.add_argument("--target", default="onnx", metavar="TARGET",
                   help="executorch-webgpu, executorch-portable, executorch-xnnpack or onnx (default)")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory")
    p.add_argument("--weights", metavar="DIR", help="read the card's weights from this directory")
    p.add_argument("--size", type=int, metavar="PX", help="input image size to bind (SAM 2.1: 512 or 1024)")
    p.add_argument("--batch", type=int, default=1, help="batch size of plain ONNX exports (default 1)")
    p.add_argument("--no-validate", action="store_true", help="skip validation.json (no programs are run)")
    p.set_defaults(run=cmd_export)
