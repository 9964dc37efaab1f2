"""The ``kestrel`` command.

One error style for every command: a user's mistake (any :class:`~kestrel.errors.KestrelError`, a missing
or unreadable file, a bad flag) prints ``kestrel COMMAND: error: MESSAGE`` on stderr and exits 2, without a
traceback; ``--debug`` or ``KESTREL_DEBUG=1`` re-raises it with the traceback. Anything else is a bug in
Kestrel: one line saying so, exit 3 (the traceback again with ``--debug``).
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

from ..errors import EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, KestrelError, KestrelWarning
from ..kernels import settings
from .commands import all_commands
from .options import PATH_LIMIT, REGISTRY, add_command, shown

EPILOG = """examples:
  kestrel check                                  type-check every model, no weights needed
  kestrel inspect                                one line per model: checked, parameters, entries
  kestrel inspect sam-vit-base                   the blocks, as the seeds print them
  kestrel inspect dinov2-base --parameters       every parameter path with its bound shape
  kestrel diagram vit-base-patch16-224 -o vit.svg   the forward graph, every edge typed
  kestrel classify cat.jpg --weights DIR         ViT-B/16 top-5 labels
  kestrel embed photos/ --model dinov2-base --out feats.safetensors
  kestrel zero-shot cat.jpg --labels "a cat" "a dog"
  kestrel export vit-base-patch16-224 --target onnx --out out/
  kestrel embed photos/ --model dinov2-base --out feats/ --engine ray   a dataset, Parquet shards on Ray
  kestrel site --serve                           the registry site at http://127.0.0.1:8000/
  kestrel export sam2.1-hiera-tiny --target executorch-webgpu --size 512 --out out/
  kestrel segment photo.jpg --point 500,375      SAM mask PNG + overlay (--everything: every object)
  kestrel track clip.mp4 --model sam2.1-hiera-tiny --point 0:210,350 --out out/   masks on every frame
  kestrel doctor                                 GEMM rates here and the kernel chosen per shape
  kestrel bench DIR --batch 1,8                  time a model on this machine

exit status:
  0  success
  1  a check failed (kestrel check found type errors)
  2  usage or input error: a bad flag, model name, file, image, checkpoint or output path
  3  internal error, a bug in Kestrel: rerun with --debug for the traceback
  130 interrupted

environment:
  KESTREL_DEBUG=1    show the Python traceback of any error (same as --debug)
  HF_HUB_OFFLINE=1   never contact the Hugging Face Hub; use the cache or --weights DIR
"""

DEBUG_HELP = "show the Python traceback of an error (or set KESTREL_DEBUG=1)"


class Parser(argparse.ArgumentParser):
    """argparse with Kestrel's error style: the error on the first line, then the usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n{self.format_usage()}"
                              f"run '{self.prog} --help' for more\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="kestrel", description="Vision foundation models as typed, shape-checked programs.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"kestrel {_version()}")
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    parser.commands = {}  # type: ignore[attr-defined]
    for command in all_commands():  # every command is declared through kestrel.cli.options
        p = add_command(sub, command)
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)
        parser.commands[command.name] = p  # type: ignore[attr-defined]
    return parser


def _version() -> str:
    from .. import __version__

    return __version__


def _debug(args: argparse.Namespace | None) -> bool:
    flag = settings.debug()
    return flag or bool(getattr(args, "debug", False))


def _describe_os_error(e: OSError) -> str:
    where = shown(e.filename, PATH_LIMIT).strip("'\"") if e.filename is not None else ""
    reason = e.strerror or str(e)
    return f"{where}: {reason}" if where else reason


def _printable_streams() -> None:
    """A file name that is not UTF-8 prints as ``caf\\xe9.png`` instead of failing the command."""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            try:
                reconfigure(errors="backslashreplace")
            except (ValueError, OSError):
                pass


@contextmanager
def _one_line_warnings(prog: str) -> Iterator[None]:
    """Kestrel's own warnings print as ``kestrel COMMAND: warning: ...``, without Python's file and line."""
    shown_before = warnings.showwarning

    def show(message: Warning | str, category: type[Warning], *rest: Any, **kw: Any) -> None:
        if issubclass(category, KestrelWarning):
            print(f"{prog}: warning: {message}", file=sys.stderr)
        else:
            shown_before(message, category, *rest, **kw)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = shown_before


@contextmanager
def _measuring_note(prog: str, args: argparse.Namespace) -> Iterator[None]:
    """A first run on a new CPU, model or batch size measures the kernels for each new shape (seconds apiece,
    once): a line on stderr says so before the first, and one how many when the command ends, rather than a
    silent wait. Not for ``kestrel doctor``, which prints every measurement, nor under ``--quiet``."""
    if args.command == "doctor" or getattr(args, "quiet", False):
        yield
        return
    from ..kernels import calibration

    def first() -> None:
        print(f"{prog}: measuring this CPU's kernels for shapes it has not run before (once; kept in "
              f"{calibration.cache_dir()}; KESTREL_CALIBRATE=0 skips) ...", file=sys.stderr, flush=True)

    with calibration.watching(first) as watch:
        yield
    if watch.shapes:
        print(f"{prog}: measured {watch.shapes} new shape(s); later runs reuse the choices", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``) and return the exit status."""
    _printable_streams()
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    command = REGISTRY.get(getattr(args, "command", None) or "")
    sub = parser.commands.get(command.name, parser) if command else parser  # type: ignore[attr-defined]
    if extra:  # reported by the command's own parser: `kestrel CMD: error: ...`
        sub.error(f"unrecognized arguments: {' '.join(shown(a) for a in extra)}")
    if command is not None:
        for option in command.options:  # argparse lets `--flag=--` through as an unparsed []
            dest = option.dest or (option.name if option.positional else option.flags[-1].lstrip("-")).replace("-", "_")
            if option.nargs is None and option.action is None and getattr(args, dest, None) == []:
                sub.error(f"argument {option.label}: expected {option.kind.expect if option.kind else 'no value'}, "
                          "got '--'")
    if not getattr(args, "run", None):
        parser.print_help()
        return EXIT_OK
    prog = f"kestrel {args.command}"
    try:
        settings.validate()  # a setting a kernel reads minutes in is refused now, before anything is measured or said
        with _one_line_warnings(prog), _measuring_note(prog, args):
            return int(args.run(args) or 0)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # the reader went away (`kestrel inspect ... | head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except KestrelError as e:
        if _debug(args):
            raise
        print(f"{prog}: error: {e}", file=sys.stderr)
        return e.exit_code
    except OSError as e:  # a path the user gave: missing, unreadable, a folder, no space...
        if _debug(args):
            raise
        print(f"{prog}: error: {_describe_os_error(e)}", file=sys.stderr)
        return EXIT_USAGE
    except MemoryError:
        if _debug(args):
            raise
        print(f"{prog}: error: out of memory; try a smaller --batch-size or smaller images", file=sys.stderr)
        return EXIT_USAGE
    except Exception as e:
        if _debug(args):
            raise
        first = (str(e).strip().splitlines() or [""])[0]
        print(f"{prog}: internal error: {type(e).__name__}: {first}\n"
              "this is a bug in Kestrel; rerun with --debug (or KESTREL_DEBUG=1) for the traceback",
              file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
