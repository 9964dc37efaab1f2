"""Timing two ways of running one entry against each other, on the same inputs, interleaved.

Used where a model chooses between paths per input signature: the compiled path
(:mod:`kestrel.runtime.compiled`) and onnxruntime entries (:mod:`kestrel.runtime.onnxruntime_entries`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from ..types.dtypes import from_torch


def call_signature(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """What a static-shape program is specialised on: each tensor's shape and dtype, other values as given."""
    def one(v: Any) -> str:
        if isinstance(v, torch.Tensor):
            try:
                dtype = str(from_torch(v.dtype))
            except TypeError:
                dtype = str(v.dtype).removeprefix("torch.")
            return f"{dtype}{list(v.shape)}"
        return repr(v)
    return ", ".join([*(one(a) for a in args), *(f"{k}={one(v)}" for k, v in sorted(kwargs.items()))])


# idle time before each path's calls in a round. onnxruntime's worker threads spin for ~50 ms after a run (its
# default), and torch's GEMMs run 3-6x slower meanwhile (one AMD EPYC, 2 threads: a 64 x 768 -> 3072 GEMM took
# 4-9.6 ms right after a run, 1.4 ms from 50 ms on), so a path timed right after it paid for its spinning
SETTLE_S = 0.1


def best_times(paths: dict[str, Callable[..., Any]], args: tuple[Any, ...], kwargs: dict[str, Any],
               trials: int, calls: int = 1) -> dict[str, float]:
    """The best wall time (s) of each path over ``trials`` rounds, the order of the paths reversed every
    other round. Each round waits :data:`SETTLE_S` before a path, for the threads of the one before to stop
    spinning, then runs it ``calls`` times in a row and keeps the last (its own threads warm)."""
    best = dict.fromkeys(paths, float("inf"))
    names = list(paths)
    for r in range(trials):
        for name in (names if r % 2 == 0 else names[::-1]):
            time.sleep(SETTLE_S)
            for _ in range(calls):
                t = time.perf_counter()
                paths[name](*args, **kwargs)
                elapsed = time.perf_counter() - t
            best[name] = min(best[name], elapsed)
    return best
