"""A dataset job's output folder: Parquet shards written atomically, a failures table and a manifest.

Layout of ``DIR``::

    manifest.json              the job (task, model, revision, settings), the source, every shard
    part-00000.parquet ...     one file per shard: path, the task's values, model, revision, height, width
    failures/part-00000.parquet  a shard's unreadable images (path, error), when it has any
    failures.parquet           all unreadable images of the run (path, error, shard)

Every file is written to a temporary name in its final folder and renamed into place, so a file that
exists is complete: a shard file is the mark that its shard is done (its failures file is written
first). A rerun over the same source with the same settings skips the done shards; a different job
in the same folder is refused rather than mixed in.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..errors import OutputError
from ..pipelines.datasets import Shard, SourceError
from ..pipelines.jobs import JobSpec, ShardResult

MANIFEST = "manifest.json"
FAILURES = "failures.parquet"
FORMAT = "kestrel-dataset/1"


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Call ``write(tmp)`` on a temporary file beside ``path``, then rename it to ``path``.

    The file gets the permissions the umask gives a new file (``0o666 & ~umask``), as any other program's
    output would, not ``mkstemp``'s private 0600."""
    from ..runtime.output import umask

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        os.chmod(tmp, 0o666 & ~umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_parquet(table: Any, path: Path) -> None:
    """Write an Arrow table to ``path`` atomically."""
    import pyarrow.parquet as pq

    atomic_write(path, lambda tmp: pq.write_table(table, tmp))


class DatasetOutput:
    """The output folder of one job: which shards are done, and writing the rest."""

    def __init__(self, directory: str | Path, spec: JobSpec, shards: Sequence[Shard], fingerprint: str,
                 shard_size: int) -> None:
        self.dir = Path(directory)
        self.spec, self.shards = spec, list(shards)
        self.header = {"format": FORMAT, "task": spec.task, "model": spec.model, "revision": spec.revision,
                       "settings": spec.settings(),
                       "source": {"images": sum(len(s.paths) for s in shards), "fingerprint": fingerprint},
                       "shard_size": shard_size}

    def open(self) -> list[Shard]:
        """Check the folder (new, empty, or this same job) and return the shards still to do."""
        if self.dir.exists() and not self.dir.is_dir():
            raise OutputError(f"--out {self.dir} is a file; a dataset job writes a folder of Parquet shards")
        manifest = self.dir / MANIFEST
        if manifest.is_file():
            self._check_same_job(json.loads(manifest.read_text()))
        elif self.dir.is_dir() and any(self.dir.iterdir()):
            raise OutputError(f"--out {self.dir} is a non-empty folder without a {MANIFEST}; "
                              "give a new or empty folder")
        self.created = not os.path.lexists(self.dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        for stale in self.dir.glob(".*.tmp"):  # left by a run that was killed mid-write
            stale.unlink(missing_ok=True)
        for stale in (self.dir / "failures").glob(".*.tmp"):
            stale.unlink(missing_ok=True)
        self._write_manifest(complete=False)
        return [s for s in self.shards if not self.shard_path(s).is_file()]

    def discard_if_new(self) -> None:
        """After a failed run: remove the folder if this run created it and finished no shard in it.

        A folder that existed before, or holds a finished shard (which a rerun resumes from), is kept."""
        import shutil

        if getattr(self, "created", False) and not any(self.shard_path(s).is_file() for s in self.shards):
            shutil.rmtree(self.dir, ignore_errors=True)

    def _check_same_job(self, old: dict[str, Any]) -> None:
        if old.get("format") != FORMAT:
            raise OutputError(f"{self.dir / MANIFEST} is not a Kestrel dataset manifest")
        for key in ("task", "revision", "settings", "source", "shard_size"):
            if old.get(key) != self.header[key]:
                what = {"source": "the source images (their list or order)", "settings": "the settings"}.get(key, key)
                raise OutputError(f"{self.dir} holds another job's output: {what} differ "
                                  f"({_short(old.get(key))} there, {_short(self.header[key])} now); "
                                  "give a new --out folder to start afresh")

    def shard_path(self, shard: Shard) -> Path:
        return self.dir / f"{shard.name}.parquet"

    def failures_path(self, shard: Shard) -> Path:
        return self.dir / "failures" / f"{shard.name}.parquet"

    def write(self, shard: Shard, result: ShardResult) -> None:
        """Write a finished shard: its failures (if any) first, then its rows, each atomically."""
        import pyarrow as pa

        if len(result.table) + len(result.failures) != len(shard.paths):
            raise RuntimeError(f"{shard.name}: {len(result.table)} rows and {len(result.failures)} failures "
                               f"for {len(shard.paths)} images")
        if result.failures:
            paths, errors = zip(*result.failures)
            write_parquet(pa.table({"path": pa.array(paths, pa.string()), "error": pa.array(errors, pa.string())}),
                          self.failures_path(shard))
        stats = {"rows": len(result.table), "failures": len(result.failures), "worker": result.worker,
                 "seconds": round(result.seconds, 4), "cpu_seconds": round(result.cpu_seconds, 4),
                 "max_rss_mb": round(result.max_rss_mb, 1)}
        meta = dict(result.table.schema.metadata or {})
        meta[b"kestrel.shard"] = json.dumps(stats).encode()
        write_parquet(result.table.replace_schema_metadata(meta), self.shard_path(shard))

    def finish(self) -> dict[str, Any]:
        """Write the failures table and the complete manifest; return the manifest."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        entries, failed = [], []
        for shard in self.shards:
            path = self.shard_path(shard)
            if not path.is_file():
                raise RuntimeError(f"{shard.name} was not written")
            meta = pq.read_schema(path).metadata or {}
            stats = json.loads(meta.get(b"kestrel.shard", b"{}"))
            entries.append({"name": shard.name, "file": path.name, "images": len(shard.paths), **stats})
            if self.failures_path(shard).is_file():
                t = pq.read_table(self.failures_path(shard))
                failed.append(t.append_column("shard", pa.array([shard.index] * len(t), pa.int32())))
        schema = pa.schema([("path", pa.string()), ("error", pa.string()), ("shard", pa.int32())])
        write_parquet(pa.concat_tables(failed) if failed else schema.empty_table(), self.dir / FAILURES)
        return self._write_manifest(complete=True, shards=entries)

    def _write_manifest(self, complete: bool, shards: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        doc = {**self.header, "complete": complete}
        if shards is not None:
            doc["rows"] = sum(s.get("rows", 0) for s in shards)
            doc["failures"] = sum(s.get("failures", 0) for s in shards)
            doc["shards"] = shards
        text = json.dumps(doc, indent=2) + "\n"
        atomic_write(self.dir / MANIFEST, lambda tmp: tmp.write_text(text))
        return doc


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 120 else text[:117] + "..."


__all__ = ["FAILURES", "MANIFEST", "DatasetOutput", "OutputError", "SourceError", "atomic_write", "write_parquet"]
