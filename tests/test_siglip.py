"""SigLIP: the declarations against seed 001, the checker, and parity with transformers' SiglipModel.

Each parity test builds the reference from a config with ``torch.manual_seed``, writes it with
``save_pretrained``, loads the directory with ``kestrel.load`` and compares every entry in f32 on
CPU: max |diff| <= 1e-4 * max |reference|.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import kestrel
from kestrel.blocks import EntryError
from kestrel.blocks.block import bind_generics, parameter_manifest
from kestrel.checker.check import check_program
from kestrel.inspect.printer import format_block, listed_blocks
from kestrel.models import siglip
from kestrel.models.cards import CARDS, family_for_config
from kestrel.models.cards import siglip as siglip_card
from kestrel.pipelines.images import ImagePreprocess
from kestrel.pipelines.tokenizer import SiglipTextTokenizer
from kestrel.pipelines.zero_shot import encode_images, encode_texts, similarity_table, zero_shot
from reference import build_siglip as build_reference
from reference import rel_diff
from seeds import read_seed

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

TOLERANCE = 1e-4
# what siglip::Model adds after the seed's entries
EXTRA_ENTRIES = ("logits_per_image", "probabilities")
# functions added beyond the seed to blocks other than the model: text_features' last layer for the last token
EXTRA_FUNCTIONS = {"siglip::Attention": ("last_query",), "siglip::EncoderLayer": ("last_token",)}


def pooled(out) -> torch.Tensor:
    """transformers 5's ``get_*_features`` return the tower's output; the features are its pooler output."""
    return out.pooler_output if hasattr(out, "pooler_output") else out


# ------------------------------------------------------------------------------------ declarations


def test_every_seed_block_prints_as_the_seed() -> None:
    seed = read_seed("001")
    assert len(seed.blocks) == 9, list(seed.blocks)
    ours = {b.qualname: format_block(b) for b in listed_blocks(siglip.Model)}
    assert list(ours) == list(seed.blocks), "the listing's blocks, sorted by name, are the seed's"
    for name, text in seed.blocks.items():
        mine = ours[name]
        if name == "siglip::Model":  # the seed's lines, plus the extra entries and nothing else
            extra = [line for line in mine.splitlines() if line.split("<")[0].split()[-1] in EXTRA_ENTRIES]
            assert [line.split()[2].split("<")[0] for line in extra] == list(EXTRA_ENTRIES)
            assert all(line.startswith("  pub entry ") for line in extra)
            mine = "\n".join(line for line in mine.splitlines() if line not in extra)
        elif name in EXTRA_FUNCTIONS:  # the seed's lines, plus those functions and nothing else
            extra = [line for line in mine.splitlines() if line.startswith("  pub fn ")
                     and line.split()[2].split("<")[0] in EXTRA_FUNCTIONS[name]]
            assert [line.split()[2].split("<")[0] for line in extra] == list(EXTRA_FUNCTIONS[name])
            mine = "\n".join(line for line in mine.splitlines() if line not in extra)
        assert mine == text, f"{name} differs:\n{mine}\n--- seed:\n{text}"


def test_extra_entries_are_typed_per_image() -> None:
    decl = siglip.Model.decl()
    text = format_block(decl)
    assert ("  pub entry logits_per_image<Bi: Dim, Bt: Dim>(image: Tensor[Bi, Channels, Height, Width; T], "
            "tokens: Tensor[Bt, MaxPositions; i32]) -> Tensor[Bi, Bt; T]") in text
    assert ("  pub entry probabilities<Bi: Dim, Bt: Dim>(image: Tensor[Bi, Channels, Height, Width; T], "
            "tokens: Tensor[Bt, MaxPositions; i32]) -> Tensor[Bi, Bt; T]") in text
    assert [f.name for f in decl.entries] == ["image_features", "text_features", "similarity", *EXTRA_ENTRIES]


def test_check_program_is_clean() -> None:
    report = check_program(siglip.Model)
    assert report.ok, "\n".join(map(str, report.diagnostics))
    assert {b.name for b in report.blocks} >= {"Attention", "AttentionPool", "EncoderLayer", "LayerNorm", "Mlp",
                                               "Model"}


def test_card_binds_the_seed_generics() -> None:
    card = CARDS["siglip-base-patch16-224"]
    assert (card.repo, card.revision) == ("google/siglip-base-patch16-224", "7fd15f0689c79d79e38b1c2e2e2370a7bf2761ed")
    assert {"spiece.model", "tokenizer_config.json", "special_tokens_map.json"} <= set(card.files)
    bound = bind_generics(siglip.Model.decl(), card.generics())
    assert {k: str(v) for k, v in bound.items()} == read_seed("001").generics


# ------------------------------------------------------------------------------------ the family

# The released checkpoints' shapes (config.json values; the text towers have the same widths).
FAMILY_SIZES = {
    "base-patch16-224": dict(image_size=224, patch_size=16, hidden_size=768, intermediate_size=3072, layers=12,
                             heads=12, vocab_size=32000),
    "base-patch16-256-multilingual": dict(image_size=256, patch_size=16, hidden_size=768, intermediate_size=3072,
                                          layers=12, heads=12, vocab_size=250000),
    "base-patch16-512": dict(image_size=512, patch_size=16, hidden_size=768, intermediate_size=3072, layers=12,
                             heads=12, vocab_size=32000),
    "large-patch16-384": dict(image_size=384, patch_size=16, hidden_size=1024, intermediate_size=4096, layers=24,
                              heads=16, vocab_size=32000),
    "so400m-patch14-384": dict(image_size=384, patch_size=14, hidden_size=1152, intermediate_size=4304, layers=27,
                               heads=16, vocab_size=32000),
    "so400m-patch14-224": dict(image_size=224, patch_size=14, hidden_size=1152, intermediate_size=4304, layers=27,
                               heads=16, vocab_size=32000),
}


def family_config(image_size: int, patch_size: int, hidden_size: int, intermediate_size: int, layers: int,
                  heads: int, vocab_size: int) -> transformers.SiglipConfig:
    tower = dict(hidden_size=hidden_size, intermediate_size=intermediate_size, num_hidden_layers=layers,
                 num_attention_heads=heads)
    return transformers.SiglipConfig(
        vision_config=dict(image_size=image_size, patch_size=patch_size, **tower),
        text_config=dict(vocab_size=vocab_size, max_position_embeddings=64, **tower),
    )


@pytest.mark.parametrize("size", sorted(FAMILY_SIZES))
def test_family_bindings_cover_every_reference_tensor(size: str) -> None:
    """Every tensor of the reference (built on the meta device) binds one parameter of the same shape."""
    config = family_config(**FAMILY_SIZES[size])
    with torch.device("meta"):
        ref = transformers.SiglipModel(config)
    cfg = config.to_dict()
    family = family_for_config(cfg, Path(size))
    assert family is siglip_card.FAMILY
    generics = {**family.generics(cfg), "T": "f32"}
    manifest = {path: shape for path, shape, _, _ in parameter_manifest(siglip.Model, generics)}
    bindings = family.bindings(cfg)
    bound = {}
    for name, tensor in ref.state_dict().items():
        path = bindings(name)
        assert path is not None, name
        assert manifest[path] == tuple(tensor.shape), (name, path)
        bound[path] = name
    assert sorted(bound) == sorted(manifest)
    assert family.settings(cfg) == {"eps": 1e-6, "approximate": "tanh"}


def test_sparse_config_takes_the_reference_defaults() -> None:
    """Upstream config.json files often carry only what differs from SiglipVisionConfig/SiglipTextConfig."""
    cfg = {"model_type": "siglip", "text_config": {"model_type": "siglip_text_model"},
           "vision_config": {"patch_size": 16}}
    assert siglip_card.generics(cfg) == CARDS["siglip-base-patch16-224"].family.generics(
        CARDS["siglip-base-patch16-224"].config)
    with pytest.raises(ValueError, match="projection"):
        siglip_card.generics({"text_config": {"projection_size": 512}})
    with pytest.raises(ValueError, match="hidden_act"):
        siglip_card.settings({"vision_config": {"hidden_act": "relu"}})


# ------------------------------------------------------------------------------------ parity

SMALL = {
    # base-like: two layers per tower
    "small": dict(vision=dict(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                              image_size=32, patch_size=8),
                  text=dict(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                            num_attention_heads=4, max_position_embeddings=16)),
    # so400m-like: patch 14 on an image that is not a multiple of it, towers of different depths and heads
    "odd": dict(vision=dict(hidden_size=48, intermediate_size=43, num_hidden_layers=3, num_attention_heads=3,
                            image_size=44, patch_size=14, num_channels=3),
                text=dict(vocab_size=57, hidden_size=48, intermediate_size=71, num_hidden_layers=1,
                          num_attention_heads=6, max_position_embeddings=9)),
}





def compare(ref: transformers.SiglipModel, ours: torch.nn.Module, n_images: int, n_texts: int) -> dict[str, float]:
    v, t = ref.config.vision_config, ref.config.text_config
    image = torch.randn(n_images, v.num_channels, v.image_size, v.image_size)
    tokens = torch.randint(0, t.vocab_size, (n_texts, t.max_position_embeddings), dtype=torch.int32)
    with torch.no_grad():
        out = ref(input_ids=tokens.long(), pixel_values=image)
        references = {
            "image_features": pooled(ref.get_image_features(pixel_values=image)),
            "text_features": pooled(ref.get_text_features(input_ids=tokens.long())),
            "similarity": out.logits_per_text,
            "logits_per_image": out.logits_per_image,
            "probabilities": torch.sigmoid(out.logits_per_image),
        }
        mine = {
            "image_features": ours.image_features(image),
            "text_features": ours.text_features(tokens),
            "similarity": ours.similarity(image, tokens),
            "logits_per_image": ours.logits_per_image(image, tokens),
            "probabilities": ours.probabilities(image, tokens),
        }
    assert mine["similarity"].shape == (n_texts, n_images)
    assert mine["logits_per_image"].shape == (n_images, n_texts)
    return {k: rel_diff(mine[k], references[k]) for k in references}


@pytest.mark.parametrize("fold", ["always", "0"])  # the one-query attentions (pool, last text token) folded or not
@pytest.mark.parametrize("size", sorted(SMALL))
def test_parity_small(size: str, fold: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KESTREL_FOLD", fold)
    ref = build_reference(**SMALL[size])
    ref.save_pretrained(tmp_path)
    ours = kestrel.load(tmp_path)
    assert isinstance(ours, siglip.Model)
    diffs = compare(ref, ours, n_images=3, n_texts=2)
    print(size, diffs)
    assert max(diffs.values()) <= TOLERANCE, diffs


def test_tokens_must_be_i32(tmp_path: Path) -> None:
    ref = build_reference(**SMALL["small"])
    ref.save_pretrained(tmp_path)
    ours = kestrel.load(tmp_path)
    with pytest.raises(EntryError, match=r"i64|int64"):
        ours.text_features(torch.zeros(1, 16, dtype=torch.int64))
    with pytest.raises(EntryError):
        ours.text_features(torch.zeros(1, 15, dtype=torch.int32))  # not MaxPositions long


@pytest.mark.slow
def test_parity_real_size(tmp_path: Path) -> None:
    """google/siglip-base-patch16-224's config (SiglipConfig's defaults), random weights."""
    ref = build_reference(vision=dict(image_size=224, patch_size=16), text=dict(vocab_size=32000))
    cfg = ref.config
    assert (cfg.vision_config.hidden_size, cfg.text_config.max_position_embeddings) == (768, 64)
    ref.save_pretrained(tmp_path)
    ours = kestrel.load(tmp_path)
    assert {k: str(v) for k, v in ours.generics.items()} == read_seed("001").generics
    diffs = compare(ref, ours, n_images=2, n_texts=3)
    print("real size", diffs)
    assert max(diffs.values()) <= TOLERANCE, diffs


# ------------------------------------------------------------------------------------ zero-shot





def test_zero_shot_end_to_end(spiece_model: str, tmp_path: Path) -> None:
    """A saved directory (weights, spiece.model, preprocessor config) to probabilities, as the reference."""
    ref = build_reference(
        vision=dict(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                    image_size=32, patch_size=8),
        text=dict(vocab_size=80, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=16),
    )
    ref_tokenizer = transformers.SiglipTokenizer(vocab_file=spiece_model, model_max_length=16)
    ref_images = transformers.SiglipImageProcessorPil(size={"height": 32, "width": 32})
    for part in (ref, ref_tokenizer, ref_images):
        part.save_pretrained(tmp_path)

    rng = np.random.default_rng(0)
    images: list = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in ((40, 56), (32, 32))]
    images[0].save(tmp_path / "first.png")
    images = [tmp_path / "first.png", images[1], Image.fromarray(rng.integers(0, 256, (20, 30, 3), dtype=np.uint8))]
    labels = ["dog", "a red car", "sleeping cat!"]
    template = "a photo of {}."

    model = kestrel.load(tmp_path)
    tokenizer = SiglipTextTokenizer.from_dir(tmp_path)
    preprocess = ImagePreprocess.from_file(tmp_path)
    assert tokenizer.max_length == 16 and preprocess.output_size == (32, 32)

    probs = zero_shot(model, images, labels, tokenizer, preprocess, template=template)
    logits = similarity_table(model, images, labels, tokenizer, preprocess, template=template)
    image_features = encode_images(model, images, preprocess)
    text_features = encode_texts(model, labels, tokenizer, template=template)

    pil = [Image.open(images[0]).convert("RGB"), *images[1:]]
    prompts = [template.format(label) for label in labels]
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        ids = ref_tokenizer(prompts, padding="max_length", max_length=16, truncation=True, return_tensors="pt")
        pixel_values = ref_images(pil, return_tensors="pt")["pixel_values"]
        out = ref(input_ids=ids["input_ids"], pixel_values=pixel_values)
    assert probs.shape == (3, 3) and logits.shape == (3, 3)
    assert rel_diff(logits, out.logits_per_image) <= TOLERANCE
    assert rel_diff(probs, torch.sigmoid(out.logits_per_image)) <= TOLERANCE
    assert rel_diff(image_features, out.vision_model_output.pooler_output) <= TOLERANCE
    assert rel_diff(text_features, out.text_model_output.pooler_output) <= TOLERANCE
    normed = encode_texts(model, labels, tokenizer, template=template, normalize=True)
    assert rel_diff(normed, out.text_embeds) <= TOLERANCE
    # the tokenizer must pad to the model's MaxPositions
    with pytest.raises(ValueError, match="max_length=16"):
        zero_shot(model, images, labels, SiglipTextTokenizer(spiece_model, max_length=64), preprocess)
    with pytest.raises(ValueError, match="template"):
        zero_shot(model, images, labels, tokenizer, preprocess, template="a photo")
