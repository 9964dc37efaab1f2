"""The compiled path: every entry of a loaded model under ``torch.compile``, kept only where it pays.

Static shapes (``dynamic=False``: one graph per input shape, recompiled when a shape changes) and
inductor's freezing (weights folded into the graph as constants and pre-packed for the GEMM
library inductor picks). Calls run under ``torch.no_grad`` (freezing needs it). Entry inputs
are still checked against the declared types before either path runs.

A compiled graph is not faster everywhere: on one machine it won on SAM's encoder and at batch 8 and
lost on ViT-B at batch 1. So the first call of an entry with a new input signature compiles, then
times the compiled graph against Kestrel eager on the same inputs (``TRIALS`` calls each,
interleaved) and runs the faster one for that signature from then on. ``model.compile_choices``
says what was chosen and the times behind it; ``KESTREL_COMPILED=always`` skips the race.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import torch

from ..blocks import Block
from ..blocks.block import check_entry_inputs
from ..kernels import settings
from .examples import entry_names
from .race import best_times, call_signature

TRIALS = 2  # timed calls of each path after compiling (the best of each is compared)
_INSIDE_EAGER = threading.local()  # an eager entry calling another entry stays eager


def _eager_call(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        outer = getattr(_INSIDE_EAGER, "on", False)
        _INSIDE_EAGER.on = True
        try:
            return fn(*args, **kwargs)
        finally:
            _INSIDE_EAGER.on = outer
    return run


def race(compiled: Callable[..., Any], eager: Callable[..., Any], args: tuple[Any, ...],
         kwargs: dict[str, Any], trials: int = TRIALS) -> dict[str, Any]:
    """Time both paths on these inputs, interleaved; the faster one's name and every best time (s)."""
    best = best_times({"compiled": compiled, "eager": eager}, args, kwargs, trials)
    path = "compiled" if best["compiled"] <= best["eager"] else "eager"
    return {"path": path, "compiled_s": round(best["compiled"], 6), "eager_s": round(best["eager"], 6)}


def compile_entries(model: Block, freezing: bool = True) -> Block:
    """Replace each entry method of ``model`` (on the instance) with a compiled-or-eager inference call."""
    always = settings.compiled_always()
    choices: dict[str, dict[str, dict[str, Any]]] = {}
    for name in entry_names(model):
        plain = getattr(model, name)
        eager = _eager_call(plain)
        compiled = torch.compile(plain, dynamic=False, options={"freezing": freezing})
        chosen = choices.setdefault(name, {})

        @functools.wraps(plain)
        def call(*args: Any, _compiled: Any = compiled, _eager: Any = eager, _chosen: Any = chosen,
                 **kwargs: Any) -> Any:
            if torch.compiler.is_compiling() or getattr(_INSIDE_EAGER, "on", False):
                return _eager(*args, **kwargs)  # an entry calling another: inline it in the caller's path
            check_entry_inputs(model, type(model).decl().function(_eager.__name__), args, kwargs)
            key = call_signature(args, kwargs)
            with torch.no_grad():
                choice = _chosen.get(key)
                if choice is None:
                    out = _compiled(*args, **kwargs)  # compiles for this signature
                    _chosen[key] = {"path": "compiled"} if always else race(_compiled, _eager, args, kwargs)
                    return out
                return (_compiled if choice["path"] == "compiled" else _eager)(*args, **kwargs)

        setattr(model, name, call)
    model.compiled = True  # type: ignore[assignment]
    model.compile_choices = choices  # type: ignore[assignment]
    return model
