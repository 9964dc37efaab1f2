"""What a fast path costs in accuracy (``kestrel.pipelines.accuracy``, ``kestrel bench --accuracy``, the site)."""

from __future__ import annotations

import json

import pytest
import torch

import kestrel
from kestrel.cli.main import main
from kestrel.kernels.gemm import int8_available
from kestrel.models.sam_parts import Deconv2x2
from kestrel.pipelines import accuracy
from kestrel.site.charts import accuracy_table, bench_charts

pytestmark = pytest.mark.usefixtures("own_calibration")


@pytest.fixture
def vit_dir(small_vit):
    return small_vit(layers=2, labels=10)  # ten classes: top-5 agreement can fall below 1


def test_metrics() -> None:
    ref = torch.tensor([[0.1, 0.9, 0.5, 0.3, 0.2, 0.0], [1.0, 0.0, 0.2, 0.4, 0.3, 0.6]])
    assert accuracy.top_k_agreement(ref, ref, 1) == accuracy.top_k_agreement(ref, ref, 5) == 1.0
    swapped = ref.clone()
    swapped[0, [1, 2]] = swapped[0, [2, 1]]  # the first row's winner changes, its top-5 set does not
    assert accuracy.top_k_agreement(swapped, ref, 1) == 0.5
    assert accuracy.top_k_agreement(swapped, ref, 5) == 1.0
    assert accuracy.spearman(ref, ref) == pytest.approx(1.0)
    assert accuracy.spearman(-ref, ref) == pytest.approx(-1.0)
    a = torch.zeros(4, 4, dtype=torch.bool)
    b = a.clone()
    assert accuracy.mask_iou(a, b) == 1.0  # both empty
    a[:2] = True
    b[1:3] = True
    assert accuracy.mask_iou(a, b) == pytest.approx(4 / 12)
    assert accuracy.cosine(ref, ref) == pytest.approx(1.0)
    assert accuracy.cosine(ref, -ref) == pytest.approx(-1.0)


def test_f32_against_itself_agrees_fully_and_int8_measurably_less(vit_dir) -> None:
    ref = kestrel.load(vit_dir)
    same = accuracy.measure(ref, kestrel.load(vit_dir), batch=8)
    assert set(same.metrics) == {"cosine", "top-1", "top-5", "rel diff"}  # a classifier's metrics, no others
    assert same.metrics["top-1"] == same.metrics["top-5"] == 1.0 and same.metrics["rel diff"] == 0.0
    assert same.metrics["cosine"] == pytest.approx(1.0, abs=1e-6)
    int8 = accuracy.measure(ref, kestrel.load(vit_dir, quantize="int8"), batch=8)
    assert 0 < int8.metrics["rel diff"] < 0.5  # quantised: close, not exact
    assert 0.99 < int8.metrics["cosine"] < 1.0


def test_siglip_ranking_and_sam2_masks(siglip_dir, sam2_small) -> None:
    directory, _, _ = siglip_dir
    ref = kestrel.load(directory)
    acc = accuracy.measure(ref, kestrel.load(directory, quantize="int8"), batch=6)
    assert {"cosine", "text cosine", "ranking", "ranking top-1", "rel diff"} <= set(acc.metrics)
    assert -1.0 <= acc.metrics["ranking"] <= 1.0 and "texts" in acc.inputs
    _, sam2_dir = sam2_small
    sam2 = kestrel.load(sam2_dir)
    same = accuracy.measure(sam2, kestrel.load(sam2_dir), batch=1, prompts=3)
    assert same.metrics["mask IoU"] == 1.0 and same.metrics["rel diff"] == 0.0
    assert "single-point prompts" in same.inputs
    if int8_available():  # int8 covers the mask upscaling's transposed convolutions too: GEMMs on a weight
        quantised = kestrel.load(sam2_dir, quantize="int8")
        deconvs = [m for m in quantised.modules() if isinstance(m, Deconv2x2)]
        assert deconvs and all(getattr(m.weight, "_kestrel_int8", False) for m in deconvs)


def test_bench_times_the_fast_path_beside_f32_and_prints_its_accuracy(vit_dir, capsys) -> None:
    assert main(["bench", str(vit_dir), "--batch", "1,2", "--repeat", "1", "--quantize", "int8", "--accuracy"]) == 0
    out = capsys.readouterr().out
    timed = [ln.split() for ln in out.splitlines() if ln.startswith(("f32 ", "int8 "))]
    assert [(r[0], r[1]) for r in timed] == [("f32", "1"), ("int8", "1"), ("f32", "2"), ("int8", "2")]
    assert all(r[-2].endswith("x") for r in timed) and timed[0][-2] == "1.00x"  # speed-up against f32
    assert "accuracy against f32" in out and "| top-1 | top-5 |" in out and "mask IoU" not in out
    assert main(["bench", str(vit_dir), "--accuracy"]) == 2  # nothing to compare with f32
    assert "give --dtype bf16|f16 or --quantize int8" in capsys.readouterr().err


def test_the_site_shows_an_accuracy_run(tmp_path) -> None:
    run = {"kind": "accuracy", "date": "2026-12-04", "command": "python bench/accuracy.py", "machine": {"cpu": "X"},
           "note": "small configs", "rows": [
               {"model": "vit", "family": "vit", "option": "int8", "inputs": "16 seeded images",
                "metrics": {"cosine": 0.9996, "top-1": 1.0, "top-5": 0.975, "rel diff": 0.05}},
               {"model": "sam", "family": "sam", "option": "bf16", "inputs": "4 images",
                "metrics": {"mask IoU": 0.98}}]}
    html = accuracy_table(run, "vit")
    assert "top-5 agreement" in html and "0.975" in html and "<code>int8</code>" in html and "mask IoU" not in html
    assert accuracy_table(run, "dinov2") == ""
    assert "Accuracy of the fast paths" in bench_charts([run], "sam")
    path = tmp_path / "accuracy.json"
    path.write_text(json.dumps(run))
    from kestrel.site.build import read_bench

    assert read_bench(path)[0]["kind"] == "accuracy"
