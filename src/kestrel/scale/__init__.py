"""Dataset jobs past one process: embedding, zero-shot scoring and segment-everything over image folders.

``run_job`` reads a source, cuts it into shards, skips the shards already in the output folder and runs
the rest on an engine: ``local`` (this process, no Ray) or ``ray`` (a Ray Data actor pool, on this
machine or a cluster). Both engines run the same per-shard task (:mod:`kestrel.pipelines.jobs`) and
the output is the same Parquet shards (:mod:`kestrel.scale.output`).
"""

from .job import ENGINES, JobSummary, run_job

__all__ = ["ENGINES", "JobSummary", "run_job"]
