"""One checked reader per kind of input file: every failure is a :class:`ReadError` naming the file and the cause.

- :func:`check_file` refuses what must not be opened (missing, a folder, a FIFO, a device, a socket, a
  dangling link) before anything opens it.
- :func:`read_json_object` reads a JSON config (``preprocessor_config.json``, ``manifest.json``): empty,
  cut mid-object, not UTF-8, or not an object are all refused.
- :func:`read_npy` reads a ``.npy`` array without pickles: empty, truncated, text, object arrays refused.
- :func:`read_csv_column` and :func:`read_parquet_column` read a column of a table (a UTF-8 byte-order mark
  as Excel writes it, CRLF line ends and quoted fields are fine).
- :func:`read_edge_manifest` reads a ``kestrel export`` folder of SAM 2.1's edge split and returns its
  bound image size; any other export (a ViT's plain ONNX) is refused by name.
- :func:`check_safetensors` reads a ``.safetensors`` header.

Images have their own reader, :func:`kestrel.pipelines.images.load_image` (every Pillow mode, 16-bit too).
"""

from __future__ import annotations

import csv
import json
import os
import stat
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import KestrelError

PathLike = str | os.PathLike[str]

__all__ = ["ReadError", "check_file", "check_safetensors", "read_csv_column", "read_edge_manifest",
           "read_json_object", "read_npy", "read_parquet_column"]


def _shown(path: PathLike) -> str:
    return os.fsencode(os.fspath(path)).decode("utf-8", "backslashreplace")


class ReadError(KestrelError, ValueError):
    """An input file that cannot be read as what it should be: names the file and the cause."""

    def __init__(self, path: PathLike, reason: str) -> None:
        self.path, self.reason = _shown(path), reason
        super().__init__(f"{self.path}: {reason}")


def _a(what: str) -> str:
    return ("an " if what[:1].lower() in "aeio." else "a ") + what


def check_file(path: PathLike, what: str = "file") -> Path:
    """``path`` as a ``Path`` if it is a regular file (links followed); else :class:`ReadError`, before opening."""
    p = Path(os.fspath(path))
    try:
        st = os.stat(p)
    except FileNotFoundError:
        if os.path.islink(p):
            raise ReadError(p, f"a dangling symbolic link (to {_shown(os.readlink(p))}), not {_a(what)}") from None
        raise ReadError(p, f"no such {what}") from None
    except OSError as e:
        raise ReadError(p, e.strerror or str(e)) from None
    mode = st.st_mode
    if stat.S_ISDIR(mode):
        raise ReadError(p, f"a folder, not {_a(what)}")
    if stat.S_ISFIFO(mode):
        raise ReadError(p, f"a named pipe (FIFO), not {_a(what)}")
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) or stat.S_ISSOCK(mode):
        raise ReadError(p, f"a device or socket, not {_a(what)}")
    if not stat.S_ISREG(mode):
        raise ReadError(p, f"not a regular {what}")
    return p


def read_json_object(path: PathLike, what: str = "JSON file") -> dict[str, Any]:
    """A JSON object from ``path``; empty, cut, not UTF-8 or not an object (``{...}``) is a :class:`ReadError`."""
    p = check_file(path, what)
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ReadError(p, f"not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise ReadError(p, e.strerror or str(e)) from None
    if not text.strip():
        raise ReadError(p, f"empty; expected a {what} holding a JSON object")
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise ReadError(p, f"not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}") from None
    except RecursionError:
        raise ReadError(p, "not valid JSON: nested too deeply") from None
    if not isinstance(doc, dict):
        raise ReadError(p, f"expected a JSON object {{...}}, got a JSON {type(doc).__name__.replace('dict', 'object')}")
    return doc


def read_npy(path: PathLike) -> np.ndarray:
    """A ``.npy`` array, never unpickled; numeric (bool, integer or float) arrays only."""
    p = check_file(path, ".npy file")
    with open(p, "rb") as f:
        magic = f.read(6)
    if magic != b"\x93NUMPY":
        what = "an empty file" if not magic else "no .npy header (a text file, or another format)"
        raise ReadError(p, f"not a NumPy .npy array: {what}")
    try:
        with open(p, "rb") as f:
            array = np.load(f, allow_pickle=False)
    except ValueError as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        if "pickle" in first.lower() or "object" in first.lower():
            first = "it holds Python objects (a pickled array), which Kestrel never loads"
        raise ReadError(p, f"not a NumPy .npy array: {first}") from None
    except (EOFError, OSError) as e:
        raise ReadError(p, f"not a NumPy .npy array: {getattr(e, 'strerror', None) or e or 'empty or truncated'}"
                        ) from None
    if not isinstance(array, np.ndarray):
        raise ReadError(p, "not a NumPy .npy array (an .npz archive?)")
    if array.dtype.kind not in "biuf":
        raise ReadError(p, f"expected numbers, got an array of dtype {array.dtype}")
    if array.size and not np.isfinite(array.astype(np.float64, copy=False)).all():
        raise ReadError(p, "holds NaN or infinite values")
    return array


def read_csv_column(path: PathLike, column: str) -> list[str | None]:
    """The values of ``column`` of a CSV file (UTF-8, with or without a byte-order mark; CRLF; quoting)."""
    p = check_file(path, "CSV file")
    try:
        with open(p, newline="", encoding="utf-8-sig") as f:
            reader = csv.DictReader(f)
            names = [n.strip() if n else n for n in (reader.fieldnames or [])]
            if column not in names:
                raise ReadError(p, f"no column {column!r} (columns: {', '.join(names) or 'none'}); "
                                   "name the column of image paths with --path-column")
            original = (reader.fieldnames or [])[names.index(column)]
            return [row.get(original) for row in reader]
    except UnicodeDecodeError as e:
        raise ReadError(p, f"not UTF-8 text ({e.reason} at byte {e.start}); save the CSV as UTF-8") from None
    except csv.Error as e:
        raise ReadError(p, f"not a readable CSV table: {e}") from None


def read_parquet_column(path: PathLike, column: str) -> list[Any]:
    """The values of ``column`` of a Parquet file."""
    import pyarrow.parquet as pq

    p = check_file(path, "Parquet file")
    try:
        schema = pq.read_schema(p)
    except Exception as e:  # pyarrow raises ArrowInvalid, OSError... on a corrupt file
        raise ReadError(p, f"not a readable Parquet file: {str(e).splitlines()[0] if str(e) else e}") from None
    if column not in schema.names:
        raise ReadError(p, f"no column {column!r} (columns: {', '.join(schema.names) or 'none'}); "
                           "name the column of image paths with --path-column")
    try:
        return pq.read_table(p, columns=[column]).column(column).to_pylist()
    except Exception as e:
        raise ReadError(p, f"not a readable Parquet file: {str(e).splitlines()[0] if str(e) else e}") from None


def read_edge_manifest(folder: PathLike) -> tuple[dict[str, Any], int]:
    """The ``manifest.json`` of a SAM 2.1 edge export and the image size its encoder is bound at.

    Refuses a folder without a manifest, a manifest that is not JSON, another kind of export (a ViT's
    plain ONNX export lists its files as rows and has no encoder/decoder programs), and files the
    manifest lists that are missing or of another size.
    """
    d = Path(os.fspath(folder))
    if not d.is_dir():
        raise ReadError(d, "not a folder; give a `kestrel export sam2.1-... --target onnx` folder")
    manifest = read_json_object(d / "manifest.json", "manifest.json")
    export, files = manifest.get("export"), manifest.get("files")
    programs = export.get("programs") if isinstance(export, dict) else None
    if not isinstance(programs, dict) or not isinstance(files, dict):
        what = f" of {manifest['model']}" if isinstance(manifest.get("model"), str) else ""
        raise ReadError(d / "manifest.json", f"not a SAM 2.1 edge export{what}: it has no encoder/decoder "
                                             "programs; make one with `kestrel export sam2.1-hiera-tiny "
                                             "--target onnx --size 512 --out DIR`")
    size = None
    for row in programs.values():
        for spec in (row.get("inputs") or []) if isinstance(row, dict) else []:
            shape = spec.get("shape") if isinstance(spec, dict) else None
            if isinstance(spec, dict) and spec.get("name") == "pixels" and isinstance(shape, list) and len(shape) == 4:
                size = shape[-1]
    if not isinstance(size, int) or size < 1:
        raise ReadError(d / "manifest.json", "no encoder program with a [1, 3, S, S] 'pixels' input: not a SAM 2.1 "
                                             "edge export")
    for name, row in files.items():
        path = d / str(name)
        if "/" in str(name) or "\\" in str(name) or str(name).startswith(".") or not path.is_file():
            raise ReadError(d / "manifest.json", f"lists {str(name)!r}, which is not a file in {_shown(d)}")
        expected = row.get("bytes") if isinstance(row, dict) else None
        if isinstance(expected, int) and path.stat().st_size != expected:
            raise ReadError(path, f"{path.stat().st_size} bytes, but the manifest says {expected}: the export is "
                                  "incomplete or was changed; export again")
    return manifest, size


def check_safetensors(path: PathLike) -> dict[str, Any]:
    """The JSON header of a ``.safetensors`` file (tensor names, dtypes, shapes, offsets), checked."""
    import struct

    p = check_file(path, ".safetensors file")
    size = p.stat().st_size
    with open(p, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ReadError(p, "not a safetensors file: shorter than its 8-byte header length")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, 100 << 20):
            raise ReadError(p, f"not a safetensors file: a header of {n} bytes in a file of {size}")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ReadError(p, f"not a safetensors file: its header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise ReadError(p, "not a safetensors file: its header is not a JSON object")
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2):
            raise ReadError(p, f"not a safetensors file: tensor {name!r} has no data_offsets")
        end = max(end, int(offsets[1]))
    if 8 + n + end > size:
        raise ReadError(p, f"truncated: the header needs {8 + n + end} bytes, the file has {size}")
    return header
