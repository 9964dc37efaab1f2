"""The Ray engine: shards as rows of a Ray Dataset, mapped by a pool of actors that each load the model once.

``map_batches`` runs :class:`ShardWorker` over one shard at a time; each actor sets its torch threads to
the CPUs Ray gave it, so the workers of one machine do not oversubscribe its cores. A worker returns its
shard's rows serialized as one Arrow IPC buffer; the driver writes the shard files (so the output
folder only has to be reachable from the driver). A killed actor is restarted by Ray and its shards run
again: shards already written are never touched. Without ``address`` Ray starts on this machine and
stops at the end; with it, Kestrel joins that cluster (whose nodes need Kestrel installed and the
images readable at the same paths).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from ..errors import KestrelError, import_extra
from ..pipelines.datasets import Shard
from ..pipelines.jobs import JobSpec, ShardResult


class RayUnavailableError(KestrelError, ImportError):
    """Ray is not installed: ``pip install 'kestrel[ray]'``."""


def _import_ray() -> Any:
    return import_extra("ray", "ray.data", error=RayUnavailableError,
                        message="--engine ray needs Ray Data: pip install 'kestrel[ray]' (or use --engine local)")


class ShardWorker:
    """A Ray actor's callable: loads the model once, then turns each shard row into its result row."""

    def __init__(self, spec: dict[str, Any], threads: int) -> None:
        from ..pipelines.jobs import JobSpec, open_task

        os.environ["OMP_NUM_THREADS"] = str(threads)
        self.error: Exception | None = None
        try:
            self.task = open_task(JobSpec(**{**spec, "labels": tuple(spec["labels"]),
                                             "options": tuple(spec["options"].items())}), threads)
        except Exception as e:  # raised from the first call, where Ray keeps it as the cause (not only its text)
            self.error = e

    def __call__(self, batch: Any) -> Any:
        import pyarrow as pa

        if self.error is not None:
            raise self.error

        out: dict[str, list] = {"shard": [], "rows": [], "failures": [], "stats": []}
        for index, paths in zip(batch["shard"].to_pylist(), batch["paths"].to_pylist()):
            result = self.task.run(paths)
            sink = pa.BufferOutputStream()
            with pa.ipc.new_stream(sink, result.table.schema) as w:
                w.write_table(result.table)
            out["shard"].append(index)
            out["rows"].append(sink.getvalue().to_pybytes())
            out["failures"].append(json.dumps(result.failures))
            out["stats"].append(json.dumps([result.seconds, result.worker, result.cpu_seconds, result.max_rss_mb]))
        return pa.table({"shard": pa.array(out["shard"], pa.int64()), "rows": pa.array(out["rows"], pa.binary()),
                         "failures": out["failures"], "stats": out["stats"]})


def _decode(row: dict[str, Any]) -> ShardResult:
    import pyarrow as pa

    table = pa.ipc.open_stream(pa.py_buffer(row["rows"])).read_all()
    seconds, worker, cpu, rss = json.loads(row["stats"])
    return ShardResult(table, [tuple(f) for f in json.loads(row["failures"])], seconds, worker, cpu, rss)


class WorkerError(KestrelError, RuntimeError):
    """A Kestrel error raised in a Ray worker, as the driver sees it (Ray keeps its type name and text)."""


def _user_error(e: BaseException) -> BaseException | None:
    """The last ``kestrel.<...>Error: message`` line in Ray's report of a worker failure, as one error.

    Ray Data wraps what a worker raised and sends the original only as text, so the type is matched there.
    """
    found = re.findall(r"^(kestrel\.[\w.]+(?:Error|Exception)): (.+)$", str(e), flags=re.M)
    if not found:
        return None
    name, message = found[-1]
    return WorkerError(f"in a Ray worker: {message} ({name.rsplit('.', 1)[-1]})")


def kestrel_path_env() -> dict[str, str]:
    """``PYTHONPATH`` that makes a locally started Ray's workers import the same Kestrel as this process.

    For an installed Kestrel this is its site-packages (already on the workers' path); for a source
    checkout run with ``PYTHONPATH=src`` it is that folder, made absolute.
    """
    import kestrel

    root = str(Path(kestrel.__file__).resolve().parent.parent)
    rest = [str(Path(p).resolve()) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {"PYTHONPATH": os.pathsep.join(dict.fromkeys([root, *rest]))}


def start_ray(address: str | None = None, num_cpus: int | None = None) -> bool:
    """Connect to ``address``, or start Ray on this machine; False if Ray was already running here."""
    ray = _import_ray()
    if ray.is_initialized():
        return False
    kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True, "configure_logging": False}
    if address:
        ray.init(address=address, **kwargs)
    else:
        ray.init(num_cpus=num_cpus, runtime_env={"env_vars": kestrel_path_env()}, **kwargs)
    return True


def worker_threads(workers: int) -> int:
    """CPUs (and torch threads) per actor: the cluster's CPUs shared out, at most one node's worth."""
    ray = _import_ray()
    total = int(ray.cluster_resources().get("CPU", 1))
    per_node = max((int(n["Resources"].get("CPU", 0)) for n in ray.nodes() if n.get("Alive")), default=total)
    return max(1, min(total // max(1, workers), per_node))


def run_ray(spec: JobSpec, shards: Sequence[Shard], workers: int | None = None, address: str | None = None,
            threads: int | None = None) -> Iterator[tuple[Shard, ShardResult]]:
    """Yield each shard with its result as the actor pool finishes it (in any order)."""
    if not shards:
        return
    ray = _import_ray()
    started = start_ray(address)
    try:
        from ray.data import DataContext

        ctx = DataContext.get_current()
        ctx.enable_progress_bars = False
        ctx.print_on_execution_start = False
        total_cpus = int(ray.cluster_resources().get("CPU", 1))
        workers = workers or max(1, total_cpus)
        threads = threads or worker_threads(workers)
        by_index = {s.index: s for s in shards}
        ds = ray.data.from_items([{"shard": s.index, "paths": list(s.paths)} for s in shards],
                                 override_num_blocks=len(shards))
        settings = spec.settings()
        ds = ds.map_batches(ShardWorker, batch_size=1, batch_format="pyarrow",
                            compute=ray.data.ActorPoolStrategy(size=workers), num_cpus=threads,
                            fn_constructor_kwargs={"spec": settings, "threads": threads})
        try:
            for batch in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
                for row in batch.to_pylist():
                    yield by_index[row["shard"]], _decode(row)
        except Exception as e:
            cause = _user_error(e)
            if cause is None:
                raise
            raise cause from None
    finally:
        if started:
            ray.shutdown()
