"""Reading (and writing) Hugging Face safetensors checkpoints safely.

Weights are only ever read from safetensors files: nothing here unpickles anything, and a directory that only
holds a pickled checkpoint (``pytorch_model.bin``) is refused with a hint on how to convert it.

Loading is split in three steps so that every problem is reported before a single tensor byte is read:

1. :func:`read_headers` parses the safetensors headers (our own parser, validating every offset against
   the file size, so truncated or corrupt files are caught here);
2. :func:`plan_load` matches checkpoint tensors to the model's parameter paths and reports *all* mismatches at
   once (missing, unexpected, misshapen, wrong dtype kind, duplicates);
3. :func:`load_tensors` reads exactly the planned tensors with ``safetensors.safe_open``.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import safetensors
import safetensors.torch
import torch

from ..errors import KestrelError
from .output import atomic_path

__all__ = [
    "CheckpointError",
    "Expected",
    "TensorInfo",
    "checkpoint_files",
    "load_tensors",
    "plan_load",
    "read_header",
    "read_headers",
    "safetensors_dtype",
    "save_tensors",
    "torch_dtype",
]

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"

# Files that hold pickled checkpoints: recognised only to refuse them with a useful message.
_PICKLED_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")

# Same bound as the safetensors reference implementation (MAX_HEADER_SIZE).
MAX_HEADER_BYTES = 100_000_000

# Element width in *bits*, keyed by the dtype spelling of the safetensors format.
_DTYPE_BITS: dict[str, int] = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E5M2FNUZ": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E8M0": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "F64": 64,
    "I64": 64,
    "U64": 64,
}

_FLOAT_DTYPES = frozenset(
    {"F4", "F6_E2M3", "F6_E3M2", "F8_E5M2", "F8_E4M3", "F8_E5M2FNUZ", "F8_E4M3FNUZ", "F8_E8M0"}
    | {"F16", "BF16", "F32", "F64"}
)
# Float dtypes that torch converts between with ``Tensor.to`` (not the packed sub-byte formats).
_CONVERTIBLE_FLOATS = frozenset(
    {"F16", "BF16", "F32", "F64", "F8_E5M2", "F8_E4M3", "F8_E5M2FNUZ", "F8_E4M3FNUZ", "F8_E8M0"}
)

_TORCH_DTYPES: dict[str, torch.dtype] = {
    name: dt
    for name, dt in {
        "BOOL": torch.bool,
        "U8": torch.uint8,
        "I8": torch.int8,
        "I16": torch.int16,
        "U16": getattr(torch, "uint16", None),
        "F16": torch.float16,
        "BF16": torch.bfloat16,
        "I32": torch.int32,
        "U32": getattr(torch, "uint32", None),
        "F32": torch.float32,
        "C64": torch.complex64,
        "F64": torch.float64,
        "I64": torch.int64,
        "U64": getattr(torch, "uint64", None),
        "F8_E5M2": getattr(torch, "float8_e5m2", None),
        "F8_E4M3": getattr(torch, "float8_e4m3fn", None),
        "F8_E5M2FNUZ": getattr(torch, "float8_e5m2fnuz", None),
        "F8_E4M3FNUZ": getattr(torch, "float8_e4m3fnuz", None),
        "F8_E8M0": getattr(torch, "float8_e8m0fnu", None),
    }.items()
    if dt is not None
}
_SAFETENSORS_NAMES: dict[torch.dtype, str] = {dt: name for name, dt in _TORCH_DTYPES.items()}


class CheckpointError(KestrelError, ValueError):
    """A checkpoint cannot be used.

    The message names the file, the tensor or parameter, and what was expected and found.
    """


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as described by a safetensors header (no data is read to build it)."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # as safetensors spells it: "F32", "BF16", "F16", "I64", ...
    file: Path


@dataclass(frozen=True)
class Expected:
    """What the model's parameter manifest wants for one parameter path."""

    shape: tuple[int, ...]
    dtype: str  # safetensors spelling, like TensorInfo.dtype
    optional: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        if self.dtype not in _DTYPE_BITS:
            raise ValueError(
                f"Expected.dtype must be a safetensors dtype ({', '.join(_DTYPE_BITS)}), got {self.dtype!r}"
            )


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a safetensors dtype spelling ("F32" -> torch.float32)."""
    try:
        return _TORCH_DTYPES[name]
    except KeyError:
        raise ValueError(f"no torch dtype for safetensors dtype {name!r}") from None


def safetensors_dtype(dtype: torch.dtype) -> str:
    """The safetensors spelling of a torch dtype (torch.float32 -> "F32")."""
    try:
        return _SAFETENSORS_NAMES[dtype]
    except KeyError:
        raise ValueError(f"torch dtype {dtype} has no safetensors spelling") from None


def _fmt_shape(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"


# ----------------------------------------------------------------------------------------------------
# Headers


def _reject_duplicate_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def read_header(path: str | os.PathLike[str]) -> dict[str, TensorInfo]:
    """Parse a ``.safetensors`` header without reading tensor data.

    The format is an 8-byte little-endian header length, a JSON header of that many bytes, then the data
    section. Validates that the file exists and holds at least the 8-byte prefix, that the header length is
    sane and lies inside the file, that the JSON is a valid object with ``dtype``/``shape``/``data_offsets``
    for each tensor, that every tensor's byte range matches ``prod(shape) * itemsize``, and that the ranges
    tile the data section exactly (no overlap, no gap, nothing past the end - a truncated file is detected
    here - and no trailing bytes).

    Returns tensor name -> :class:`TensorInfo` (``__metadata__`` is skipped). Raises :class:`CheckpointError`.
    """
    path = Path(path)

    def fail(what: str) -> CheckpointError:
        return CheckpointError(f"{path}: {what}")

    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise fail("file does not exist") from None
    except OSError as e:
        raise fail(f"cannot stat file: {e}") from e
    if not path.is_file():
        raise fail("not a regular file")
    if size < 8:
        raise fail(
            f"file is {size} bytes, shorter than the 8-byte header-length prefix of a safetensors file"
        )

    try:
        with path.open("rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len == 0:
                raise fail("header length is 0 (expected a JSON object)")
            if header_len > MAX_HEADER_BYTES:
                raise fail(
                    f"header length {header_len} is larger than the {MAX_HEADER_BYTES}-byte limit "
                    "(not a safetensors file, or corrupt)"
                )
            if header_len > size - 8:
                raise fail(
                    f"header length {header_len} exceeds the file: only {size - 8} bytes follow the "
                    "8-byte prefix (truncated or not a safetensors file)"
                )
            raw = f.read(header_len)
    except OSError as e:
        raise fail(f"cannot read file: {e}") from e
    if len(raw) != header_len:  # the file shrank under us
        raise fail(f"expected {header_len} header bytes, read {len(raw)}")

    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_reject_duplicate_keys)
    except (UnicodeDecodeError, ValueError) as e:
        raise fail(f"header is not valid UTF-8 JSON ({e})") from None
    if not isinstance(header, dict):
        raise fail(f"header is a JSON {type(header).__name__}, expected an object")

    data_size = size - 8 - header_len
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
    ):
        raise fail("__metadata__ must be an object mapping strings to strings")

    infos: dict[str, TensorInfo] = {}
    ranges: list[tuple[int, int, str]] = []
    for name, entry in header.items():
        where = f"tensor {name!r}"
        if not isinstance(entry, dict):
            raise fail(f"{where}: header entry is a JSON {type(entry).__name__}, expected an object")
        missing = [k for k in ("dtype", "shape", "data_offsets") if k not in entry]
        if missing:
            raise fail(f"{where}: header entry lacks {', '.join(missing)} (has {sorted(entry)})")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not isinstance(dtype, str) or dtype not in _DTYPE_BITS:
            raise fail(f"{where}: unknown dtype {dtype!r} (expected one of {', '.join(_DTYPE_BITS)})")
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise fail(f"{where}: shape must be a list of non-negative integers, got {shape!r}")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(_is_int(o) and o >= 0 for o in offsets)
            or offsets[0] > offsets[1]
        ):
            raise fail(f"{where}: data_offsets must be [begin, end] with 0 <= begin <= end, got {offsets!r}")
        begin, end = offsets
        bits = math.prod(shape) * _DTYPE_BITS[dtype]
        if bits % 8:
            raise fail(
                f"{where}: {dtype} tensor of shape {_fmt_shape(tuple(shape))} is not a whole number of bytes"
            )
        if end - begin != bits // 8:
            raise fail(
                f"{where}: data_offsets {offsets} span {end - begin} bytes, but a {dtype} tensor of shape "
                f"{_fmt_shape(tuple(shape))} needs {bits // 8}"
            )
        if end > data_size:
            raise fail(
                f"{where}: data ends at byte {end} of the data section, but the file has only "
                f"{data_size} data bytes (file is {size} bytes; truncated?)"
            )
        infos[name] = TensorInfo(name=name, shape=tuple(shape), dtype=dtype, file=path)
        ranges.append((begin, end, name))

    # The ranges must tile the data section: no overlap, no gap, no trailing bytes (as safetensors requires).
    ranges.sort()
    pos, prev = 0, None
    for begin, end, name in ranges:
        if begin < pos:
            raise fail(
                f"tensor {name!r}: data_offsets [{begin}, {end}] overlap tensor {prev!r} (ends at {pos})"
            )
        if begin > pos:
            after = f"after tensor {prev!r}" if prev is not None else "at the start of the data section"
            raise fail(
                f"tensor {name!r}: {begin - pos}-byte gap {after} (data starts at {begin}, expected {pos})"
            )
        pos, prev = end, name
    if pos != data_size:
        raise fail(
            f"{data_size - pos} trailing bytes after the last tensor (data section is {data_size} bytes)"
        )
    return infos


def _load_index(index_path: Path) -> dict[str, str]:
    """The ``weight_map`` of a sharded-checkpoint index, validated (tensor name -> shard file name)."""
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{index_path}: cannot read the shard index ({e})") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(
            f"{index_path}: expected a non-empty 'weight_map' object mapping tensor names to shards"
        )
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or not shard.endswith(".safetensors"):
            raise CheckpointError(
                f"{index_path}: tensor {name!r} maps to {shard!r}, expected a .safetensors file name"
            )
        if Path(shard).is_absolute() or ".." in Path(shard).parts or "\\" in shard:
            raise CheckpointError(
                f"{index_path}: tensor {name!r} maps to {shard!r}, which is outside the checkpoint directory"
            )
    return weight_map


def _refuse_pickled(directory: Path, pickled: list[Path]) -> CheckpointError:
    names = ", ".join(p.name for p in pickled)
    return CheckpointError(
        f"{directory}: only a pickled checkpoint was found ({names}), and pickled checkpoints are refused: "
        "unpickling can run arbitrary code. Convert it to safetensors once, in an environment you trust "
        "(e.g. `AutoModel.from_pretrained(DIR).save_pretrained(OUT)` with transformers writes "
        f"{SAFE_WEIGHTS_NAME}), or fetch the repo's safetensors weights instead."
    )


def _resolve(directory: Path) -> tuple[list[Path], Path | None, dict[str, str] | None]:
    """(safetensors files, index path, index weight_map) of a checkpoint directory or single file."""
    if directory.is_file() and directory.suffix == ".safetensors":
        return [directory], None, None
    if not directory.exists():
        raise CheckpointError(f"{directory}: checkpoint directory does not exist")
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: expected a checkpoint directory or a .safetensors file")

    single = directory / SAFE_WEIGHTS_NAME
    if single.is_file():
        return [single], None, None
    index_path = directory / SAFE_WEIGHTS_INDEX_NAME
    if index_path.is_file():
        weight_map = _load_index(index_path)
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (directory / s).is_file()]
        if missing:
            raise CheckpointError(
                f"{index_path}: shard file(s) listed in the index are missing from {directory}: "
                + ", ".join(missing)
            )
        return [directory / s for s in shards], index_path, weight_map

    entries = sorted(directory.iterdir())
    pickled = [p for p in entries if p.name.endswith(_PICKLED_SUFFIXES) or p.name.endswith(".bin.index.json")]
    if pickled:
        raise _refuse_pickled(directory, pickled)
    others = [p.name for p in entries if p.suffix == ".safetensors"]
    hint = (
        f" (found {', '.join(others)}; pass the file itself to load it)"
        if others
        else " (no .safetensors files at all)"
    )
    raise CheckpointError(
        f"{directory}: neither {SAFE_WEIGHTS_NAME} nor {SAFE_WEIGHTS_INDEX_NAME} found{hint}"
    )


def checkpoint_files(directory: str | os.PathLike[str]) -> list[Path]:
    """The safetensors files of a ``save_pretrained`` directory.

    ``model.safetensors`` if present, otherwise the shards listed by ``model.safetensors.index.json``
    (validated: a shard it names that is not on disk is an error). A path to a single ``.safetensors`` file is
    accepted as is. A directory with only a pickled checkpoint (``pytorch_model.bin``) is refused.
    """
    return _resolve(Path(directory))[0]


def read_headers(directory: str | os.PathLike[str]) -> dict[str, TensorInfo]:
    """The union of the headers of all shards of a checkpoint (see :func:`checkpoint_files`).

    A tensor name present in two shards is an error; so is a tensor that the shard index places in a shard
    whose header does not contain it.
    """
    files, index_path, weight_map = _resolve(Path(directory))
    out: dict[str, TensorInfo] = {}
    for file in files:
        for name, info in read_header(file).items():
            if name in out:
                raise CheckpointError(
                    f"tensor {name!r} is stored twice: in {out[name].file} and in {file} "
                    f"(shapes {_fmt_shape(out[name].shape)} and {_fmt_shape(info.shape)})"
                )
            out[name] = info
    if weight_map is not None:
        wrong = [
            f"{name!r} (index: {shard}, found in: {out[name].file.name if name in out else 'no shard'})"
            for name, shard in sorted(weight_map.items())
            if name not in out or out[name].file.name != shard
        ]
        if wrong:
            raise CheckpointError(
                f"{index_path}: the index disagrees with the shard headers for {len(wrong)} tensor(s): "
                + "; ".join(wrong[:10])
                + (" ..." if len(wrong) > 10 else "")
            )
    return out


# ----------------------------------------------------------------------------------------------------
# Planning


def _where(headers: Mapping[str, TensorInfo]) -> str:
    files = sorted({str(info.file) for info in headers.values()})
    if not files:
        return "the checkpoint (no tensors)"
    if len(files) == 1:
        return files[0]
    dirs = {str(Path(f).parent) for f in files}
    return f"{dirs.pop()} ({len(files)} shards)" if len(dirs) == 1 else ", ".join(files)


def plan_load(
    headers: Mapping[str, TensorInfo],
    expected: Mapping[str, Expected],
    bindings: Callable[[str], str | None],
) -> dict[str, TensorInfo]:
    """Match checkpoint tensors to parameter paths before reading any data.

    ``bindings(checkpoint_name)`` returns the parameter path the tensor loads into, or ``None`` for a tensor
    that is deliberately left unused. A tensor is *unexpected* when its binding raises
    ``KeyError``/``LookupError`` (no binding for it) or returns a path the model does not have.

    All problems are collected into one :class:`CheckpointError`, one line each: unexpected tensors, missing
    required parameters, shape mismatches, dtype mismatches (a float tensor of another float dtype is fine -
    it is converted at load - but integer vs float, or two different integer types, is not), and parameters
    provided by more than one tensor. Returns parameter path -> :class:`TensorInfo`.
    """
    sources: dict[str, list[TensorInfo]] = {}
    unexpected: list[str] = []
    mismatched: list[str] = []
    for name in sorted(headers):
        info = headers[name]
        at = f"{name!r} {_fmt_shape(info.shape)} {info.dtype} in {info.file}"
        try:
            target = bindings(name)
        except LookupError:
            unexpected.append(f"unexpected tensor: {at} is not bound to any parameter")
            continue
        if target is None:
            continue
        want = expected.get(target)
        if want is None:
            unexpected.append(
                f"unexpected tensor: {at} is bound to {target!r}, which is not a parameter of the model"
            )
            continue
        sources.setdefault(target, []).append(info)
        if tuple(want.shape) != info.shape:
            mismatched.append(
                f"shape mismatch: parameter {target!r} expects {_fmt_shape(tuple(want.shape))}, "
                f"but tensor {name!r} in {info.file} has {_fmt_shape(info.shape)}"
            )
        if want.dtype != info.dtype and not (
            want.dtype in _CONVERTIBLE_FLOATS and info.dtype in _CONVERTIBLE_FLOATS
        ):
            kind = (
                "integer vs float"
                if (want.dtype in _FLOAT_DTYPES) != (info.dtype in _FLOAT_DTYPES)
                else "not converted at load: only F64/F32/F16/BF16/F8 floats convert into each other"
            )
            mismatched.append(
                f"dtype mismatch: parameter {target!r} expects {want.dtype}, "
                f"but tensor {name!r} in {info.file} is {info.dtype} ({kind})"
            )

    duplicates = [
        f"duplicate: parameter {path!r} is provided by {len(infos)} tensors: "
        + ", ".join(f"{i.name!r} in {i.file}" for i in infos)
        for path, infos in sorted(sources.items())
        if len(infos) > 1
    ]
    where = _where(headers)
    missing = [
        f"missing: parameter {path!r} (expected {_fmt_shape(tuple(want.shape))} {want.dtype}) "
        f"is not provided by any tensor in {where}"
        for path, want in sorted(expected.items())
        if not want.optional and path not in sources
    ]
    problems = missing + unexpected + mismatched + duplicates
    if problems:
        raise CheckpointError(
            f"checkpoint {where} does not match the model ({len(problems)} problem"
            f"{'s' if len(problems) != 1 else ''}):\n" + "\n".join(f"  {p}" for p in problems)
        )
    return {path: infos[0] for path, infos in sources.items()}


# ----------------------------------------------------------------------------------------------------
# Loading and saving


def load_tensors(
    plan: Mapping[str, TensorInfo],
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
) -> dict[str, torch.Tensor]:
    """Read exactly the planned tensors (parameter path -> tensor) with ``safetensors.safe_open``.

    Floating-point tensors are converted to ``dtype`` when it is given; other tensors keep their dtype. Any
    error raised while reading is wrapped into a :class:`CheckpointError` naming the file and tensor.
    """
    if dtype is not None and not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point dtype, got {dtype}")
    device = str(torch.device(device))
    by_file: dict[Path, list[tuple[str, TensorInfo]]] = {}
    for path, info in plan.items():
        by_file.setdefault(info.file, []).append((path, info))

    out: dict[str, torch.Tensor] = {}
    for file, items in by_file.items():
        name = None
        try:
            with safetensors.safe_open(str(file), framework="pt", device=device) as f:
                for path, info in items:
                    name = info.name
                    tensor = f.get_tensor(info.name)
                    if info.dtype != "F4" and tuple(tensor.shape) != info.shape:
                        raise CheckpointError(
                            f"{file}: tensor {info.name!r} was planned as {_fmt_shape(info.shape)} but "
                            f"reads as {_fmt_shape(tuple(tensor.shape))} "
                            "(file changed since the header was read?)"
                        )
                    if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
                        tensor = tensor.to(dtype)
                    out[path] = tensor
        except CheckpointError:
            raise
        except (safetensors.SafetensorError, OSError, RuntimeError, ValueError, TypeError) as e:
            what = f"tensor {name!r}" if name is not None else "file"
            raise CheckpointError(f"{file}: cannot read {what}: {type(e).__name__}: {e}") from e
    return out


def save_tensors(
    tensors: Mapping[str, torch.Tensor],
    path: str | os.PathLike[str],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write ``tensors`` to a safetensors file atomically, through :mod:`kestrel.runtime.output`.

    The data goes to a temporary file in the same directory, which is flushed to disk and then renamed over
    ``path``: readers see either the old file or the complete new one, and on any failure the temporary file
    is removed (an existing file at ``path`` is left untouched). The file gets the umask's permissions, and
    a symbolic link, folder or device at ``path`` is refused. A destination that cannot be written raises
    :class:`~kestrel.errors.OutputError`; tensors that cannot be saved raise :class:`CheckpointError`.
    """
    with atomic_path(path) as tmp:
        try:
            safetensors.torch.save_file(
                dict(tensors), str(tmp), metadata=dict(metadata) if metadata is not None else None
            )
        except (safetensors.SafetensorError, OSError, RuntimeError, ValueError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{path}: cannot save tensors: {type(e).__name__}: {e}") from e
