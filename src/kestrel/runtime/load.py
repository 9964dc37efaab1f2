"""``kestrel.load``: a card name or a ``save_pretrained`` directory to a bound, weighted model.

The order matters: resolve the files, read ``config.json``, bind the generics, check every
safetensors header against the parameter manifest (names, shapes, dtypes, no tensor read), and
only then read the tensors.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..blocks import Block
from ..blocks.block import ENTRY_HOOKS, bind_generics, parameter_manifest
from ..errors import KestrelWarning
from ..kernels.allocator import release_after_burst, retain_freed_memory
from ..kernels.calibration import native_half
from ..kernels.half import measured_rates
from ..models.cards import CARDS, FAMILIES, Card, CardError, Family, family_for_config, find_card
from ..types.dtypes import DType, dtype_named, from_torch
from .checkpoint import CheckpointError, Expected, load_tensors, plan_load, read_headers, safetensors_dtype
from .hub import fetch
from .onnxruntime_entries import attach as attach_onnxruntime
from .sizes import override_problem

# an entry in whose call a calibration measured something hands the freed pages back when it returns
if release_after_burst not in ENTRY_HOOKS:
    ENTRY_HOOKS.append(release_after_burst)

@dataclass
class Loaded:
    """Where a bound model came from: its card (if any), directory, config and bindings."""

    family: Family
    directory: Path
    config: dict[str, Any]
    generics: dict[str, Any]
    card: Card | None = None
    unused: list[str] = field(default_factory=list)
    origin: str = ""  # the hub id it was fetched as, when it has no card

    @property
    def name(self) -> str:
        return self.card.name if self.card else (self.origin or self.directory.name)

    @property
    def labels(self) -> dict[int, str]:
        """The classifier's ``id2label``, keys as ints."""
        return {int(k): v for k, v in (self.config.get("id2label") or {}).items()}


# what a hub id that is not a card may fetch: every family's files (safetensors, configs, tokenizers)
HUB_FILES: list[str] = sorted({f for fam in FAMILIES for f in fam.files}
                              | {f for card in CARDS.values() for f in card.extra_files})
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve(name_or_dir: str | os.PathLike[str], weights: str | os.PathLike[str] | None = None,
            revision: str | None = None) -> tuple[Path, Card | None]:
    """Where a model's files are, and its card if it has one.

    A card name or its hub repo (``google/vit-base-patch16-224``) is fetched at the card's pinned revision,
    or read from ``weights``; a directory is used as it is; any other hub id (``org/name``) is fetched at
    ``revision`` (default ``main``) and must be of a family Kestrel knows (its ``config.json`` decides).
    """
    name = os.fspath(name_or_dir)
    card = find_card(name)
    if weights is not None:
        where = Path(weights)
        if not where.is_dir():
            raise CardError(f"weights {where}: {'not a folder' if where.exists() else 'no such folder'}; give "
                            "the folder that holds config.json and *.safetensors")
        return where, card
    if card is not None:
        return fetch(card.repo, revision or card.revision, card.files), card
    if Path(name).is_dir():
        return Path(name), None
    check_model_name(name)
    return fetch(name, revision or "main", HUB_FILES), None


def check_model_name(name: str) -> None:
    """Raise :class:`CardError` unless ``name`` can name a model: a card, its hub id, a directory, ``org/name``.

    No file is read and no network is used: for commands that check their arguments before the work.
    """
    if find_card(name) is not None or Path(name).is_dir():
        return
    if Path(name).exists():
        raise CardError(f"{name} is a file; give the checkpoint directory (with config.json and *.safetensors)")
    if _HUB_ID.match(name) and not name.startswith((".", "/")):
        return
    known = ", ".join(sorted(CARDS))
    raise CardError(f"unknown model {name!r}: not a directory, not a hub id (org/name) and not one of {known}")


def peek(name_or_dir: str | os.PathLike[str], weights: str | os.PathLike[str] | None = None
         ) -> tuple[Family, dict[str, Any]] | None:
    """The family and ``config.json`` of a model, read without weights or network; None when that needs the hub.

    For checks that should fail before any download or load (a flag that does not fit the model).
    """
    name = os.fspath(name_or_dir)
    card = find_card(name)
    directory = Path(weights) if weights is not None else Path(name)
    if directory.is_dir() and (directory / "config.json").is_file():
        config = read_config(directory)
        return family_for_config(config, directory), config
    if card is not None:
        return card.family, card.config
    return None


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
         revision: str | None = None, compile: bool = False, quantize: str | None = None,
         **generics: Any) -> Block:
    """Load a model: a card name (``"dinov2-base"``) or a ``save_pretrained`` directory.

    ``weights=DIR`` reads a card's files from a local directory instead of the hub. Extra keyword
    arguments rebind the generics a family allows (``Height=224, Width=224`` for DINOv2).
    The returned module's entries are its methods (``forward``, ``features``...); ``model.loaded``
    says where it came from. ``compile=True`` wraps every entry in ``torch.compile`` (static shapes,
    inductor with weight freezing; see :mod:`kestrel.runtime.compiled`). ``quantize="int8"`` runs every
    ``Linear`` as int8 dynamic quantisation (opt-in, not exact: the README has its accuracy). An f32 entry
    that a race on this machine gave to onnxruntime runs there at the signatures it won
    (:mod:`kestrel.runtime.onnxruntime_entries`; ``KESTREL_ONNXRUNTIME=0`` turns that off).
    """
    if quantize not in (None, "int8"):
        raise CardError(f"quantize={quantize!r}: the only quantisation is 'int8' (or None for none)")
    directory, card = resolve(name_or_dir, weights, revision)
    config = read_config(directory)
    family = family_for_config(config, directory)
    if card is not None and card.family is not family:
        raise CardError(f"{directory}: config.json is a {config.get('model_type')!r} model, but {card.name} is a "
                        f"{card.family.name} card")
    bound = _bind(family, config, dtype, generics, directory)
    _warn_if_slow(bound["T"], torch.device(device))
    root = family.root(config)
    model = _build(root, family, config, bound, directory)
    model.configure(**family.settings(config))
    origin = "" if card is not None or weights is not None or Path(name_or_dir).is_dir() else os.fspath(name_or_dir)
    model.loaded = Loaded(family, directory, config, bound, card, origin=origin)  # type: ignore[assignment]
    model.requires_grad_(False)  # an inference model; call requires_grad_(True) to fine-tune
    retain_freed_memory()  # activations stay mapped between calls (kernels.allocator; KESTREL_MALLOC=system)
    model = model.eval().to(device)
    if quantize == "int8":
        from .quantize import quantize_int8

        quantize_int8(model)
    if compile:
        from .compiled import compile_entries

        compile_entries(model)
    attach_onnxruntime(model)  # entries a race on this machine gave to onnxruntime (none unless raced)
    return model


def _warn_if_slow(dtype: DType | torch.dtype, device: torch.device) -> None:
    """bf16 or f16 slower than f32 on this CPU: say so once per load. Without native arithmetic for it (by the
    CPU's flags) it always is; with it, its GEMM rate is measured against f32's (once per machine)."""
    name = str(from_torch(dtype) if isinstance(dtype, torch.dtype) else dtype)
    if device.type != "cpu" or name not in ("bf16", "f16"):
        return
    if native_half(name) is False:
        warnings.warn(f"{name} will be slow on this CPU: it has no native {name} arithmetic, so torch converts "
                      "to f32 for every GEMM and f32 is faster here (`kestrel doctor` measures both)",
                      KestrelWarning, stacklevel=3)
        return
    rates = measured_rates(name)
    if rates is not None and rates[name] < rates["f32"]:
        warnings.warn(f"{name} will be slow on this CPU: its {name} GEMMs measured {rates[name]:.0f} GFLOP/s against "
                      f"f32's {rates['f32']:.0f} at {torch.get_num_threads()} thread(s), so the f32 default is faster "
                      "here (`kestrel doctor` measures both; --quantize int8 is the fast path)",
                      KestrelWarning, stacklevel=3)


def _bind(family: Family, config: dict, dtype: Any, overrides: dict[str, Any], directory: Path) -> dict[str, Any]:
    try:
        bound = family.generics(config)
    except (KeyError, TypeError, ValueError) as e:
        raise CardError(f"{directory}/config.json does not describe a {family.name} model: {e}") from None
    bad = [k for k in overrides if k not in family.resizable]
    if bad:
        allowed = ", ".join(family.resizable) or "none"
        raise CardError(f"{family.name} cannot rebind {', '.join(bad)} at load (rebindable: {allowed})")
    problem = override_problem(family.name, bound, overrides)  # the size rule of runtime/sizes.py
    if problem is not None:
        raise CardError(problem)
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
