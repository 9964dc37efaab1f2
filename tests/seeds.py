"""Reading the seed documents in ../shared/seeds: entries, bound generics, and block texts."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

SEEDS = Path(__file__).resolve().parents[1].parent / "shared" / "seeds"

# seed file prefix -> the card that reproduces it
SEED_CARDS = {"000": "sam-vit-base", "001": "siglip-base-patch16-224", "003": "vit-base-patch16-224",
              "004": "dinov2-base"}

_HEADER = re.compile(r"^[a-z][\w.]*::\w+(<.*>)?$")


@dataclass
class Seed:
    entries: dict[str, str] = field(default_factory=dict)
    generics: dict[str, str] = field(default_factory=dict)
    blocks: dict[str, str] = field(default_factory=dict)  # qualified name -> text


def read_seed(prefix: str) -> Seed:
    path = next(SEEDS.glob(f"{prefix}_*.txt"))
    lines = [line.rstrip("\n") for line in path.read_text().splitlines()]
    seed = Seed()
    section = None
    i = 0
    while i < len(lines):
        line = lines[i]
        bare = line.strip().strip("`").strip()
        if bare in ("Entries", "Generics", "Blocks"):
            section = bare
        elif section in ("Entries", "Generics") and "\t" in line:
            key, value = (part.strip().strip("`") for part in line.split("\t", 1))
            if key not in ("Entry",):
                (seed.entries if section == "Entries" else seed.generics)[key] = value
        elif _HEADER.match(line):
            block = [line]
            while i + 1 < len(lines) and lines[i + 1].startswith("  "):
                i += 1
                block.append(lines[i])
            seed.blocks[line.split("<", 1)[0]] = "\n".join(block)
        i += 1
    return seed
