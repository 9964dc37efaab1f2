"""``kestrel doctor`` and ``kestrel bench``, example inputs from declared types, and ``load(compile=True)``."""

from __future__ import annotations

import re

import pytest
import torch
from transformers import SamConfig, SamModel

import kestrel
from kestrel.cli.main import main
from kestrel.kernels import calibration as calibrate
from kestrel.kernels import gemm
from kestrel.runtime.examples import entry_names, example_inputs
from reference import rel_diff

pytestmark = pytest.mark.usefixtures("own_calibration")


@pytest.fixture
def vit_dir(small_vit):
    return small_vit()


def test_doctor_prints_rates_and_the_choice_per_shape(small_vit, capsys):
    vit_dir = small_vit(layers=2)  # the last layer attends from the class token alone
    assert main(["doctor", "--threads", "1", "--size", "256", "--model", str(vit_dir), "--batch", "40"]) == 0
    out = capsys.readouterr().out
    assert calibrate.cpu_model() in out and "1 thread(s): torch" in out
    assert "680x192x64+b" in out and "chosen" in out  # the first layer's fused q/k/v GEMM at 40 x 17 rows
    # its attention with the projections: the choice, then both paths' seconds
    assert re.search(r"folded 40x1x17x64x64x64x64x64x64x2 +(folded|projected) +\(projected [0-9.e-]+ s, "
                     r"folded [0-9.e-]+ s\)", out), out
    if gemm.int8_available():  # each int8 kernel, with the quantized engine it runs under
        assert f"int8 kernels: int8 (quantized engine {torch.backends.quantized.engine})" in out
    files = list(calibrate.cache_dir().glob("*.json"))
    assert len(files) == 1  # one machine key: this CPU, 1 thread, these libraries
    assert main(["doctor", "--reset"]) == 0
    assert not list(calibrate.cache_dir().glob("*.json"))


def test_doctor_lists_a_cached_half_precision_rate(capsys):
    """A bf16 load keeps its measured GEMM rate in the calibration table (``rate bf16``, no kernel in it):
    the doctor lists it among the cached choices (it ended in an internal error on that entry)."""
    from kestrel.kernels import half

    rates = half.measured_rates("bf16")
    if rates is None:
        pytest.skip("no bf16 GEMM in this torch build")
    assert main(["doctor", "--size", "256"]) == 0
    out = capsys.readouterr().out
    line = next(row for row in out.splitlines() if "rate bf16" in row)
    assert f"bf16 {rates['bf16']:.1f}" in line and f"f32 {rates['f32']:.1f}" in line, line


def test_doctor_names_a_bad_model_or_entry_before_measuring_anything(vit_dir, tmp_path, capsys):
    assert main(["doctor", "--model", str(tmp_path / "nowhere")]) == 2
    captured = capsys.readouterr()
    assert "unknown model" in captured.err and "nowhere" in captured.err
    assert "GEMM" not in captured.out  # no minute of rate measuring before the error
    assert main(["doctor", "--model", str(vit_dir), "--entry", "nope"]) == 2
    captured = capsys.readouterr()
    assert "no entry 'nope'" in captured.err and "GEMM" not in captured.out


def test_bench_times_an_entry(vit_dir, capsys):
    assert main(["bench", str(vit_dir), "--batch", "1,2", "--repeat", "1", "--entry", "features", "-v"]) == 0
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.startswith("eager")]
    assert len(lines) == 2 and lines[1].split()[1] == "2"
    assert "GEMM M x N x K" in out
    assert main(["bench", str(vit_dir), "--entry", "nope"]) != 0


def test_example_inputs_follow_the_declared_types(vit_dir):
    model = kestrel.load(vit_dir)
    assert entry_names(model) == ["forward", "features"]
    (x,) = example_inputs(model, "forward", batch=3)
    assert x.shape == (3, 3, 32, 32) and x.dtype == torch.float32
    sam = SamModel(SamConfig(vision_config=dict(hidden_size=32, num_attention_heads=2, mlp_dim=64, output_channels=32,
                                                num_pos_feats=16),
                             prompt_encoder_config=dict(hidden_size=32),
                             mask_decoder_config=dict(hidden_size=32, num_attention_heads=2, mlp_dim=64,
                                                      iou_head_hidden_dim=32)))
    sam_dir = vit_dir.parent / "sam"
    sam.save_pretrained(sam_dir)
    ours = kestrel.load(sam_dir)
    emb, points, labels = example_inputs(ours, "decode_points", batch=2)
    assert emb.shape == (2, 32, 64, 64) and points.shape == (2, 1, 1, 2) and labels.dtype == torch.int32
    with torch.no_grad():
        masks, _ = ours.decode_points(emb, points, labels)
    assert masks.shape == (2, 1, 4, 256, 256)


def test_compiled_entries_match_eager(vit_dir):
    eager = kestrel.load(vit_dir)
    compiled = kestrel.load(vit_dir, compile=True)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        want = eager.forward(x)
    assert rel_diff(compiled.forward(x), want) <= 1e-5
    # the first call raced the compiled graph against eager for this signature and keeps the faster
    (choice,) = compiled.compile_choices["forward"].values()
    assert choice["path"] == min(("compiled", "eager"), key=lambda p: choice[f"{p}_s"])
    assert list(compiled.compile_choices["forward"]) == ["f32[2, 3, 32, 32]"]
    assert rel_diff(compiled.forward(x), want) <= 1e-5  # whichever path it took
    with pytest.raises(kestrel.blocks.EntryError, match="axis 2 is 31"):  # inputs still checked
        compiled.forward(torch.randn(2, 3, 31, 32))


def test_compiled_always_skips_the_race(vit_dir, monkeypatch):
    monkeypatch.setenv("KESTREL_COMPILED", "always")
    compiled = kestrel.load(vit_dir, compile=True)
    compiled.forward(torch.randn(1, 3, 32, 32))
    assert compiled.compile_choices["forward"] == {"f32[1, 3, 32, 32]": {"path": "compiled"}}
