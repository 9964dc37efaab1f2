"""Cards: how a published checkpoint becomes a bound Kestrel program.

A :class:`Family` says, for one architecture family, which root block a ``config.json`` needs, how
the config binds the generics and settings, and how checkpoint tensor names bind parameter paths
(a :class:`Bindings` table of regular expressions). A :class:`Card` names one upstream checkpoint
of a family at a pinned revision.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ...blocks import Block
from ...errors import KestrelError
from ..capabilities import NONE, Capabilities

# ImageNet's channel statistics, which most vision checkpoints normalise with (the one place Kestrel writes them)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class CardError(KestrelError, ValueError):
    """A config or checkpoint that no card understands, or an unknown model name."""


@dataclass(frozen=True)
class Bindings:
    """Checkpoint tensor name -> parameter path, as ordered ``(pattern, template)`` rows.

    The first row whose pattern matches the whole name wins; its template may use the groups
    (``layers.\\1.up.\\2``). Names matching an ``unused`` pattern are deliberately left out.
    """

    rows: tuple[tuple[str, str], ...]
    unused: tuple[str, ...] = ()
    _compiled: list[tuple[re.Pattern[str], str]] = field(default_factory=list, compare=False, repr=False)

    def __post_init__(self) -> None:
        self._compiled.extend((re.compile(p), t) for p, t in self.rows)

    def __call__(self, name: str) -> str | None:
        for pattern, template in self._compiled:
            m = pattern.fullmatch(name)
            if m:
                return m.expand(template)
        if any(re.fullmatch(p, name) for p in self.unused):
            return None
        raise KeyError(name)


# A transform turns the checkpoint tensor into the parameter when the binding changes its shape
# (DINOv2's position table resampled to the bound image size). It receives the tensor and the
# bound generics and returns the parameter value.
Transform = Callable[[torch.Tensor, Mapping[str, Any]], torch.Tensor]


@dataclass(frozen=True)
class Family:
    """One architecture family: which root block a ``config.json`` needs and how it binds.

    ``root`` and ``bindings`` are functions of the config; a family whose every config uses the same
    root block or table may give the block or the table itself. ``model_types`` (the configs'
    ``model_type`` values it reads) defaults to the family's name.
    """

    name: str
    root: Callable[[dict], type[Block]]
    generics: Callable[[dict], dict[str, Any]]
    bindings: Callable[[dict], Bindings]
    model_types: tuple[str, ...] = ()
    settings: Callable[[dict], dict[str, Any]] = lambda cfg: {}
    # param path -> (native shape from the config, transform to the bound shape)
    transforms: Callable[[dict, dict[str, Any]], dict[str, tuple[tuple[int, ...], Transform]]] = (
        lambda cfg, generics: {}
    )
    # which generics a caller may rebind (e.g. Height/Width for DINOv2) and how
    resizable: tuple[str, ...] = ()
    # the generics bound from the config with a caller's rebinding, where others follow from it
    # (SAM 2's window paddings follow the image size); None: the rebinding replaces the generic alone
    rebind: Callable[[dict, dict[str, Any]], dict[str, Any]] | None = None
    # the checkpoint's preprocessor_config.json, used when a directory has none
    preprocess: dict[str, Any] = field(default_factory=dict)
    files: tuple[str, ...] = ("config.json", "model.safetensors", "model.safetensors.index.json",
                              "model-*.safetensors", "preprocessor_config.json")
    description: str = ""
    license: str = ""  # the upstream checkpoints' license (SPDX id)
    capabilities: Capabilities = NONE  # what the family serves: tasks, segmenter, export recipe, processor

    def __post_init__(self) -> None:
        if isinstance(self.root, type):
            object.__setattr__(self, "root", _constant(self.root))
        if isinstance(self.bindings, Bindings):
            object.__setattr__(self, "bindings", _constant(self.bindings))
        if not self.model_types:
            object.__setattr__(self, "model_types", (self.name,))


def _constant(value: Any) -> Callable[[dict], Any]:
    return lambda cfg: value


@dataclass(frozen=True, eq=False)
class Card:
    """One published checkpoint: ``facebook/dinov2-base`` at a pinned commit."""

    name: str
    family: Family
    repo: str
    revision: str
    title: str
    # the upstream config.json values the generics are bound from (so `inspect` works offline)
    config: dict[str, Any] = field(default_factory=dict)
    extra_files: tuple[str, ...] = ()

    def generics(self) -> dict[str, Any]:
        """The root block's generics as this checkpoint binds them (T = f32)."""
        return {**self.family.generics(self.config), "T": "f32"}

    @property
    def files(self) -> list[str]:
        return [*self.family.files, *self.extra_files]


def pair(v: Any) -> tuple[int, int]:
    """A config's ``image_size``/``patch_size``: an int, or a (height, width) pair."""
    if isinstance(v, int):
        return v, v
    a, b = v
    return int(a), int(b)
