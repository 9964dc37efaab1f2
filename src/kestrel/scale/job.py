"""``run_job``: a dataset job from source to output folder, on the local or the Ray engine."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..pipelines.datasets import Shard, fingerprint, plan_shards, read_source
from ..pipelines.jobs import JobSpec, ShardResult, resolve_revision
from .output import DatasetOutput

ENGINES = ("local", "ray")
DEFAULT_SHARD_SIZE = 1024


@dataclass
class JobSummary:
    """What a run did: shards in all, shards skipped as already done, rows and failures written."""

    out: Path
    shards: int
    skipped: int
    rows: int
    failures: int
    manifest: dict[str, Any]


def run_job(spec: JobSpec, sources: str | Path | Sequence[str | Path], out: str | Path, *, engine: str = "local",
            shard_size: int = DEFAULT_SHARD_SIZE, path_column: str = "path", workers: int | None = None,
            address: str | None = None, threads: int | None = None, progress: bool = True,
            on_shard: Callable[[Shard, ShardResult], None] | None = None) -> JobSummary:
    """Run ``spec`` over the images of ``sources`` into the folder ``out`` (see :mod:`kestrel.scale.output`).

    ``engine="local"`` runs in this process; ``"ray"`` on a Ray Data actor pool of ``workers`` actors
    (default: one per CPU), each with ``threads`` torch threads (default: the CPUs shared out), on the
    cluster at ``address`` or on a Ray started on this machine for the run. Shards already in ``out``
    are skipped; ``on_shard`` is called after each shard is written.
    """

    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}")
    paths = read_source(sources, path_column)
    shards = plan_shards(paths, shard_size)
    if spec.revision is None:
        spec = resolve_revision(spec)
    output = DatasetOutput(out, spec, shards, fingerprint(paths), shard_size)
    todo = output.open()
    try:
        manifest = _run(spec, engine, output, shards, todo, len(paths), workers, address, threads, progress,
                        on_shard)
    except BaseException:
        output.discard_if_new()  # a failed first run leaves no folder behind (a resumable one stays)
        raise
    return JobSummary(Path(out), len(shards), len(shards) - len(todo), manifest["rows"], manifest["failures"],
                      manifest)


def _run(spec: JobSpec, engine: str, output: DatasetOutput, shards: list[Shard], todo: list[Shard], images: int,
         workers: int | None, address: str | None, threads: int | None, progress: bool,
         on_shard: Callable[[Shard, ShardResult], None] | None) -> dict:
    from tqdm import tqdm

    if engine == "local":
        from .local import run_local

        results = run_local(spec, todo, threads)
    else:
        from .ray_engine import run_ray

        results = run_ray(spec, todo, workers=workers, address=address, threads=threads)
    done_images = sum(len(s.paths) for s in shards) - sum(len(s.paths) for s in todo)
    bar = tqdm(total=images, initial=done_images, unit="img", desc=f"{spec.task} ({engine})", disable=not progress)
    try:
        for shard, result in results:
            output.write(shard, result)
            bar.update(len(shard.paths))
            if on_shard is not None:
                on_shard(shard, result)
    finally:
        bar.close()
        if hasattr(results, "close"):
            results.close()
    return output.finish()
