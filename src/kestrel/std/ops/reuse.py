"""Reuse: a sub's result kept for an input that comes back unchanged."""

from __future__ import annotations

from typing import Any

import torch

from ... import kernels


def kept(sub: Any, x: Any) -> Any:
    """``sub(x)``, kept while the same ``x`` comes back unchanged (the same tensor, not written to, the sub's
    parameters unchanged), for work that depends on one input of many calls alone: SAM 2.1's decoder projects
    the image's high-resolution features on every prompt (:func:`kestrel.kernels.kept_for_input`). ``sub``
    must read nothing but ``x`` and its own parameters, and the result must not be written to.

    The checker sees ``sub(x)``: the type is the sub's, and graphs, exports and autograd run it every time.
    """
    if isinstance(x, torch.Tensor) and isinstance(sub, torch.nn.Module):
        return kernels.kept_for_input(sub, x)
    return sub(x)
