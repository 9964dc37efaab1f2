"""The per-machine kernel calibration: where it is cached, what it chose, and a report of it.

One JSON file per machine key (CPU model and instruction-set flags, thread count, torch, oneDNN and
MKL versions) under ``$KESTREL_CACHE_DIR``, else ``$XDG_CACHE_HOME/kestrel``, else
``~/.cache/kestrel``, in ``calibration/``. Each file maps a GEMM shape ``M x N x K`` (+bias) to
the chosen kernel and the rates every candidate reached when it was measured (GFLOP/s). The choice
is made by :func:`kestrel.kernels.gemm.measure` the first time a shape runs; :func:`calibrate_model`
runs a model once to measure every shape it uses ahead of time (``kestrel doctor --model``,
``kestrel bench``). Delete the directory (or ``kestrel doctor --reset``) to measure again.

Which shapes a call used is observed through a :class:`Recorder`: kernels report each shape they look
up with :func:`note`, and every recorder open at that moment (:func:`recording`) keeps it.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import platform
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from . import library, settings
from .weights import WEIGHTS

VERSION = 8  # of the file format and of the measuring procedure (2: streamed, cold weights; 3: packed always
# measured, with the in-place fallback; 4: the machine's load recorded, a disturbed choice not reused: tables
# of 3 held choices measured while other processes took the cores, 5-10x below the machine's rates; 5: bf16
# shapes measured among the bf16 kernels, under keys of their own; 6: int8 shapes race every quantized engine;
# 7: up to 4096 rows timed, not 2048, and close races run longer; 8: every timed pass of a packed kernel on its
# own layouts: MKL's and oneDNN's packing shared the weight copies and repacked them in turn, so each was timed
# clean in one round of three, and one slow round chose torch's GEMM for DINOv2-B's fc1 at 257 rows, 25% slower)


def cache_dir() -> Path:
    """Where calibrations are kept: ``calibration/`` in Kestrel's cache folder (read at call time)."""
    return settings.cache_dir("calibration")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def cpu_flags() -> list[str]:
    """The SIMD-relevant instruction-set flags the kernel libraries dispatch on."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = line.split(":", 1)[1].split()
                return sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "sse4", "f16c")))
    except OSError:
        pass
    return []


# CPU features with native half-precision arithmetic: without them, torch emulates bf16/f16 GEMMs by
# converting to f32, which is slower than f32 itself (the doctor's GEMM race measures it).
_NATIVE_X86 = {"bf16": ("avx512_bf16", "amx_bf16"), "f16": ("avx512_fp16", "amx_fp16")}
_NATIVE_ARM = {"bf16": ("bf16",), "f16": ("fphp", "asimdhp")}


@functools.cache
def native_half(dtype: str) -> bool | None:
    """Whether this CPU computes ``dtype`` (``"bf16"`` or ``"f16"``) natively; None when it cannot tell.

    Read from ``/proc/cpuinfo``'s flags (x86) or features (Arm); elsewhere the answer is unknown."""
    try:
        return native_half_in(Path("/proc/cpuinfo").read_text(), dtype)
    except OSError:
        return None


def native_half_in(cpuinfo: str, dtype: str) -> bool | None:
    """:func:`native_half` as read from the text of a ``/proc/cpuinfo``."""
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):
            table = _NATIVE_X86 if name.strip() == "flags" else _NATIVE_ARM
            return any(f in value.split() for f in table[dtype])
    return None


@functools.lru_cache(maxsize=1)
def _static_key() -> tuple[tuple[str, Any], ...]:
    return (("version", VERSION), ("cpu", cpu_model()), ("flags", cpu_flags()), ("machine", platform.machine()),
            ("torch", torch.__version__), ("onednn", library.onednn_version()), ("mkl", library.mkl_version()),
            ("kernels", sorted(library.KERNELS)))


def machine_key(threads: int | None = None) -> dict[str, Any]:
    """Everything a measured choice depends on, besides the shape."""
    return dict(_static_key()) | {"threads": threads if threads is not None else torch.get_num_threads()}


def key_digest(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


# a GEMM in another dtype than f32 is its own experiment: its key starts with the dtype's name
DTYPE_PREFIX = {torch.float32: "", torch.bfloat16: "bf16 "}


def shape_key(m: int, n: int, k: int, bias: bool, dtype: torch.dtype = torch.float32) -> str:
    return f"{DTYPE_PREFIX[dtype]}{m}x{n}x{k}{'+b' if bias else ''}"


class Table:
    """The choices of one machine key, backed by one cache file (written atomically on each new shape)."""

    def __init__(self, key: dict[str, Any], path: Path) -> None:
        self.key, self.path = key, path
        self.shapes: dict[str, dict[str, Any]] = {}
        self.load_error: str | None = None
        try:
            data = json.loads(path.read_text())
            if data.get("key") == key:
                # a choice measured while other processes took the cores is measured again here
                self.shapes = {k: v for k, v in data.get("shapes", {}).items()
                               if not (isinstance(v, dict) and v.get("disturbed"))}
        except FileNotFoundError:
            pass
        except (OSError, ValueError) as e:  # a corrupt cache is measured again, not trusted
            self.load_error = f"{path}: {e}"

    def entry(self, m: int, n: int, k: int, bias: bool, dtype: torch.dtype = torch.float32) -> dict[str, Any] | None:
        """What was measured for this GEMM shape (``kernel``, ``in_place``, ``gflops``, ...), or None."""
        return self.shapes.get(shape_key(m, n, k, bias, dtype))

    def capped(self, n: int, k: int, bias: bool, rows: int,
               dtype: torch.dtype = torch.float32) -> dict[str, Any] | None:
        """An entry of ``? x N x K`` measured on ``rows`` rows of a taller input (``M > rows``), or None."""
        prefix = DTYPE_PREFIX[dtype]
        tail = shape_key(0, n, k, bias)[1:]  # "xNxK[+b]"
        for key, hit in self.shapes.items():
            height = key[len(prefix):-len(tail)]
            if (key.startswith(prefix) and key.endswith(tail) and height.isdigit() and int(height) > rows
                    and hit.get("rows") == rows):
                return hit
        return None

    def get(self, m: int, n: int, k: int, bias: bool, dtype: torch.dtype = torch.float32) -> str | None:
        hit = self.entry(m, n, k, bias, dtype)
        return hit["kernel"] if hit else None

    def put(self, m: int, n: int, k: int, bias: bool, result: dict[str, Any],
            dtype: torch.dtype = torch.float32) -> None:
        self.put_entry(shape_key(m, n, k, bias, dtype), result)

    def put_entry(self, key: str, result: dict[str, Any]) -> None:
        """Keep a measured choice under ``key`` (GEMM shapes, attention slice budgets) and save."""
        self.shapes[key] = result
        self.save()

    def save(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".calibration-", suffix=".json")
            with os.fdopen(fd, "w") as f:
                json.dump({"key": self.key, "shapes": self.shapes}, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)
        except OSError:  # a read-only home still runs, measuring again next time
            pass


_TABLES: dict[tuple[tuple[str | None, ...], int], Table] = {}


def table(threads: int | None = None) -> Table:
    """The table for this machine at the current (or given) thread count (cheap: called on every linear)."""
    threads = threads if threads is not None else torch.get_num_threads()
    # keyed by what decides the folder, not the folder: building paths on every linear cost ~3% of a
    # batch-1 ViT forward
    where_key = (settings.location_key(), threads)
    t = _TABLES.get(where_key)
    if t is None:
        key = machine_key(threads)
        t = _TABLES[where_key] = Table(key, cache_dir() / f"{key_digest(key)}.json")
    return t


def forget() -> None:
    """Drop the in-memory tables (the files stay) and every linear's remembered decision: the next call
    reads the settings and the cache directory again."""
    _TABLES.clear()
    forget_decisions()


# this process's decisions of kernels not tied to a weight (plain attention), by table key: one lookup a call
DECIDED: dict[str, str] = {}


def forget_decisions() -> None:
    """Drop every remembered decision: each linear and attention decides (and is recorded) afresh at its
    next call."""
    WEIGHTS.clear("decision")
    WEIGHTS.clear("int8-decision")
    WEIGHTS.clear("gelu-way")
    DECIDED.clear()


def reset() -> list[Path]:
    """Delete every cached calibration file; returns what was deleted."""
    gone = []
    d = cache_dir()
    if d.is_dir():
        for p in d.glob("*.json"):
            p.unlink(missing_ok=True)
            gone.append(p)
    forget()
    return gone


class Recorder:
    """The calibration keys (GEMM shapes, attention problems) that kernels looked up while it was open,
    in first-use order."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def note(self, key: str) -> None:
        if key not in self.seen:
            self.seen.append(key)


_RECORDERS: list[Recorder] = []


@contextlib.contextmanager
def recording() -> Iterator[Recorder]:
    """A recorder that keeps every calibration key looked up inside the ``with`` block."""
    recorder = Recorder()
    _RECORDERS.append(recorder)
    try:
        yield recorder
    finally:
        _RECORDERS.remove(recorder)


def note(key: str) -> None:
    """A kernel looked up ``key`` in the table (measured or not): every open recorder keeps it."""
    for recorder in _RECORDERS:
        recorder.note(key)


class Watch:
    """How many new shapes (GEMMs, GELU placements, int8 choices, attention problems) this process measured
    while the watch was open: a first call on a new CPU, model or batch size spends a few seconds per shape
    measuring (SAM ViT-B's first ``kestrel segment`` on a 2-core AMD EPYC: 33 s, 11 s after), which the command
    line says rather than sit silent. ``on_first()`` runs before the first measurement."""

    def __init__(self, on_first: Callable[[], None]) -> None:
        self.on_first = on_first
        self.shapes = 0

    def measuring(self) -> None:
        if self.shapes == 0:
            self.on_first()
        self.shapes += 1


_WATCHES: list[Watch] = []


@contextlib.contextmanager
def watching(on_first: Callable[[], None]) -> Iterator[Watch]:
    """A :class:`Watch` open for the ``with`` block."""
    watch = Watch(on_first)
    _WATCHES.append(watch)
    try:
        yield watch
    finally:
        _WATCHES.remove(watch)


def measuring() -> None:
    """A kernel is about to time a new shape (every race calls this first): the open watches count it."""
    for watch in _WATCHES:
        watch.measuring()


def calibrate_model(call: Callable[[], Any]) -> list[tuple[str, dict[str, Any]]]:
    """Run ``call`` once (a model entry on example inputs) so every GEMM shape it uses is measured.

    Returns the shapes the call used with their entries, in first-use order.
    """
    forget_decisions()  # every linear decides (and is recorded) afresh
    with recording() as recorder, torch.inference_mode():
        call()
    t = table()
    unmeasured = {"kernel": settings.linear_kernel() or library.DEFAULT, "gflops": {}}
    defaults = {"int8 ": {"kernel": "int8", "gflops": {}}, "sdpa ": {"kernel": "fused"},
                "folded ": {"kernel": "projected"}}
    return [(s, t.shapes.get(s, next((d for p, d in defaults.items() if s.startswith(p)), unmeasured)))
            for s in recorder.seen]


def format_seconds(entry: dict[str, Any]) -> str:
    """A timed choice's candidates and their seconds (``fused 0.012 s, gemm 0.010 s``), "" when untimed."""
    return ", ".join(f"{c} {t:.4g} s" for c, t in entry.get("seconds", {}).items())


def format_choices(rows: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """One line per shape: the chosen kernel and every candidate's measured rate."""
    names = list(library.KERNELS)
    head = f"  {'GEMM M x N x K':<22} {'chosen':<13} " + " ".join(f"{n:>13}" for n in names) + "  (GFLOP/s)"
    out = [head]
    for s, r in rows:
        if s.startswith(("sdpa ", "folded ")):  # plain attention: fused kernel or two GEMMs; attention with its
            times = format_seconds(r)  # projections: projected or folded (seconds per candidate)
            default = "fused" if s.startswith("sdpa ") else "projected"
            out.append(f"  {s:<34} {r.get('kernel', default)}" + (f"  ({times})" if times else ""))
            continue
        if s.startswith("attention "):  # a slice budget: seconds per candidate
            times = format_seconds(r)
            chosen = f"{int(r['kernel']) >> 20} MB slices" if str(r.get("kernel", "")).isdigit() else "-"
            out.append(f"  {s:<34} {chosen}" + (f"  ({times})" if times else ""))
            continue
        if s.startswith("onnxruntime "):  # a whole entry at one signature: eager or its onnxruntime program
            times = format_seconds(r)
            why = r.get("rejected") or times
            out.append(f"  {s}: {r.get('kernel', 'eager')}" + (f"  ({why})" if why else ""))
            continue
        if s.startswith("rate "):  # a half-precision dtype's GEMM rate beside f32's (kernels.half)
            rates = ", ".join(f"{nm} {v:.1f}" for nm, v in r.get("gflops", {}).items())
            out.append(f"  {s:<27} {r.get('n', '?')}^3 GEMM: {rates} GFLOP/s")
            continue
        if s.startswith("int8 "):  # int8 raced against this shape's f32 kernel
            rates = ", ".join(f"{nm} {v:.1f}" for nm, v in r.get("gflops", {}).items())
            out.append(f"  {s:<27} {r['kernel']:<11}" + (f"  ({rates} GFLOP/s)" if rates else ""))
            continue
        rates = r.get("gflops", {})
        cells = " ".join(f"{rates[n]:>13.1f}" if n in rates else f"{'-':>13}" for n in names)
        why = ""
        if r.get("rejected"):
            why = "  rejected: " + "; ".join(f"{k} {v}" for k, v in r["rejected"].items())
        if not rates:
            why = "  (not measured: small, forced or calibration off)"
        out.append(f"  {s:<22} {r.get('kernel', '-'):<13} {cells}{why}")
        gelu = r.get("gelu_tanh", {}).get(r.get("kernel"), {})
        if "way" in gelu:  # where this shape's tanh GELU runs (kernels.gemm.measure_gelu)
            times = ", ".join(f"{w} {t:.3g}" for w, t in gelu.get("ms", {}).items())
            out.append(f"  {'':<22} tanh GELU: {gelu['way']}" + (f"  ({times} ms)" if times else ""))
    return out
