"""Every card Kestrel knows, by name, and family lookup from a ``config.json``."""

from __future__ import annotations

from pathlib import Path

from . import dinov2, sam, sam2, siglip, vit
from .base import Bindings, Card, CardError, Family, pair

FAMILIES: list[Family] = [vit.FAMILY, dinov2.FAMILY, siglip.FAMILY, sam.FAMILY, sam2.FAMILY]
CARDS: dict[str, Card] = {c.name: c for mod in (vit, dinov2, siglip, sam, sam2) for c in mod.CARDS}


def family_for_config(config: dict, where: Path) -> Family:
    """The family whose ``model_type`` the config declares."""
    mt = config.get("model_type")
    for fam in FAMILIES:
        if mt in fam.model_types:
            return fam
    known = ", ".join(t for f in FAMILIES for t in f.model_types)
    raise CardError(f"{where}: config.json has model_type {mt!r}; Kestrel knows {known}")


__all__ = ["CARDS", "FAMILIES", "Bindings", "Card", "CardError", "Family", "family_for_config", "pair"]
