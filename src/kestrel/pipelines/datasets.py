"""Dataset sources and shards: which images a dataset job reads, and how the work is cut up.

A *source* names images in one of four ways:

- a folder: every image file under it, recursively, in sorted order;
- a single image file;
- a list file (any other text file, e.g. ``images.txt``): one path per line, blank lines and lines
  starting with ``#`` skipped;
- a table, ``.parquet`` or ``.csv``, with a column of paths (``path`` unless told otherwise).

Relative paths in a list file or a table are relative to that file's folder. The images of all
sources, in order, are cut into *shards* of consecutive images; a shard is the unit of output (one
Parquet file), of resuming and of retrying.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import KestrelError

IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff"})
TABLE_SUFFIXES = frozenset({".parquet", ".csv"})


class SourceError(KestrelError, ValueError):
    """A dataset source that cannot be read: missing, empty, or a table without the path column."""


def read_source(sources: str | Path | Sequence[str | Path], column: str = "path") -> list[str]:
    """The image paths named by one or more sources, in order (see the module docstring)."""
    items = [sources] if isinstance(sources, str | Path) else list(sources)
    if not items:
        raise SourceError("no source given: name a folder of images, a list file, or a .parquet/.csv table")
    paths: list[str] = []
    for item in items:
        paths += _read_one(Path(item), column)
    if not paths:
        raise SourceError(f"no images found in {', '.join(map(str, items))}")
    return paths


def _read_one(src: Path, column: str) -> list[str]:
    from .readers import ReadError, check_file, read_csv_column, read_parquet_column

    if src.is_dir():
        found = [p for p in sorted(src.rglob("*")) if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file()]
        for p in found:
            _check_name(p)
        return [str(p) for p in found]
    if not os.path.lexists(src):
        raise SourceError(f"source {_shown(src)} does not exist")
    try:
        check_file(src, "source")
    except ReadError as e:
        raise SourceError(f"source {e}") from None
    suffix = src.suffix.lower()
    if suffix in IMAGE_SUFFIXES:
        _check_name(src)
        return [str(src)]
    try:
        if suffix == ".parquet":
            return _resolve(src, _non_null(src, column, read_parquet_column(src, column)))
        if suffix == ".csv":
            return _resolve(src, _non_null(src, column, read_csv_column(src, column)))
    except ReadError as e:
        raise SourceError(str(e)) from None
    try:
        lines = src.read_text(encoding="utf-8-sig").splitlines()
    except UnicodeDecodeError:
        raise SourceError(f"{_shown(src)} is neither an image nor a UTF-8 text list of paths (one per line)") from None
    return _resolve(src, [s for s in (line.strip() for line in lines) if s and not s.startswith("#")])


def _shown(path: str | Path) -> str:
    return os.fsencode(os.fspath(path)).decode("utf-8", "backslashreplace")


def _check_name(path: Path) -> None:
    """Refuse a file name that is not valid UTF-8 (e.g. Latin-1 ``caf\\xe9.png``): the output tables store
    paths as UTF-8 text, and such a name cannot be written or matched later."""
    try:
        os.fspath(path).encode("utf-8")
    except UnicodeEncodeError:
        raise SourceError(f"{_shown(path)}: the file name is not valid UTF-8; rename it (e.g. with "
                          "`convmv -f latin1 -t utf8`) or move it out of the source folder") from None


def _non_null(src: Path, column: str, values: list) -> list[str]:
    missing = [k for k, v in enumerate(values) if v is None or str(v).strip() == ""]
    if missing:
        raise SourceError(f"{_shown(src)}: column {column!r} is empty in {len(missing)} row(s), "
                          f"first at row {missing[0]}")
    return [str(v).strip() for v in values]


def _resolve(table: Path, paths: list[str]) -> list[str]:
    """Paths relative to the list or table file's folder; absolute ones unchanged."""
    base = table.parent
    return [p if Path(p).is_absolute() else str(base / p) for p in paths]


@dataclass(frozen=True)
class Shard:
    """Consecutive images ``paths`` of a dataset; ``index`` names its output file."""

    index: int
    paths: tuple[str, ...]

    @property
    def name(self) -> str:
        return f"part-{self.index:05d}"


def plan_shards(paths: Sequence[str], shard_size: int) -> list[Shard]:
    """Cut ``paths`` into shards of ``shard_size`` consecutive images (the last may be shorter)."""
    if shard_size < 1:
        raise SourceError(f"the shard size must be positive, got {shard_size}")
    return [Shard(k // shard_size, tuple(paths[k: k + shard_size])) for k in range(0, len(paths), shard_size)]


def fingerprint(paths: Sequence[str]) -> str:
    """A sha256 of the ordered path list: a rerun resumes only over the same images in the same order."""
    h = hashlib.sha256()
    for p in paths:
        h.update(p.encode("utf-8", "surrogateescape") + b"\0")
    return h.hexdigest()
