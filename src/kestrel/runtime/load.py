"""``kestrel.load``: a card name or a ``save_pretrained`` directory to a bound, weighted model.

The order matters: resolve the files, read ``config.json``, bind the generics, check every
safetensors header against the parameter manifest (names, shapes, dtypes, no tensor read), and
only then read the tensors.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..blocks import Block
from ..blocks.block import bind_generics, parameter_manifest
from ..models.cards import CARDS, Card, CardError, Family, family_for_config
from ..types.dtypes import DType, dtype_named
from .checkpoint import CheckpointError, Expected, load_tensors, plan_load, read_headers, safetensors_dtype
from .hub import fetch


@dataclass
class Loaded:
    """Where a bound model came from: its card (if any), directory, config and bindings."""

    family: Family
    directory: Path
    config: dict[str, Any]
    generics: dict[str, Any]
    card: Card | None = None
    unused: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.card.name if self.card else self.directory.name

    @property
    def labels(self) -> dict[int, str]:
        """The classifier's ``id2label``, keys as ints."""
        return {int(k): v for k, v in (self.config.get("id2label") or {}).items()}


def resolve(name_or_dir: str | os.PathLike[str], weights: str | os.PathLike[str] | None = None,
            revision: str | None = None) -> tuple[Path, Card | None]:
    """A card name (fetched from the hub at its pinned revision, or read from ``weights``) or a directory."""
    path = Path(name_or_dir)
    if weights is not None:
        card = CARDS.get(str(name_or_dir))
        return Path(weights), card
    if str(name_or_dir) in CARDS:
        card = CARDS[str(name_or_dir)]
        return fetch(card.repo, revision or card.revision, card.files), card
    if path.is_dir():
        return path, None
    if path.exists():
        raise CardError(f"{path} is a file; give the checkpoint directory (with config.json and *.safetensors)")
    known = ", ".join(sorted(CARDS))
    raise CardError(f"unknown model {str(name_or_dir)!r}: not a directory and not one of {known}")


def read_config(directory: Path) -> dict[str, Any]:
    cfg_path = directory / "config.json"
    if not cfg_path.is_file():
        raise CardError(f"{directory} has no config.json: is it a save_pretrained directory?")
    try:
        return json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CardError(f"{cfg_path} is not valid JSON: {e}") from None


def load(name_or_dir: str | os.PathLike[str], *, weights: str | os.PathLike[str] | None = None,
         dtype: str | torch.dtype | DType = "f32", device: str | torch.device = "cpu",
         revision: str | None = None, **generics: Any) -> Block:
    """Load a model: a card name (``"dinov2-base"``) or a ``save_pretrained`` directory.

    ``weights=DIR`` reads a card's files from a local directory instead of the hub. Extra keyword
    arguments rebind the generics a family allows (``Height=224, Width=224`` for DINOv2).
    The returned module's entries are its methods (``forward``, ``features``...); ``model.loaded``
    says where it came from.
    """
    directory, card = resolve(name_or_dir, weights, revision)
    config = read_config(directory)
    family = family_for_config(config, directory)
    if card is not None and card.family is not family:
        raise CardError(f"{directory}: config.json is a {config.get('model_type')!r} model, but {card.name} is a "
                        f"{card.family.name} card")
    bound = _bind(family, config, dtype, generics, directory)
    root = family.root(config)
    model = _build(root, family, config, bound, directory)
    model.configure(**family.settings(config))
    model.loaded = Loaded(family, directory, config, bound, card)  # type: ignore[assignment]
    model.requires_grad_(False)  # an inference model; call requires_grad_(True) to fine-tune
    return model.eval().to(device)


def _bind(family: Family, config: dict, dtype: Any, overrides: dict[str, Any], directory: Path) -> dict[str, Any]:
    try:
        bound = family.generics(config)
    except (KeyError, TypeError, ValueError) as e:
        raise CardError(f"{directory}/config.json does not describe a {family.name} model: {e}") from None
    bad = [k for k in overrides if k not in family.resizable]
    if bad:
        allowed = ", ".join(family.resizable) or "none"
        raise CardError(f"{family.name} cannot rebind {', '.join(bad)} at load (rebindable: {allowed})")
    if overrides and family.rebind is not None:
        try:
            bound = family.rebind(config, overrides)
        except (KeyError, TypeError, ValueError) as e:
            raise CardError(f"{family.name} at {overrides}: {e}") from None
    bound.update(overrides)
    bound["T"] = dtype_named(dtype) if isinstance(dtype, str) else dtype
    return bound


def _build(root: type[Block], family: Family, config: dict, bound: dict[str, Any], directory: Path) -> Block:
    bind_generics(root.decl(), bound)  # a clear error for bad generics before any file is read
    transforms = family.transforms(config, bound)
    expected: dict[str, Expected] = {}
    for path, shape, dt, optional in parameter_manifest(root, bound):
        native = transforms[path][0] if path in transforms else shape
        expected[path] = Expected(native, safetensors_dtype(dt.torch), optional)
    headers = read_headers(directory)
    plan = plan_load(headers, expected, family.bindings(config))
    with torch.device("meta"):
        model = root(**bound)
    tensors = load_tensors(plan, dtype=bound["T"].torch)
    for path, (_, transform) in transforms.items():
        if path in tensors:
            tensors[path] = transform(tensors[path], bound)
    for path, exp in expected.items():
        if path not in tensors and exp.optional:
            model.drop_optional(path)
    missing = model.load_state_dict(tensors, strict=False, assign=True)
    if missing.missing_keys or missing.unexpected_keys:  # plan_load makes this unreachable; keep it loud
        raise CheckpointError(f"internal: unbound {missing.missing_keys} / unexpected {missing.unexpected_keys}")
    return model


def from_config(config: dict[str, Any], dtype: str = "f32", **generics: Any) -> Block:
    """An unweighted model (uninitialised parameters) bound from a config dict: for shapes and tests."""
    family = family_for_config(config, Path("<config>"))
    bound = _bind(family, config, dtype, generics, Path("<config>"))
    model = family.root(config)(**bound)
    model.configure(**family.settings(config))
    return model
