"""Kestrel's own cache folder: ``$KESTREL_CACHE_DIR``, else ``$XDG_CACHE_HOME/kestrel``, else
``~/.cache/kestrel`` (read at call time, so tests and users can point it elsewhere)."""

from __future__ import annotations

import os
from pathlib import Path

# the environment variables that decide the folder, in the order cache_dir consults them
LOCATION_VARIABLES = ("KESTREL_CACHE_DIR", "XDG_CACHE_HOME", "HOME")


def location_key() -> tuple[str | None, ...]:
    """What decides :func:`cache_dir`'s answer, read without building a path: a key for callers
    that keep per-folder state and ask on every call (the GEMM calibration table)."""
    return tuple(os.environ.get(name) for name in LOCATION_VARIABLES)


def cache_dir(*parts: str) -> Path:
    """The cache folder, or a sub-folder of it (``cache_dir("edge")``); not created here."""
    if os.environ.get("KESTREL_CACHE_DIR"):
        root = Path(os.environ["KESTREL_CACHE_DIR"]).expanduser()
    elif os.environ.get("XDG_CACHE_HOME"):
        root = Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "kestrel"
    else:
        root = Path("~/.cache/kestrel").expanduser()
    return root.joinpath(*parts)
