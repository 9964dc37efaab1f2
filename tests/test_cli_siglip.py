"""``kestrel zero-shot``, ``similarity`` and ``embed --text`` from a transformers-saved SigLIP directory."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from kestrel.cli.main import main
from reference import SIGLIP_LABELS, SIGLIP_TEMPLATE

LABELS, TEMPLATE = SIGLIP_LABELS, SIGLIP_TEMPLATE





def test_zero_shot_prints_the_reference_probabilities(siglip_dir, capsys):
    d, paths, out = siglip_dir
    assert main(["zero-shot", *map(str, paths), "--labels", *LABELS, "--template", TEMPLATE, "--model", str(d)]) == 0
    lines = capsys.readouterr().out.splitlines()
    probs = torch.sigmoid(out.logits_per_image)
    for i, path in enumerate(paths):
        start = lines.index(str(path))
        want = sorted(zip(probs[i].tolist(), LABELS), reverse=True)
        assert [line.strip() for line in lines[start + 1: start + 4]] == [f"{p:.2%}  {t}" for p, t in want]


def test_similarity_table_has_the_reference_logits(siglip_dir, capsys):
    d, paths, out = siglip_dir
    assert main(["similarity", "--images", *map(str, paths), "--texts", *LABELS, "--template", TEMPLATE,
                 "--model", str(d)]) == 0
    rows = capsys.readouterr().out.splitlines()[1:]
    for row, want in zip(rows, out.logits_per_image.tolist()):
        assert [float(c) for c in row.split()[1:]] == pytest.approx([round(v, 3) for v in want], abs=1.5e-3)


def test_embed_texts_and_images(siglip_dir, tmp_path, capsys):
    d, paths, out = siglip_dir
    texts = tmp_path / "texts.safetensors"
    assert main(["embed", "--text", *LABELS, "--template", TEMPLATE, "--model", str(d), "--out", str(texts)]) == 0
    with safe_open(texts, "pt") as f:
        feats, meta = f.get_tensor("features"), f.metadata()
    assert json.loads(meta["texts"]) == LABELS
    assert float((feats - out.text_model_output.pooler_output).abs().max()) <= 1e-4 * float(feats.abs().max())
    images = tmp_path / "images.safetensors"
    assert main(["embed", *map(str, paths), "--model", str(d), "--out", str(images), "--quiet"]) == 0
    with safe_open(images, "pt") as f:
        feats = f.get_tensor("features")
    ref = out.vision_model_output.pooler_output
    assert float((feats - ref).abs().max()) <= 1e-4 * float(ref.abs().max())


def test_zero_shot_input_errors(siglip_dir, tmp_path, capsys):
    d, paths, _ = siglip_dir
    assert main(["zero-shot", "no-such.jpg", "--labels", "a cat", "--model", str(d)]) == 2
    assert "no such image file or folder: 'no-such.jpg'" in capsys.readouterr().err
    assert main(["zero-shot", str(paths[0]), "--model", str(d)]) == 2
    assert "missing --labels" in capsys.readouterr().err
    assert main(["zero-shot", str(paths[0]), "a cat", "--model", str(d)]) == 2  # the old positional form
    assert "'a cat' is not a file: is it a label?" in capsys.readouterr().err
    (d / "spiece.model").unlink()
    assert main(["zero-shot", str(paths[0]), "--labels", "a cat", "--model", str(d)]) == 2
    assert "spiece.model" in capsys.readouterr().err
