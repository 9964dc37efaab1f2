"""Dataset mode of ``embed``, ``zero-shot`` and ``segment --everything``: ``--out DIR`` writes Parquet shards."""

from __future__ import annotations

import argparse
import os

from ..errors import UsageError
from .options import Choice, Option, PositiveInt, Text, Threads

DATASET_HELP = """\
dataset mode: with --out DIR (a new or empty folder, or an earlier run's), SOURCE is a folder tree of
images, a list file (one path per line) or a .parquet/.csv table with a path column, and the output
is a folder of Parquet shards (one row per image: path, values, model, revision, height, width),
each written atomically, with manifest.json and a failures table of unreadable images. A rerun into
the same folder skips finished shards. --engine ray runs the shards on a Ray Data actor pool (on this
machine, or on the cluster at --address; pip install 'kestrel[ray]'); --engine local needs no Ray.
"""


DATASET_GROUP = "dataset mode (--out DIR)"


def dataset_options(batch: bool = False) -> list[Option]:
    """The options of dataset mode, in their own help group (``batch``: a --batch-size of its own too)."""
    g = DATASET_GROUP
    own = [Option("--batch-size", PositiveInt(4096), default=8, group=g, help="images per forward pass (default 8)")
           ] if batch else []
    return [
        *own,
        Option("--engine", Choice(choices=("local", "ray")), group=g,
               help="local: this process (default); ray: a Ray Data actor pool, one model per actor"),
        Option("--address", Text(what="address", metavar="ADDR"), group=g,
               help="join the Ray cluster at ADDR (e.g. ray://head:10001 or auto); without it Ray starts on this "
                    "machine for the run"),
        Option("--workers", PositiveInt(1024), group=g, help="Ray actors, 1 to 1024 (default: one per CPU)"),
        Option("--threads", Threads(), group=g,
               help="torch threads per worker (default: the CPUs shared out among the workers)"),
        Option("--shard-size", PositiveInt(10_000_000), default=1024, group=g,
               help="images per output shard (default 1024); batches never cross shards"),
        Option("--path-column", Text(what="column name", metavar="NAME"), default="path", group=g,
               help="the column of image paths in a .parquet/.csv SOURCE (default path)"),
    ]


def is_dataset_out(out: str | None) -> bool:
    """``--out DIR`` (dataset mode) rather than ``--out FILE.safetensors``.

    A path ending in ``.safetensors``, an existing non-folder, or an existing folder that is neither empty
    nor a dataset output (no ``manifest.json``) is a file destination, checked (and refused) as such.
    """
    from pathlib import Path

    if out is None or out.endswith(".safetensors"):
        return False
    path = Path(out)
    if not path.exists():
        return True
    return path.is_dir() and ((path / "manifest.json").is_file() or not any(path.iterdir()))


def run_dataset(args: argparse.Namespace, task: str, sources: list[str], **job: object) -> int:
    """Run ``task`` over ``sources`` into ``args.out`` with the engine flags of :func:`add_dataset_args`."""
    from ..pipelines.jobs import JobSpec
    from ..scale import run_job

    if not sources:
        raise UsageError(f"{task}: give a SOURCE: a folder of images, a list file, or a .parquet/.csv table")
    engine = args.engine or "local"
    if engine == "local" and (args.address or args.workers):
        raise UsageError("--address and --workers need --engine ray")
    spec = JobSpec(task, args.model, weights=args.weights, dtype=args.dtype, device=args.device,
                   compile=getattr(args, "compile", False), quantize=getattr(args, "quantize", None),
                   batch_size=getattr(args, "batch_size", None) or 8, **job)  # type: ignore[arg-type]
    summary = run_job(spec, sources, args.out, engine=engine, shard_size=args.shard_size,
                      path_column=args.path_column, workers=args.workers, address=args.address,
                      threads=args.threads, progress=not getattr(args, "quiet", False))
    done = summary.shards - summary.skipped
    skipped = f", {summary.skipped} already done" if summary.skipped else ""
    print(f"wrote {done} shard(s) of {summary.shards}{skipped}: {summary.rows} rows, {summary.failures} "
          f"unreadable image(s) to {os.fspath(summary.out)}")
    return 0
