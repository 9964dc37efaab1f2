"""Which image sizes a model can take: one rule for ``kestrel.load``, the CLI, dataset jobs and the page server.

A ViT-like model (rebindable ``Height``/``Width``) takes a size that is a whole number of patches; SAM 2
(rebindable ``E``, the embedding side, ``size = 16 E``) a multiple of 32 pixels; a model bound at its
checkpoint's size takes no other. A size that does not fit is refused, never rounded.
:mod:`kestrel.pipelines.input_rules` re-exports these for the layers above.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

SAM2_SIZE_MULTIPLE = 32

__all__ = ["SAM2_SIZE_MULTIPLE", "override_problem", "size_problem"]


def _neighbours(size: int, m: int) -> str:
    return f"e.g. {max(m, size // m * m)} or {(size // m + 1) * m}"


def size_problem(family: str, resizable: Iterable[str], generics: Mapping[str, Any], size: int,
                 model: str = "the model") -> str | None:
    """Why ``model`` (of ``family``) cannot run at ``size x size`` pixels (as ``--size`` says it), or None."""
    names = set(resizable)
    if size < 1:
        return f"--size {size}: a size is a positive number of pixels"
    if {"Height", "Width"} <= names:
        patch = generics.get("Patch")
        if isinstance(patch, int) and patch > 0 and size % patch:
            return (f"--size {size}: {model} cuts images into {patch} x {patch} patches, so the size must be a "
                    f"multiple of {patch} ({_neighbours(size, patch)})")
        return None
    if "E" in names:
        m = SAM2_SIZE_MULTIPLE
        if size % m:
            return (f"--size {size}: {model} ({family}) runs at a multiple of {m} px (1024 upstream, 512 the "
                    f"edge recipe; {_neighbours(size, m)})")
        return None
    return (f"--size {size}: {model} is a {family} model, which runs at its checkpoint's image size; "
            "it cannot be rebound to another size")


def override_problem(family: str, generics: Mapping[str, Any], overrides: Mapping[str, Any]) -> str | None:
    """Why ``kestrel.load(..., Height=..., Width=..., E=...)`` cannot bind these sizes, or None (same rule)."""
    patch = generics.get("Patch")
    for name in ("Height", "Width"):
        value = overrides.get(name)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            return f"{name}={value!r}: a size is a positive whole number of pixels"
        if isinstance(patch, int) and patch > 0 and value % patch:
            return (f"{name}={value}: {family} cuts images into {patch} x {patch} patches, so {name} must be a "
                    f"multiple of {patch} ({_neighbours(value, patch)})")
    e = overrides.get("E")
    if e is not None:
        if not isinstance(e, int) or isinstance(e, bool) or e < 1:
            return f"E={e!r}: the embedding side is a positive whole number"
        if (16 * e) % SAM2_SIZE_MULTIPLE:
            return (f"E={e}: {family} runs at a multiple of {SAM2_SIZE_MULTIPLE} px, so E = size / 16 must be even "
                    f"(E={e - 1} or {e + 1})")
    return None
