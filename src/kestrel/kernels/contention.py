"""How much of the machine other processes took while something ran: a measurement taken while they
competed for the cores is not a measurement of this machine's kernels.

Read from ``/proc/stat`` (every CPU's busy time) minus this process's own CPU time; elsewhere unknown.
The calibration uses it to refuse to keep a disturbed choice (:mod:`kestrel.kernels.gemm`), ``kestrel
bench`` and ``kestrel doctor`` to print it beside their timings.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

R = TypeVar("R")

# a share of the machine's CPU time above this, taken by others while measuring, disturbs the measurement
# (with 2 threads on 2 cores, one busy core can slow a GEMM by far more than half)
DISTURBED = 0.15


def _machine_busy() -> tuple[float, float] | None:
    """(busy, total) CPU seconds of the whole machine since boot, or None where /proc/stat is not readable."""
    try:
        fields = [float(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle and iowait
    tick = os.sysconf("SC_CLK_TCK")
    return (sum(fields) - idle) / tick, sum(fields) / tick


def others_share(fn: Callable[[], R], min_seconds: float = 0.02) -> tuple[R, float | None]:
    """Run ``fn``; return its result and the share of the machine's CPU time (0 to 1) that other processes
    used meanwhile. None when it cannot tell: no ``/proc/stat``, or too short a run to count clock ticks."""
    before, own0 = _machine_busy(), time.process_time()
    out = fn()
    after, own1 = _machine_busy(), time.process_time()
    if before is None or after is None or after[1] - before[1] < min_seconds:
        return out, None
    busy = after[0] - before[0] - (own1 - own0)
    return out, max(0.0, min(1.0, busy / (after[1] - before[1])))


def note_load(entry: dict[str, Any], others: float | None) -> dict[str, Any]:
    """Record in a calibration ``entry`` the share of the machine others took while measuring; above DISTURBED
    the choice is marked: it serves this process, and the next one measures again (calibration.Table)."""
    if others is not None:
        entry["others"] = round(others, 3)
        if others > DISTURBED:
            entry["disturbed"] = True
    return entry
