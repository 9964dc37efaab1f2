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


def best_times(paths: dict[str, Callable[..., Any]], args: tuple[Any, ...], kwargs: dict[str, Any],
               trials: int, calls: int = 1) -> dict[str, float]:
    """The best wall time (s) of each path over ``trials`` rounds, the order of the paths reversed every
    other round. Each round runs a path ``calls`` times in a row and keeps the last: a runtime whose
    threads still spin after a call (onnxruntime) then slows only its own first call, not the next path's."""
    best = dict.fromkeys(paths, float("inf"))
    names = list(paths)
    for r in range(trials):
        for name in (names if r % 2 == 0 else names[::-1]):
            for _ in range(calls):
                t = time.perf_counter()
                paths[name](*args, **kwargs)
                elapsed = time.perf_counter() - t
            best[name] = min(best[name], elapsed)
    return best
