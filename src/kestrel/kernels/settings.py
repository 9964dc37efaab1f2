"""Every environment variable Kestrel reads, read here and nowhere else.

Each setting is read at call time (tests and users may change the environment between calls) and a
value Kestrel cannot use is a :class:`SettingError` naming the variable, the value and what it takes.

================================  ================================================================
``KESTREL_LINEAR``                force one GEMM kernel (``torch``, ``onednn``, ``onednn-packed``, ``mkl-packed``,
                                  ``auto``)
``KESTREL_ONEDNN=0``              the older spelling of ``KESTREL_LINEAR=torch``
``KESTREL_CALIBRATE=0``           measure no new shape (unseen shapes take torch's default)
``KESTREL_CALIBRATION_BUDGET``    seconds one shape's kernel race may take (default 0.4; ``0``: its fewest rounds)
``KESTREL_WEIGHT_COPIES=1``       kernels may keep a re-laid-out second copy of any weight
``KESTREL_ATTENTION_BUDGET``      bytes of attention scores per slice (else measured per shape)
``KESTREL_FOLD``                  ``0``: attention never folds its projections into its few tokens' side;
                                  ``always``: it folds wherever it can, unmeasured (default ``auto``: measured)
``KESTREL_MALLOC=system``         leave glibc's allocator thresholds as they are
``KESTREL_COMPILED=always``       compiled entries skip the race against eager
``KESTREL_ONNXRUNTIME``           ``0``: entries never run on onnxruntime (the table's choices ignored, no race);
                                  ``always``: a race keeps onnxruntime whenever it is accurate, faster or not
``KESTREL_CACHE_DIR``             Kestrel's cache folder (else ``$XDG_CACHE_HOME/kestrel``, ``~/.cache/kestrel``)
``KESTREL_MAX_PIXELS``            the pixel limit of a decoded image and of every resize target
``KESTREL_HUB_TIMEOUT``           seconds for the one try to reach the Hub (default 5)
``KESTREL_DEBUG=1``               the command line shows tracebacks
``KESTREL_ORT_DIR``               onnxruntime-web's ``dist`` folder for ``kestrel serve``
================================  ================================================================
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import UsageError


class SettingError(UsageError):
    """An environment variable set to a value Kestrel cannot use."""


def _raw(name: str) -> str:
    return os.environ.get(name, "").strip()


def linear_kernel() -> str | None:
    """The GEMM kernel name ``KESTREL_LINEAR`` forces (``KESTREL_ONEDNN=0`` means ``torch``), or None for auto.
    The name is not checked here: :func:`kestrel.kernels.gemm.forced` knows which kernels exist."""
    name = _raw("KESTREL_LINEAR")
    if not name and os.environ.get("KESTREL_ONEDNN") == "0":
        return "torch"
    return None if not name or name == "auto" else name


def weight_copies() -> bool:
    """``KESTREL_WEIGHT_COPIES=1``: kernels may keep a re-laid-out copy of weights that cannot be handed back."""
    return os.environ.get("KESTREL_WEIGHT_COPIES", "0") == "1"


def calibrate() -> bool:
    """Whether new shapes are measured (``KESTREL_CALIBRATE=0`` turns it off)."""
    return os.environ.get("KESTREL_CALIBRATE", "1") != "0"


DEFAULT_CALIBRATION_BUDGET_S = 0.4


def calibration_budget() -> float:
    """Seconds one shape's kernel race may take (``KESTREL_CALIBRATION_BUDGET``, default 0.4; a close race up to
    three budgets). A race always runs its fewest rounds; a budget under the default also times fewer weight
    copies per pass, so ``0`` (the test suite's) is the cheapest race: every candidate, one copy, three rounds."""
    value = _raw("KESTREL_CALIBRATION_BUDGET")
    if not value:
        return DEFAULT_CALIBRATION_BUDGET_S
    try:
        budget = float(value)
    except ValueError:
        budget = -1.0
    if not 0.0 <= budget < float("inf"):
        raise SettingError(f"KESTREL_CALIBRATION_BUDGET={value!r}: expected seconds per shape, 0 or more "
                           f"(e.g. 0.4, the default), or unset")
    return budget


def attention_budget() -> int | None:
    """The slice budget ``KESTREL_ATTENTION_BUDGET`` fixes (bytes), or None when it is unset."""
    value = _raw("KESTREL_ATTENTION_BUDGET")
    if not value:
        return None
    if not value.isdigit() or int(value) <= 0:
        raise SettingError(f"KESTREL_ATTENTION_BUDGET={value!r}: expected a positive number of bytes "
                           f"(e.g. {16 << 20} for 16 MB slices), or unset to measure the best")
    return int(value)


FOLD_MODES = ("auto", "0", "always")


def fold_attention() -> str:
    """``KESTREL_FOLD``: ``auto`` (default: an attention with few tokens on one side folds its projections into that
    side where its first call measured the fold faster), ``0`` (never) or ``always`` (wherever the fold can run,
    without measuring: what tests use to compare it with the reference)."""
    value = _raw("KESTREL_FOLD").lower() or "auto"
    if value not in FOLD_MODES:
        raise SettingError(f"KESTREL_FOLD={value!r}: expected 0 (never fold), auto (the default: measured) or always")
    return value


def validate() -> None:
    """Read every setting whose value can be wrong (``SettingError`` for the first that is): a command checks them
    before it starts, rather than failing minutes in, when a kernel first reads one."""
    calibration_budget()
    attention_budget()
    fold_attention()
    onnxruntime_entries()


def system_malloc() -> bool:
    """``KESTREL_MALLOC=system``: leave the C library's allocator as it is."""
    return _raw("KESTREL_MALLOC").lower() == "system"


def compiled_always() -> bool:
    """``KESTREL_COMPILED=always``: compiled entries run compiled without racing eager."""
    return os.environ.get("KESTREL_COMPILED", "") == "always"


ONNXRUNTIME_MODES = ("auto", "0", "always")


def onnxruntime_entries() -> str:
    """``KESTREL_ONNXRUNTIME``: ``auto`` (default: an entry runs on onnxruntime where a race chose it), ``0``
    (never) or ``always`` (a race chooses onnxruntime whenever its outputs are accurate)."""
    value = _raw("KESTREL_ONNXRUNTIME").lower() or "auto"
    if value in ("1", "on"):
        value = "auto"
    if value not in ONNXRUNTIME_MODES:
        raise SettingError(f"KESTREL_ONNXRUNTIME={value!r}: expected 0 (off), auto (the default) or always")
    return value


def debug() -> bool:
    """``KESTREL_DEBUG``: the command line shows tracebacks (any value but empty, 0, false, no, off)."""
    return _raw("KESTREL_DEBUG").lower() not in ("", "0", "false", "no", "off")


def max_pixels(default: int) -> int:
    """``KESTREL_MAX_PIXELS`` (a positive integer), else ``default``."""
    value = _raw("KESTREL_MAX_PIXELS")
    if not value:
        return default
    try:
        limit = int(value)
    except ValueError:
        limit = 0
    if limit < 1:
        raise SettingError(f"KESTREL_MAX_PIXELS must be a positive integer, got {value!r}")
    return limit


def hub_timeout(default: float) -> float:
    """``KESTREL_HUB_TIMEOUT`` in seconds, else ``default`` (also for a value that is no positive number)."""
    try:
        value = float(_raw("KESTREL_HUB_TIMEOUT") or default)
    except ValueError:
        return default
    return value if value > 0 else default


def ort_dir() -> Path | None:
    """``KESTREL_ORT_DIR``: onnxruntime-web's ``dist`` folder, when set."""
    value = os.environ.get("KESTREL_ORT_DIR")
    return Path(value) if value else None


# the environment variables that decide the cache folder, in the order cache_dir consults them
LOCATION_VARIABLES = ("KESTREL_CACHE_DIR", "XDG_CACHE_HOME", "HOME")


def location_key() -> tuple[str | None, ...]:
    """What decides :func:`cache_dir`'s answer, read without building a path: a key for callers
    that keep per-folder state and ask on every call (the GEMM calibration table)."""
    return tuple(os.environ.get(name) for name in LOCATION_VARIABLES)


def cache_dir(*parts: str) -> Path:
    """Kestrel's cache folder, or a sub-folder of it (``cache_dir("edge")``); not created here:
    ``$KESTREL_CACHE_DIR``, else ``$XDG_CACHE_HOME/kestrel``, else ``~/.cache/kestrel``."""
    if os.environ.get("KESTREL_CACHE_DIR"):
        root = Path(os.environ["KESTREL_CACHE_DIR"]).expanduser()
    elif os.environ.get("XDG_CACHE_HOME"):
        root = Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "kestrel"
    else:
        root = Path("~/.cache/kestrel").expanduser()
    return root.joinpath(*parts)
