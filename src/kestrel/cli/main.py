"""The ``kestrel`` command."""

from __future__ import annotations

import argparse
import sys

from . import models, serve, tasks

EPILOG = """examples:
  kestrel check                                  type-check every model, no weights needed
  kestrel inspect sam-vit-base                   the blocks, as the seeds print them
  kestrel inspect dinov2-base --parameters       every parameter path with its bound shape
  kestrel diagram vit-base-patch16-224 -o vit.svg   the forward graph, every edge typed
  kestrel classify cat.jpg --weights DIR         ViT-B/16 top-5 labels
  kestrel embed photos/ --model dinov2-base --out feats.safetensors
  kestrel export vit-base-patch16-224 --target onnx --out out/
  kestrel export sam2.1-hiera-tiny --target executorch-webgpu --size 512 --out out/
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kestrel", description="Vision foundation models as typed, shape-checked programs.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"kestrel {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    models.add_parsers(sub)
    tasks.add_parsers(sub)
    serve.add_parsers(sub)
    return parser


def _version() -> str:
    from .. import __version__

    return __version__


def _user_errors() -> tuple[type[BaseException], ...]:
    """Errors that describe bad input: printed as one clear line, never as a traceback."""
    from ..blocks import BindError, DeclarationError, EntryError
    from ..inspect.diagram import DiagramError
    from ..models.cards import CardError
    from ..pipelines.images import ImageError
    from ..runtime.checkpoint import CheckpointError
    from ..runtime.hub import HubError
    from ..shapes.parse import DimParseError

    errors: list[type[BaseException]] = [BindError, CardError, CheckpointError, DeclarationError, DiagramError,
                                         DimParseError,
                                         EntryError, HubError, ImageError, FileNotFoundError]
    try:
        from ..pipelines.tokenizer import TokenizerError

        errors.append(TokenizerError)
    except ImportError:  # pragma: no cover
        pass
    try:
        from ..export.onnx import ExportError

        errors.append(ExportError)
        from ..web.server import ServeError

        errors.append(ServeError)
    except ImportError:
        pass
    from ..export.executorch import ExecuTorchError

    errors.append(ExecuTorchError)
    return tuple(errors)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "run", None):
        parser.print_help()
        return 0
    try:
        return int(args.run(args) or 0)
    except _user_errors() as e:
        print(f"kestrel {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader went away (`kestrel inspect ... | head`): stop quietly
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
