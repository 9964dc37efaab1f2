"""SiglipTextTokenizer against the reference transformers SiglipTokenizer (slow, SentencePiece).

No network: a small unigram SentencePiece model is trained here with the special-id layout of the
SigLIP spiece.model (<pad>=0, </s>=1, <unk>=2, no <s>), and both tokenizers load that file.
"""

from __future__ import annotations

import json
import random
import warnings

import pytest
import sentencepiece as spm
import torch

from kestrel.pipelines.tokenizer import SiglipTextTokenizer, TokenizerError

transformers = pytest.importorskip("transformers")

TEXTS = [
    "a photo of a dog",
    "A Photo Of A DOG!!!",
    'Hello, world... (it\'s) #1 -- "quoted" [x] {y} <z> a/b c\\d ~`@$%^&*+=|;:',
    "under_score and hy-phen and it's",
    "multiple     spaces   here",
    "tabs\tand\nnewlines\r\nmixed \x0b\x0c end",
    "  leading and trailing  ",
    "no\u00a0break\u3000ideographic space",
    "naïve café résumé zürich",
    "Zürich São Paulo ÑANDÚ",
    "東京の写真",
    "a dog 🐶 with a 🚀 rocket",
    "ﬁne Ｆｕｌｌｗｉｄｔｈ",
    "İstanbul STRASSE Straße",
    "",
    "   ",
    "!!!...???",
    "\u2581dog \u2581\u2581cat",
    "dog </s> cat",
    "hi</s>",
    "</s>",
    "a<unk>b",
    "</S> <UNK> <pad> <s>",
    "</s>🐶 dog",
    " ".join(["the small dog runs by the lake"] * 40),
]


@pytest.fixture(scope="module")
def spiece_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A ~500-piece unigram model with SigLIP's special ids; CJK and emoji stay out of it (unk)."""
    rng = random.Random(0)
    syllables = "ka lo mi ne ra to su vi pe ba de fo gu hi ju ly qu wo xe zi an en in on un st tr ch sh th"
    words = (
        "the a an of to in on with photo picture dog cat city lake mountain view red blue small runs by "
        "laptop cup coffee window background zürich café naïve résumé são paulo hello world end"
    ).split()
    words += ["".join(rng.choices(syllables.split(), k=rng.randint(1, 4))) for _ in range(400)]
    lines = []
    for _ in range(4000):
        line = " ".join(rng.choices(words, k=rng.randint(3, 12)))
        lines.append(line.capitalize() + rng.choice(["", ".", "!", ","]) if rng.random() < 0.3 else line)
    folder = tmp_path_factory.mktemp("spiece")
    (folder / "corpus.txt").write_text("\n".join(lines), encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(folder / "corpus.txt"),
        model_prefix=str(folder / "spiece"),
        model_type="unigram",
        vocab_size=500,
        pad_id=0,
        eos_id=1,
        unk_id=2,
        bos_id=-1,
        pad_piece="<pad>",
        eos_piece="</s>",
        unk_piece="<unk>",
        minloglevel=2,
    )
    return str(folder / "spiece.model")


@pytest.fixture(scope="module")
def reference(spiece_model: str):
    tokenizer = transformers.SiglipTokenizer(vocab_file=spiece_model)
    assert not tokenizer.is_fast  # the SentencePiece (slow) tokenizer, the only one SigLIP has
    return tokenizer


def reference_ids(tokenizer, texts: str | list[str], max_length: int = 64) -> torch.Tensor:
    """What SigLIP users get from processor(text=..., padding="max_length", truncation=True)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "This sequence already has </s>"
        out = tokenizer(
            texts, padding="max_length", max_length=max_length, truncation=True, return_tensors="pt"
        )
    return out["input_ids"]


def reference_unpadded(tokenizer, text: str, max_length: int = 64) -> list[int]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tokenizer(text, max_length=max_length, truncation=True)["input_ids"]


def test_special_id_layout_matches_siglip(spiece_model: str, reference) -> None:
    sp = spm.SentencePieceProcessor(model_file=spiece_model)
    assert [sp.id_to_piece(i) for i in range(3)] == ["<pad>", "</s>", "<unk>"]
    assert (reference.eos_token_id, reference.pad_token_id, reference.unk_token_id) == (1, 1, 2)
    ours = SiglipTextTokenizer(spiece_model)
    assert (ours.eos_id, ours.pad_id, ours.unk_id) == (1, 1, 2)


@pytest.mark.parametrize("text", TEXTS)
def test_single_text_matches_reference(spiece_model: str, reference, text: str) -> None:
    ours = SiglipTextTokenizer(spiece_model)
    ids = ours(text)
    assert ids.shape == (1, 64) and ids.dtype == torch.int32
    assert torch.equal(ids.long(), reference_ids(reference, [text]))
    assert ours.encode(text) == reference_unpadded(reference, text)


def test_batch_of_mixed_lengths(spiece_model: str, reference) -> None:
    ids = SiglipTextTokenizer(spiece_model)(TEXTS)
    assert ids.shape == (len(TEXTS), 64) and ids.dtype == torch.int32
    assert torch.equal(ids.long(), reference_ids(reference, TEXTS))


def test_processor_call_matches(spiece_model: str, reference) -> None:
    """The exact call SigLIP users make goes through SiglipProcessor to the same tokenizer."""
    processor = transformers.SiglipProcessor(transformers.SiglipImageProcessorPil(), reference)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = processor(text=TEXTS, padding="max_length", max_length=64, truncation=True, return_tensors="pt")
    assert torch.equal(SiglipTextTokenizer(spiece_model)(TEXTS).long(), out["input_ids"])


def test_long_text_is_truncated_and_still_ends_in_eos(spiece_model: str, reference) -> None:
    ours = SiglipTextTokenizer(spiece_model)
    text = TEXTS[-1]
    ids = ours.encode(text)
    assert len(ids) == 64 and ids[-1] == ours.eos_id
    assert ids == reference_unpadded(reference, text)


def test_literal_eos_kept_by_truncation_gets_no_second_eos(spiece_model: str, reference) -> None:
    """Truncation keeps 63 ids; when the 63rd is a literal </s>, no eos is appended (63 ids)."""
    ours = SiglipTextTokenizer(spiece_model)
    text = "dog " * 62 + "</s> cat cat"
    assert len(ours.encode(text)) == 63
    assert ours.encode(text) == reference_unpadded(reference, text)
    assert torch.equal(ours(text).long(), reference_ids(reference, text))


@pytest.mark.parametrize("max_length", [1, 2, 5])
def test_tiny_contexts(spiece_model: str, reference, max_length: int) -> None:
    ids = SiglipTextTokenizer(spiece_model, max_length)(TEXTS)
    assert ids.shape == (len(TEXTS), max_length)
    assert torch.equal(ids.long(), reference_ids(reference, TEXTS, max_length))


@pytest.mark.parametrize(
    "options", [{"pad_token": "<pad>"}, {"do_lower_case": False}], ids=["pad_is_not_eos", "cased"]
)
def test_other_options_match_reference(spiece_model: str, options: dict) -> None:
    reference = transformers.SiglipTokenizer(vocab_file=spiece_model, **options)
    ours = SiglipTextTokenizer(spiece_model, **options)
    assert torch.equal(ours(TEXTS).long(), reference_ids(reference, TEXTS))
    assert [ours.encode(t) for t in TEXTS] == [reference_unpadded(reference, t) for t in TEXTS]


def test_random_strings_match_reference(spiece_model: str, reference) -> None:
    rng = random.Random(1)
    alphabet = [*"abcdefg XYZ.,!?'\"-_\t\n\u00a0\u2581<>/éüñ日本😀ﬁＡİß", "</s>", "<unk>", "<pad>", " dog"]
    texts = ["".join(rng.choices(alphabet, k=rng.randint(0, 40))) for _ in range(300)]
    ours = SiglipTextTokenizer(spiece_model, 16)
    assert torch.equal(ours(texts).long(), reference_ids(reference, texts, 16))
    assert [ours.encode(t) for t in texts] == [reference_unpadded(reference, t, 16) for t in texts]


def test_from_dir_reads_checkpoint_config(spiece_model: str, tmp_path) -> None:
    (tmp_path / "spiece.model").write_bytes(open(spiece_model, "rb").read())
    added = {"content": "</s>", "lstrip": True, "normalized": False, "rstrip": True, "special": True}
    config = {
        "added_tokens_decoder": {"1": added, "2": {**added, "content": "<unk>"}},
        "do_lower_case": False,
        "eos_token": "</s>",
        "model_max_length": 16,
        "pad_token": "</s>",
        "tokenizer_class": "SiglipTokenizer",
        "unk_token": "<unk>",
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    ours = SiglipTextTokenizer.from_dir(tmp_path)
    assert (ours.max_length, ours.do_lower_case) == (16, False)
    assert SiglipTextTokenizer.from_dir(tmp_path, max_length=64).max_length == 64

    reference = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert type(reference) is transformers.SiglipTokenizer  # AutoTokenizer picks the slow one too
    assert torch.equal(ours(TEXTS).long(), reference_ids(reference, TEXTS, 16))


def test_from_dir_without_config_uses_defaults(spiece_model: str, tmp_path) -> None:
    (tmp_path / "spiece.model").write_bytes(open(spiece_model, "rb").read())
    ours = SiglipTextTokenizer.from_dir(tmp_path)
    assert (ours.max_length, ours.do_lower_case, ours.eos_id, ours.pad_id) == (64, True, 1, 1)


def test_missing_spiece_model_is_named(tmp_path) -> None:
    (tmp_path / "tokenizer_config.json").write_text("{}", encoding="utf-8")
    with pytest.raises(TokenizerError, match=r"spiece\.model") as info:
        SiglipTextTokenizer.from_dir(tmp_path)
    assert str(tmp_path) in str(info.value)
    with pytest.raises(TokenizerError, match="does not exist"):
        SiglipTextTokenizer(tmp_path / "spiece.model")


def test_bad_arguments(spiece_model: str) -> None:
    with pytest.raises(TokenizerError, match="eos_token"):
        SiglipTextTokenizer(spiece_model, eos_token="<eos>")
    with pytest.raises(TokenizerError, match="max_length"):
        SiglipTextTokenizer(spiece_model, 0)
    with pytest.raises(TokenizerError, match="str"):
        SiglipTextTokenizer(spiece_model)([b"bytes"])  # type: ignore[list-item]
