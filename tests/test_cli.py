"""The ``kestrel`` command end to end: check, inspect, classify and embed from save_pretrained directories."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open
from transformers import Dinov2Config, Dinov2Model, ViTConfig, ViTForImageClassification, ViTImageProcessor

from kestrel.cli.main import main
from reference import rel_diff, seeded

LABELS = {0: "tabby cat", 1: "golden retriever", 2: "teapot", 3: "kestrel", 4: "space shuttle"}


@pytest.fixture
def images(tmp_path):
    rng = np.random.default_rng(0)
    paths = []
    for i, (h, w) in enumerate([(80, 100), (64, 64), (120, 90)]):
        p = tmp_path / f"img{i}.png"
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(p)
        paths.append(p)
    return paths


@pytest.fixture
def vit_dir(tmp_path):
    cfg = ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=32,
                    patch_size=8, num_labels=5, id2label=LABELS, label2id={v: k for k, v in LABELS.items()})
    ref = seeded(lambda: ViTForImageClassification(cfg))
    d = tmp_path / "vit"
    ref.save_pretrained(d)
    ViTImageProcessor(size={"height": 32, "width": 32}).save_pretrained(d)
    return d, ref


def test_check_passes_for_vit_and_dinov2(capsys):
    assert main(["check", "vit-base-patch16-224", "dinov2-base"]) == 0
    out = capsys.readouterr().out
    assert "vit::Model" in out and "dinov2::Model" in out and "error" not in out


def test_check_reports_a_broken_user_block(tmp_path, capsys):
    src = tmp_path / "mine.py"
    src.write_text(textwrap.dedent('''
        from kestrel.blocks import Block, Dim, Float, Param, f32
        from kestrel.std import ops

        class Proj(Block, module="mine"):
            In: Dim
            Out: Dim
            T: Float = f32
            weight: Param["Out, In; T"]

            def forward(self, x: "Tensor[B, Out; T]") -> "Tensor[B, Out; T]":
                return ops.linear(x, self.weight)
    '''))
    assert main(["check", str(src)]) == 1
    out = capsys.readouterr().out
    assert "mine.py:12" in out and "contraction dimension differs: Out vs In" in out


def test_inspect_prints_blocks_parameters_and_json(capsys):
    assert main(["inspect", "vit-base-patch16-224"]) == 0
    out = capsys.readouterr().out
    assert "  param positions: Tensor[1, 1 + (Height / Patch) * (Width / Patch), D; T]" in out
    assert "  Classes   1000" in out
    assert main(["inspect", "vit-base-patch16-224", "--parameters"]) == 0
    out = capsys.readouterr().out
    assert "layers.11.attention.query.weight" in out and "200 parameters, 86,567,656 values" in out
    assert main(["inspect", "dinov2-base", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["generics"]["Patch"] == 14 and doc["root"] == "dinov2::Model"
    assert {"path": "positions", "shape": [1, 1370, 768], "dtype": "f32", "optional": False} in doc["parameters"]


def test_classify_matches_the_reference_pipeline(vit_dir, images, capsys):
    d, ref = vit_dir
    assert main(["classify", *map(str, images), "--model", str(d), "--top", "3"]) == 0
    out = capsys.readouterr().out.splitlines()
    processor = ViTImageProcessor.from_pretrained(d)
    with torch.no_grad():
        probs = ref(**processor([Image.open(p) for p in images], return_tensors="pt")).logits.softmax(-1)
    for i, path in enumerate(images):
        block = out[out.index(str(path)) + 1: out.index(str(path)) + 4]
        top = probs[i].topk(3)
        for line, p, k in zip(block, top.values.tolist(), top.indices.tolist()):
            assert line.strip() == f"{p:.2%}  {LABELS[k]}"


def test_speed_flags_reach_the_loader(vit_dir, images, capsys, monkeypatch):
    """--quantize int8 and --compile are kestrel.load's options: passed through, and int8 still labels."""
    import kestrel.runtime.load as loading

    d, _ = vit_dir
    seen: list[dict] = []
    real = loading.load

    def spy(*args, **kwargs):
        seen.append(kwargs)
        return real(*args, **{**kwargs, "compile": False})  # compiling is timed by bench, not here

    monkeypatch.setattr(loading, "load", spy)
    assert main(["classify", str(images[0]), "--model", str(d), "--top", "2", "--quantize", "int8",
                 "--compile"]) == 0
    assert seen[-1]["quantize"] == "int8" and seen[-1]["compile"] is True
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == str(images[0]) and len(lines) == 3 and all("%" in line for line in lines[1:])
    assert main(["classify", str(images[0]), "--model", str(d)]) == 0
    assert seen[-1]["quantize"] is None and seen[-1]["compile"] is False


def test_a_first_run_says_it_measures_the_kernels_and_a_second_is_silent(tmp_path, images, capsys,
                                                                        own_calibration):
    """Shapes large enough to time (65 rows x 256 wide) are measured on first use: seconds apiece on real models,
    so the command says so on stderr, and how many it measured; the next run reuses them and says nothing."""
    cfg = ViTConfig(hidden_size=256, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512, image_size=64,
                    patch_size=8, num_labels=5, id2label=LABELS, label2id={v: k for k, v in LABELS.items()})
    d = tmp_path / "vit-wide"
    seeded(lambda: ViTForImageClassification(cfg)).save_pretrained(d)
    assert main(["classify", str(images[0]), "--model", str(d)]) == 0
    err = capsys.readouterr().err
    assert "kestrel classify: measuring this CPU's kernels for shapes it has not run before" in err
    count = int(err.split("measured ")[1].split(" new shape(s)")[0])
    # the first layer's fused q/k/v and its MLP's two GEMMs at least (the output projection shares the 256 x 256
    # shape of the q/k/v parts, which may be measured with them; the last layer runs the class token alone)
    assert count >= 3, err
    assert main(["classify", str(images[0]), "--model", str(d)]) == 0
    assert "measur" not in capsys.readouterr().err


@pytest.mark.parametrize(("name", "value"), [("KESTREL_FOLD", "sometimes"), ("KESTREL_CALIBRATION_BUDGET", "soon"),
                                             ("KESTREL_ATTENTION_BUDGET", "big"), ("KESTREL_ONNXRUNTIME", "maybe")])
def test_a_bad_setting_is_refused_before_the_command_starts(name, value, tmp_path, images, capsys, monkeypatch,
                                                           own_calibration):
    """A setting a kernel reads minutes into a run (the fold at the last layer, after the first layer's GEMM races) is
    checked before anything is measured or said: one error line naming the variable, exit 2."""
    cfg = ViTConfig(hidden_size=256, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512, image_size=64,
                    patch_size=8, num_labels=5, id2label=LABELS, label2id={v: k for k, v in LABELS.items()})
    model = tmp_path / "vit-wide"  # GEMMs large enough to race before the last layer reads KESTREL_FOLD
    seeded(lambda: ViTForImageClassification(cfg)).save_pretrained(model)
    capsys.readouterr()
    monkeypatch.setenv(name, value)
    assert main(["classify", str(images[0]), "--model", str(model)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kestrel classify: error: {name}={value!r}") and "measuring" not in err, err
    assert main(["doctor"]) == 2  # every command, before a minute of rate measuring
    assert capsys.readouterr().err.startswith(f"kestrel doctor: error: {name}={value!r}")


def test_embed_writes_features_with_paths(tmp_path, images, capsys):
    ref = seeded(lambda: Dinov2Model(Dinov2Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                                  image_size=28, patch_size=14)))
    d = tmp_path / "dino"
    ref.save_pretrained(d)
    out = tmp_path / "feats.safetensors"
    assert main(["embed", str(tmp_path), "--model", str(d), "--out", str(out), "--size", "28", "--quiet"]) == 0
    with safe_open(out, "pt") as f:
        feats = f.get_tensor("features")
        meta = f.metadata()
    assert json.loads(meta["images"]) == [str(p) for p in sorted(images)]
    from kestrel.models.cards.dinov2 import FAMILY
    from kestrel.pipelines.images import ImagePreprocess

    pixels = ImagePreprocess.from_config(FAMILY.preprocess).with_size(28, 28)(sorted(images))
    with torch.no_grad():
        want = ref(pixel_values=pixels).last_hidden_state[:, 0]
    assert rel_diff(feats, want) <= 1e-4


def test_bad_inputs_give_one_clear_line(vit_dir, images, tmp_path, capsys):
    d, _ = vit_dir
    assert main(["classify", str(tmp_path / "missing.jpg"), "--model", str(d)]) == 2
    assert "missing.jpg" in capsys.readouterr().err
    deep = tmp_path / ("a-long-folder-name-" * 12) / "missing.jpg"  # a long path keeps both ends
    assert main(["classify", str(deep), "--model", str(d)]) == 2
    err = capsys.readouterr().err
    assert f"'{str(deep)[:40]}" in err and "/missing.jpg'" in err and f"({len(str(deep))} characters)" in err
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "config.json").write_text((d / "config.json").read_text())
    data = (d / "model.safetensors").read_bytes()
    (corrupt / "model.safetensors").write_bytes(data[: len(data) // 2])
    assert main(["classify", str(images[0]), "--model", str(corrupt)]) == 2
    err = capsys.readouterr().err
    assert "model.safetensors" in err and "Traceback" not in err
    assert main(["inspect", "no-such-model"]) == 2
    assert "known models" in capsys.readouterr().err


def test_console_script_help_teaches():
    out = subprocess.run([sys.executable, "-m", "kestrel.cli.main", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "kestrel inspect sam-vit-base" in out.stdout
