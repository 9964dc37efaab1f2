"""The compiled path: every entry of a loaded model under ``torch.compile``.

Static shapes (``dynamic=False``: one graph per input shape, recompiled when a shape changes) and
inductor's freezing (weights folded into the graph as constants and pre-packed for the GEMM
library inductor picks). Calls run under ``torch.no_grad`` (freezing needs it). Entry inputs
are still checked against the declared types before the compiled graph runs.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from ..blocks import Block
from ..blocks.block import check_entry_inputs
from .examples import entry_names


def compile_entries(model: Block, freezing: bool = True) -> Block:
    """Replace each entry method of ``model`` (on the instance) with a compiled, inference-mode call."""
    for name in entry_names(model):
        eager = getattr(model, name)
        compiled = torch.compile(eager, dynamic=False, options={"freezing": freezing})

        @functools.wraps(eager)
        def call(*args: Any, _compiled: Any = compiled, _eager: Any = eager, **kwargs: Any) -> Any:
            if torch.compiler.is_compiling():  # an entry calling another: inline it in the caller's graph
                return _eager(*args, **kwargs)
            check_entry_inputs(model, type(model).decl().function(_eager.__name__), args, kwargs)
            with torch.no_grad():
                return _compiled(*args, **kwargs)

        setattr(model, name, call)
    model.compiled = True  # type: ignore[assignment]
    return model
