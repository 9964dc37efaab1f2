"""kestrel.export.onnx: one ONNX file per entry, run by onnxruntime, equal to Kestrel; the manifest."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch

import kestrel
from kestrel.export.onnx import ExportError, export_onnx

transformers = pytest.importorskip("transformers")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")


def _session(path):
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def _close(actual: np.ndarray, expected: torch.Tensor) -> None:
    ref = expected.detach().numpy()
    assert actual.shape == ref.shape
    scale = float(np.abs(ref).max())
    assert float(np.abs(actual - ref).max()) <= 1e-4 * scale


@pytest.fixture(scope="module")
def vit(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                    intermediate_size=64, image_size=32, patch_size=8, num_labels=5)
    d = tmp_path_factory.mktemp("vit")
    transformers.ViTForImageClassification(config).eval().save_pretrained(d)
    return kestrel.load(d)


@pytest.fixture(scope="module")
def dinov2(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.Dinov2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, mlp_ratio=2,
                                       image_size=42, patch_size=14)
    d = tmp_path_factory.mktemp("dinov2")
    transformers.Dinov2Model(config).eval().save_pretrained(d)
    return kestrel.load(d)


@pytest.fixture(scope="module")
def vit_export(vit, tmp_path_factory):
    out = tmp_path_factory.mktemp("vit_onnx")
    return out, export_onnx(vit, out)


def test_vit_every_entry_dynamic_batch(vit, vit_export):
    out, paths = vit_export
    assert [p.name for p in paths] == ["forward.onnx", "features.onnx"]
    assert sorted(p.name for p in out.iterdir()) == ["features.onnx", "forward.onnx", "manifest.json"]
    torch.manual_seed(1)
    for batch in (1, 3):  # neither is the traced batch (2): the axis is really dynamic
        image = torch.randn(batch, 3, 32, 32)
        for path in paths:
            (got,) = _session(path).run(None, {"image": image.numpy()})
            with torch.no_grad():
                _close(got, getattr(vit, path.stem)(image))


def test_vit_manifest(vit_export):
    out, _ = vit_export
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["model"] == "vit::Model"
    assert manifest["batch"] == "dynamic"
    assert manifest["generics"]["D"] == 32 and manifest["generics"]["T"] == "f32"
    rows = {r["entry"]: r for r in manifest["files"]}
    assert list(rows) == ["forward", "features"]
    for entry, out_shape in (("forward", ["B", 5]), ("features", ["B", 17, 32])):
        row = rows[entry]
        data = (out / row["file"]).read_bytes()
        assert row["file"] == f"{entry}.onnx"
        assert row["inputs"] == [{"name": "image", "shape": ["B", 3, 32, 32], "dtype": "f32"}]
        assert row["outputs"] == [{"name": "output", "shape": out_shape, "dtype": "f32"}]
        assert row["bytes"] == len(data)
        assert row["sha256"] == hashlib.sha256(data).hexdigest()
        assert "external_data" not in row


def test_dinov2_fixed_batch(dinov2, tmp_path):
    paths = export_onnx(dinov2, tmp_path, batch=2)
    assert [p.name for p in paths] == ["forward.onnx"]
    sess = _session(paths[0])
    assert sess.get_inputs()[0].shape == [2, 3, 42, 42]
    torch.manual_seed(2)
    image = torch.randn(2, 3, 42, 42)
    (got,) = sess.run(None, {"image": image.numpy()})
    with torch.no_grad():
        _close(got, dinov2(image))
    (row,) = json.loads((tmp_path / "manifest.json").read_text())["files"]
    assert row["inputs"][0]["shape"] == [2, 3, 42, 42]
    assert row["outputs"][0]["shape"] == [2, 10, 32]


def test_selected_entries_and_errors(vit, tmp_path, monkeypatch):
    paths = export_onnx(vit, tmp_path / "one", entries=["features"])
    assert [p.name for p in paths] == ["features.onnx"]
    with pytest.raises(ExportError, match=r"no entry 'logits'.*forward, features"):
        export_onnx(vit, tmp_path / "bad", entries=["logits"])
    with pytest.raises(ExportError, match="batch must be"):
        export_onnx(vit, tmp_path / "bad", batch=0)

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel for op foo")

    monkeypatch.setattr(torch.onnx, "export", broken)
    with pytest.raises(ExportError, match=r"vit::Model\.forward: torch.onnx.export failed: .*no kernel for op foo"):
        export_onnx(vit, tmp_path / "broken")
    assert list((tmp_path / "broken").iterdir()) == []  # nothing half-written
