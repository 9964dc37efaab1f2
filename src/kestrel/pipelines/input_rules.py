"""The rules every entry point applies to inputs checked against the model, in one place.

The Python API, the ``kestrel`` command, dataset jobs and the browser page's server all call these
functions, and the page reads the same numbers from :func:`as_json` (served as ``/rules.json``), so a
prompt or a size is accepted or refused the same way everywhere.

**Prompts outside the image are refused** (not clipped): a point must lie in ``0 <= x <= width`` and
``0 <= y <= height``, a box's corners too, in pixels of the original image. Clipping would move a click
the user did not make, and a click off the photo is almost always a mix-up of images or of ``x`` and
``y``. Points labelled ``-10`` (padding) and ``-1`` (not a point) carry no position and are exempt.

**Sizes a model cannot take are refused**, never rounded: a ViT/DINOv2 size must be a whole number of
patches; a SAM 2 size a multiple of 32; a model bound at its checkpoint's size takes no other size; an
export is bound at the size it was exported at. The rule lives in :mod:`kestrel.runtime.sizes` (so that
``kestrel.load(..., Height=50)`` applies it too) and is re-exported here.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from ..errors import KestrelError
from ..runtime.sizes import SAM2_SIZE_MULTIPLE, override_problem, size_problem

PROMPT_POLICY = "refuse"  # "refuse": a prompt outside the image is an error (see the module docstring)
POSITIONLESS_LABELS = frozenset({-1, -10})

__all__ = ["PROMPT_POLICY", "SAM2_SIZE_MULTIPLE", "InputRuleError", "as_json", "check_export_size",
           "check_prompts_inside", "override_problem", "prompt_outside", "size_problem"]


class InputRuleError(KestrelError, ValueError):
    """An input that does not fit the model or the image: a prompt outside it, a size it cannot take."""


def prompt_outside(points: Sequence[Sequence[float]], labels: Sequence[int], box: Sequence[float] | None,
                   width: int, height: int) -> str | None:
    """Why a prompt (points, labels, optional box) does not lie inside a ``width x height`` image, or None."""
    for i, (p, label) in enumerate(zip(points, labels)):
        if label in POSITIONLESS_LABELS:
            continue
        x, y = float(p[0]), float(p[1])
        if not (math.isfinite(x) and math.isfinite(y) and 0 <= x <= width and 0 <= y <= height):
            return (f"point {i} ({x:g}, {y:g}) lies outside the {width} x {height} image "
                    f"(x from 0 to {width}, y from 0 to {height})")
    if box is not None:
        x0, y0, x1, y1 = (float(v) for v in box)
        if not all(math.isfinite(v) for v in (x0, y0, x1, y1)) or min(x0, y0) < 0 or x1 > width or y1 > height:
            return (f"box ({x0:g}, {y0:g}, {x1:g}, {y1:g}) reaches outside the {width} x {height} image "
                    f"(x from 0 to {width}, y from 0 to {height})")
    return None


def check_prompts_inside(prompts: Iterable[Any], width: int, height: int, name: str = "prompt") -> None:
    """Raise :class:`InputRuleError` for the first prompt (``.points``, ``.labels``, ``.box``) outside the image."""
    for k, prompt in enumerate(prompts):
        reason = prompt_outside(prompt.points, prompt.labels, prompt.box, width, height)
        if reason is not None:
            raise InputRuleError(f"{name} {k}: {reason}; prompts are in pixels of the photo and must lie inside it")


def check_export_size(export_size: int, size: int | None, where: str = "the export") -> int:
    """The size to run an export at: ``size`` if given and equal to the export's, else the export's own."""
    if size is not None and size != export_size:
        raise InputRuleError(f"--size {size}: {where} is bound at {export_size} px (its encoder takes "
                             f"[1, 3, {export_size}, {export_size}]); drop --size or export again at {size}")
    return export_size


def as_json() -> dict[str, Any]:
    """The rules as data, for the browser page (served as ``/rules.json``)."""
    from .images import MAX_PIXELS, max_pixels

    return {"prompt_outside_image": PROMPT_POLICY, "positionless_labels": sorted(POSITIONLESS_LABELS),
            "max_pixels": max_pixels(), "default_max_pixels": MAX_PIXELS,
            "sam2_size_multiple": SAM2_SIZE_MULTIPLE,
            "prompt_bounds": "0 <= x <= width and 0 <= y <= height, in pixels of the original image"}
