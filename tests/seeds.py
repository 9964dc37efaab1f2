"""Reading the seed documents in ../shared/seeds: entries, bound generics, and block texts.

The seed pages live outside the repository (``../shared/seeds`` beside the clone, or wherever
``KESTREL_SEEDS`` points). Where they are absent, a test that reads one is skipped with a reason naming
the missing path, so the suite passes in any clone; with ``KESTREL_REQUIRE_SEEDS=1`` (set by ``.ci/run``)
the same situation fails the test instead, so CI cannot pass without comparing against the seeds.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

SEEDS = Path(os.environ.get("KESTREL_SEEDS") or Path(__file__).resolve().parents[1].parent / "shared" / "seeds")

# seed file prefix -> the card that reproduces it
SEED_CARDS = {"000": "sam-vit-base", "001": "siglip-base-patch16-224", "003": "vit-base-patch16-224",
              "004": "dinov2-base"}

_HEADER = re.compile(r"^[a-z][\w.]*::\w+(<.*>)?$")


@dataclass
class Seed:
    entries: dict[str, str] = field(default_factory=dict)
    generics: dict[str, str] = field(default_factory=dict)
    blocks: dict[str, str] = field(default_factory=dict)  # qualified name -> text


def seeds_required() -> bool:
    return os.environ.get("KESTREL_REQUIRE_SEEDS", "").strip().lower() not in ("", "0", "false", "no")


def seed_path(prefix: str) -> Path:
    """The seed page ``{prefix}_*.txt``; skips the test when it is absent (fails it under KESTREL_REQUIRE_SEEDS)."""
    found = sorted(SEEDS.glob(f"{prefix}_*.txt")) if SEEDS.is_dir() else []
    if found:
        return found[0]
    missing = SEEDS if not SEEDS.is_dir() else SEEDS / f"{prefix}_*.txt"
    reason = f"seed pages not found: {missing} does not exist (put the seeds there or set KESTREL_SEEDS)"
    if seeds_required():
        pytest.fail(f"{reason}; KESTREL_REQUIRE_SEEDS is set, so seed tests may not be skipped", pytrace=False)
    pytest.skip(reason)


def read_seed(prefix: str) -> Seed:
    path = seed_path(prefix)
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
