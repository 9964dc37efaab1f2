"""The local engine: every shard in this process, one after another, with one loaded model."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from ..pipelines.datasets import Shard
from ..pipelines.jobs import JobSpec, ShardResult, open_task


def run_local(spec: JobSpec, shards: Sequence[Shard], threads: int | None = None
              ) -> Iterator[tuple[Shard, ShardResult]]:
    """Yield each shard with its result, in order. Needs no Ray."""
    if not shards:
        return
    task = open_task(spec, threads)
    for shard in shards:
        yield shard, task.run(shard.paths)
