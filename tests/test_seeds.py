"""``kestrel inspect`` reproduces every seed: entries, bound generics and each block's text.

The listing is derived from the Python declarations (and the card's config for the generics); these
tests compare that derivation with the seed documents in ../shared/seeds.
"""

from __future__ import annotations

import pytest

from kestrel.blocks.block import bind_generics
from kestrel.inspect import format_block, format_signature, listed_blocks
from kestrel.models.cards import CARDS
from seeds import SEED_CARDS, read_seed


def _program(prefix: str):
    name = SEED_CARDS[prefix]
    if name not in CARDS:
        pytest.fail(f"no card {name} for seed {prefix}")
    card = CARDS[name]
    return card, card.family.root(card.config)


def _lines_in_order(seed_text: str, ours: str) -> bool:
    """Every seed line appears in our text, in order (a block may add members or entries)."""
    it = iter(ours.splitlines())
    return all(any(line == mine for mine in it) for line in seed_text.splitlines())


@pytest.mark.parametrize("prefix", sorted(SEED_CARDS))
def test_every_seed_block_is_reproduced(prefix: str) -> None:
    seed = read_seed(prefix)
    _, root = _program(prefix)
    ours = {b.qualname: format_block(b) for b in listed_blocks(root)}
    assert seed.blocks, "the seed parser found no blocks"
    for name, text in seed.blocks.items():
        assert name in ours, f"seed block {name} is missing from the listing"
        assert ours[name] == text or _lines_in_order(text, ours[name]), f"{name} differs:\n{ours[name]}\n---\n{text}"


@pytest.mark.parametrize("prefix", sorted(SEED_CARDS))
def test_listing_has_exactly_the_seed_blocks_sorted(prefix: str) -> None:
    seed = read_seed(prefix)
    _, root = _program(prefix)
    names = [b.qualname for b in listed_blocks(root)]
    assert names == list(seed.blocks), "the listing's blocks, in order, are the seed's"


@pytest.mark.parametrize("prefix", sorted(SEED_CARDS))
def test_seed_entries_and_generics(prefix: str) -> None:
    seed = read_seed(prefix)
    card, root = _program(prefix)
    decl = root.decl()
    ours = {fn.name: format_signature(fn, decl.order) for fn in decl.entries}
    for name, signature in seed.entries.items():
        assert ours.get(name) == signature
    bound = bind_generics(decl, card.generics())
    assert {k: str(v) for k, v in bound.items()} == seed.generics


def test_seed_parser_reads_every_block_of_a_known_seed() -> None:
    seed = read_seed("003")
    assert list(seed.blocks) == ["vit::Attention", "vit::EncoderLayer", "vit::LayerNorm", "std.nn.linear::Linear",
                                 "vit::Model", "std.nn.norm::RmsNorm"]
    assert seed.generics["Classes"] == "1000"
