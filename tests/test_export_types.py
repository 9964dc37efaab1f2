"""Exports that keep their types (issue 26): ONNX axes named after the generics, the signature carried
in metadata_props and manifests, calls checked on load (Python and the page's JavaScript), and every
exported program run at several values of each dynamic generic at export time.

Small configs; one entry per family in the default run, every entry of every family under ``-m slow``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kestrel
import kestrel.exported
from kestrel.blocks.decl import format_signature
from kestrel.cli.main import main
from kestrel.export.onnx import ExportError, export_onnx, verify_program
from kestrel.runtime.signature import Signature, SignatureError, entry_signature

transformers = pytest.importorskip("transformers")
onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

sys.path.insert(0, str(Path(__file__).parent))
STATIC = Path(__file__).resolve().parents[1] / "src" / "kestrel" / "web" / "static"
NODE = shutil.which("node")


def _sam_dir(d: Path) -> Path:
    torch.manual_seed(0)
    cfg = dict(vision_config=dict(hidden_size=32, num_attention_heads=2, mlp_dim=64, output_channels=32,
                                  num_pos_feats=16, num_hidden_layers=2, global_attn_indexes=[1]),
               prompt_encoder_config=dict(hidden_size=32),
               mask_decoder_config=dict(hidden_size=32, num_attention_heads=2, mlp_dim=64, iou_head_hidden_dim=32))
    transformers.SamModel(transformers.SamConfig(**cfg)).eval().save_pretrained(d)
    return d


def _checkpoint(family: str, d: Path) -> Path:
    torch.manual_seed(0)
    if family == "vit":
        config = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                        intermediate_size=64, image_size=32, patch_size=8, num_labels=5)
        transformers.ViTForImageClassification(config).eval().save_pretrained(d)
    elif family == "dinov2":
        config = transformers.Dinov2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, mlp_ratio=2,
                                           image_size=42, patch_size=14)
        transformers.Dinov2Model(config).eval().save_pretrained(d)
    elif family == "siglip":
        tower = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
        config = transformers.SiglipConfig(vision_config=dict(image_size=32, patch_size=8, **tower),
                                           text_config=dict(vocab_size=100, max_position_embeddings=16, **tower))
        transformers.SiglipModel(config).eval().save_pretrained(d)
    elif family == "sam":
        _sam_dir(d)
    else:
        from test_sam2 import seeded_sam2, small_config

        seeded_sam2(small_config(256)).save_pretrained(d)
    return d


# one entry per family in the default run (each with generics shared between inputs where it has them)
FAST = {"vit": ["features"], "dinov2": ["forward"], "siglip": ["similarity"], "sam": ["decode_points"],
        "sam2": ["decode_boxes"]}


@pytest.fixture(scope="module")
def sam(tmp_path_factory):
    return kestrel.load(_sam_dir(tmp_path_factory.mktemp("sam")))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.to(torch.float64), b.to(torch.float64)
    scale = float(b.abs().max()) if b.numel() else 0.0
    diff = float((a - b).abs().max()) if b.numel() else 0.0
    return diff / scale if scale else diff


def _inputs(sig: Signature, binding: dict[str, int], seed: int) -> list[torch.Tensor]:
    from kestrel.export.onnx import InputSpec, example_inputs
    from kestrel.types.dtypes import DTYPES

    return example_inputs([InputSpec(p.name, p.shape, DTYPES[p.dtype]) for p in sig.inputs], binding, seed)


def check_exported(model, out: Path, entries: list[str]) -> None:
    """What the issue's 'Done when' asks of every exported ONNX entry."""
    manifest = json.loads((out / "manifest.json").read_text())
    rows = {r["entry"]: r for r in manifest["files"]}
    decl = type(model).decl()
    for entry in entries:
        fn = decl.function(entry)
        path = out / f"{entry}.onnx"
        proto = onnx.load(str(path), load_external_data=False)
        props = {p.key: p.value for p in proto.metadata_props}
        # the signature in the seeds' notation, as the inspector prints the entry
        assert props["kestrel.signature"] == format_signature(fn, decl.order)
        sig = Signature.from_json(props["kestrel.signature.json"])
        assert sig.to_json() == rows[entry]["signature"]
        assert set(sig.dynamic) == fn.free_dims and sig.fixed == {}  # the default: batch and prompt counts
        # every dynamic axis named after its generic, in the graph's inputs and outputs
        for values, ports in ((proto.graph.input, sig.inputs), (proto.graph.output, sig.outputs)):
            for v, port in zip(values, ports):
                dims = [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
                assert dims == list(port.shape), (entry, v.name)
                assert any(isinstance(d, str) for d in dims)
        # proved at export: the traced binding and two other values of each dynamic generic
        verified = rows[entry]["verified"]
        assert len(verified) == 1 + 2 * len(sig.dynamic)
        for g in sig.dynamic:
            assert len({r["binding"][g] for r in verified}) == 3
        for r in verified:
            assert [tuple(s) for s in r["outputs"]] == sig.output_shapes(r["binding"])
            assert r["worst_relative"] <= 1e-4
        # checked calls: correct ones run at other values, with the declared shapes and eager's numbers
        program = kestrel.exported.load(path, threads=1)
        assert program.signature.text == sig.text
        traced = verified[0]["binding"]
        for g in sig.dynamic:
            binding = {**{k: 1 for k in sig.dynamic}, g: traced[g] + 1}
            inputs = _inputs(sig, binding, seed=7)
            got = program(*inputs)
            got = list(got) if isinstance(got, tuple) else [got]
            with torch.no_grad():
                want = getattr(model, entry)(*inputs)
            want = list(want) if isinstance(want, (tuple, list)) else [want]
            assert [tuple(t.shape) for t in got] == sig.output_shapes(binding)
            for a, b in zip(got, want):
                assert _rel(a, b) <= 1e-4
        # a mismatched call is refused before onnxruntime, naming the generic
        inputs = _inputs(sig, {k: 2 for k in sig.dynamic}, seed=3)
        bad = inputs[-1][:1] if inputs[-1].shape[0] > 1 else inputs[-1]
        if len(inputs) > 1 and sig.inputs[-1].shape[0] == sig.inputs[0].shape[0]:
            g = sig.inputs[0].shape[0]
            with pytest.raises(SignatureError, match=rf"{sig.inputs[-1].name} has {g} = 1, "
                                                     rf"{sig.inputs[0].name} has {g} = 2"):
                program(*inputs[:-1], bad)


@pytest.mark.parametrize("family", sorted(FAST))
def test_every_family_exports_typed_onnx(family, tmp_path):
    model = kestrel.load(_checkpoint(family, tmp_path / "ckpt"))
    export_onnx(model, tmp_path / "out", entries=FAST[family])
    check_exported(model, tmp_path / "out", FAST[family])


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAST))
def test_every_entry_of_every_family(family, tmp_path):
    model = kestrel.load(_checkpoint(family, tmp_path / "ckpt"))
    entries = [f.pyname for f in type(model).decl().entries]
    export_onnx(model, tmp_path / "out")
    check_exported(model, tmp_path / "out", entries)


# ------------------------------------------------------------------------------- the signature


def _decode_points_signature(sam) -> Signature:
    return entry_signature(sam, type(sam).decl().function("decode_points"), ["B", "Pts"], {"N": 1})


# (shapes, dtypes) -> the refusal, as the issue words it
CASES = [
    ([(1, 32, 64, 64), (1, 2, 1, 2), (1, 3, 1)], ["f32", "f32", "i32"],
     "input_labels has Pts = 3, input_points has Pts = 2"),
    ([(2, 32, 64, 64), (1, 2, 1, 2), (1, 2, 1)], ["f32", "f32", "i32"],
     "input_points has B = 1, image_embeddings has B = 2"),
    ([(1, 32, 64, 64), (1, 2, 3, 2), (1, 2, 3)], ["f32", "f32", "i32"],
     "input_points has N = 3, but the program was exported with N = 1 (fixed at export; an ONNX export with "
     "--dynamic N keeps it dynamic)"),
    ([(1, 16, 64, 64), (1, 2, 1, 2), (1, 2, 1)], ["f32", "f32", "i32"],
     "image_embeddings has Hd = 16, the model binds Hd = 32"),
    ([(1, 32, 64, 64), (1, 2, 1, 2), (1, 2, 1)], ["f32", "f64", "i32"],
     "input_points has dtype f64, declared T = f32"),
    ([(1, 32, 64, 64), (1, 2, 1), (1, 2, 1)], ["f32", "f32", "i32"], "input_points has 3 axes, declared 4"),
]


def test_signature_binds_and_refuses_in_the_issues_words(sam):
    sig = _decode_points_signature(sam)
    assert sig.text == format_signature(type(sam).decl().function("decode_points"), type(sam).decl().order)
    again = Signature.from_json(json.dumps(sig.to_json()))
    assert again == sig
    assert again.bind([(1, 32, 64, 64), (1, 2, 1, 2), (1, 2, 1)], ["f32", "f32", "i32"]) == {"B": 1, "Pts": 2, "N": 1}
    assert again.output_shapes({"B": 3, "Pts": 2}) == [(3, 2, 4, 256, 256), (3, 2, 4)]
    for shapes, dtypes, why in CASES:
        with pytest.raises(SignatureError) as e:
            again.bind(shapes, dtypes, "decode_points.onnx")
        assert str(e.value).startswith(f"sam::Model.decode_points (decode_points.onnx): {why}: input "), str(e.value)
    meta = sig.metadata()
    assert meta["kestrel.dynamic"] == "B, Pts" and meta["kestrel.generics"].endswith("T = f32, N = 1")
    assert "D % VisionHeads == 0" in meta["kestrel.where"]
    # a where fact that names a dynamic generic is checked at the call
    doc = sig.to_json()
    doc["where"] = [*doc["where"], "Pts <= 4"]
    with pytest.raises(SignatureError, match=r"`where Pts <= 4` does not hold for Pts = 5"):
        Signature.from_json(doc).bind([(1, 32, 64, 64), (1, 5, 1, 2), (1, 5, 1)], ["f32", "f32", "i32"])
    with pytest.raises(SignatureError, match="not a Kestrel signature"):
        Signature.from_json({"format": "other"})


def test_fixed_generics_and_the_cli(sam, tmp_path, capsys):
    # Python API: Pts dynamic, N fixed by leaving it out of `dynamic`
    paths = export_onnx(sam, tmp_path / "api", entries=["decode_points"], dynamic=["B", "Pts"])
    program = kestrel.exported.load(paths[0])
    assert program.signature.fixed == {"N": 1}
    sess_dims = [d.dim_param or d.dim_value for d in onnx.load(str(paths[0])).graph.input[1].type.tensor_type.shape.dim]
    assert sess_dims == ["B", "Pts", 1, 2]
    emb, pts, lab = torch.randn(1, 32, 64, 64), torch.rand(1, 2, 1, 2) * 1000, torch.ones(1, 2, 1, dtype=torch.int32)
    masks, iou = program(emb, pts, lab)
    assert masks.shape == (1, 2, 4, 256, 256) and iou.shape == (1, 2, 4)
    with pytest.raises(SignatureError, match="input_labels has Pts = 3, input_points has Pts = 2"):
        program(emb, pts, torch.ones(1, 3, 1, dtype=torch.int32))
    with pytest.raises(SignatureError, match="input_points has N = 2, but the program was exported with N = 1"):
        program(emb, torch.rand(1, 2, 2, 2), torch.ones(1, 2, 2, dtype=torch.int32))
    with pytest.raises(ExportError, match="exported entries of sam::Model: no generic Q; the generics are "):
        export_onnx(sam, tmp_path / "bad", entries=["decode_points"], dynamic=["Q"])

    # `kestrel inspect FILE.onnx` prints the entry as the seeds print entries
    assert main(["inspect", str(paths[0])]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[2:4] == ["Entries", "  " + program.signature.text]
    assert "  Pts          dynamic" in lines and "  N            1 (fixed at export)" in lines
    assert "  Hd           32" in lines
    assert main(["inspect", str(tmp_path / "api" / "manifest.json")]) == 0
    assert "  " + program.signature.text in capsys.readouterr().out


def test_cli_dynamic_flag(tmp_path, capsys):
    ckpt = _checkpoint("vit", tmp_path / "vit")
    assert main(["export", str(ckpt), "--target", "onnx", "--dynamic", "B", "--batch", "2",
                 "--out", str(tmp_path / "both")]) == 2
    assert "B is both dynamic and given a fixed value" in capsys.readouterr().err
    assert main(["export", str(ckpt), "--target", "onnx", "--dynamic", "none", "--out", str(tmp_path / "fixed")]) == 0
    program = kestrel.exported.load(tmp_path / "fixed" / "forward.onnx")
    assert program.signature.dynamic == () and program.signature.fixed == {"B": 1}
    with pytest.raises(SignatureError, match="image has B = 2, but the program was exported with B = 1"):
        program(torch.randn(2, 3, 32, 32))
    assert main(["export", str(ckpt), "--target", "onnx", "--dynamic", "Pts", "--out", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err
    assert "--dynamic, the exported entries of vit::Model: no generic Pts; the generics are B" in err


def test_export_time_check_refuses_a_program_off_its_declaration(sam, tmp_path):
    paths = export_onnx(sam, tmp_path, entries=["embed_boxes"], verify=False)
    sig = kestrel.exported.signature_of(paths[0])
    doc = sig.to_json()
    doc["outputs"][0]["type"] = "Tensor[B, Nb, 3, Hd; T]"  # what the program does not do
    wrong = Signature.from_json(doc)
    with pytest.raises(ExportError, match=r"at B = 2, Nb = 3: output output has shape \(2, 3, 2, 32\), declared "
                                          r"Tensor\[B, Nb, 3, Hd; T\]"):
        verify_program(paths[0], wrong, lambda *xs: sam.embed_boxes(*xs), {"B": 2, "Nb": 3})


# ----------------------------------------------------------------------------------- the page


SCRIPT = """
import { checkCall } from '%s/signature.js';
import fs from 'fs';
const job = JSON.parse(fs.readFileSync(process.argv[2], 'utf8'));
const out = job.cases.map((c) => {
  const feeds = Object.fromEntries(job.signature.inputs.map((p, i) => [p.name,
                                                                       { dims: c.shapes[i], type: c.types[i] }]));
  try { return { ok: checkCall(job.signature, feeds, 'decode_points.onnx') }; }
  catch (e) { return { error: e.message }; }
});
console.log(JSON.stringify(out));
"""

ORT = {"f32": "float32", "f64": "float64", "i32": "int32"}


@pytest.mark.skipif(NODE is None, reason="Node.js is not installed (the page's JavaScript runs on it)")
def test_page_refuses_mismatched_prompts_in_the_same_words(sam, tmp_path):
    sig = _decode_points_signature(sam)
    good = ([(1, 32, 64, 64), (1, 2, 1, 2), (1, 2, 1)], ["f32", "f32", "i32"], None)
    cases = [good, *CASES]
    job = {"signature": sig.to_json(),
           "cases": [{"shapes": s, "types": [ORT[t] for t in d]} for s, d, _ in cases]}
    (tmp_path / "job.json").write_text(json.dumps(job))
    (tmp_path / "run.mjs").write_text(SCRIPT % STATIC.as_posix())
    done = subprocess.run([NODE, str(tmp_path / "run.mjs"), str(tmp_path / "job.json")], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout)
    assert results[0] == {"ok": {"B": 1, "Pts": 2, "N": 1}}
    for (shapes, dtypes, why), got in zip(CASES, results[1:]):
        with pytest.raises(SignatureError) as e:
            sig.bind(shapes, dtypes, "decode_points.onnx")
        python_why = str(e.value).split(": input ")[0]
        assert got["error"].split(": input ")[0] == python_why
        assert why in got["error"]


@pytest.mark.skipif(NODE is None, reason="Node.js is not installed")
def test_page_checks_the_split_decoder_signature(tmp_path):
    """The SAM 2.1 split's decoder signature (what the page reads from the manifest): its sparse tokens
    are N = 3 fixed at export; four tokens are refused naming N."""
    from kestrel.export.edge_sam2 import split_signatures
    from test_sam2 import seeded_sam2, small_config

    seeded_sam2(small_config(256)).save_pretrained(tmp_path / "ckpt")
    model = kestrel.load(tmp_path / "ckpt")
    _, dec = split_signatures(model)
    assert dec["signature"].startswith("sam2_decoder<B: Dim, Pts: Dim, N: Dim>(image_embeddings: "
                                       "Tensor[B, Hd, E, E; T]")
    assert [o["shape"] for o in dec["outputs"]] == [[1, 3, 64, 64], [1, 1, 3], [1, 1, 1]]
    hd, e = 32, 16
    shapes = [[1, hd, e, e], [1, hd, e, e], [1, 1, 4, hd], [1, hd, e, e], [1, hd, 4 * e, 4 * e], [1, hd, 2 * e, 2 * e]]
    job = {"signature": dec, "cases": [{"shapes": shapes, "types": ["float32"] * 6}]}
    (tmp_path / "job.json").write_text(json.dumps(job))
    (tmp_path / "run.mjs").write_text(SCRIPT % STATIC.as_posix())
    done = subprocess.run([NODE, str(tmp_path / "run.mjs"), str(tmp_path / "job.json")], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    (result,) = json.loads(done.stdout)
    assert result["error"].startswith("sam2::Model.sam2_decoder (decode_points.onnx): sparse has N = 4, but the "
                                      "program was exported with N = 3")


def test_onnxruntime_sessions_do_not_spin_after_a_run(tmp_path):
    """A program's session runs beside torch work in the same process (pre- and post-processing, eager
    entries): its worker threads must not spin for tens of milliseconds after each run, as onnxruntime's
    do by default, taking the cores from that work."""
    from onnx import TensorProto, helper

    from kestrel.runtime import exported

    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    path = tmp_path / "relu.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    session = exported._session(path, 1)
    assert session.get_session_options().get_session_config_entry(exported.SPIN_ENTRY) == "0"


def test_a_corrupt_onnx_file_is_named_not_an_internal_error(tmp_path, capsys):
    from kestrel.runtime.exported import ExportedError

    bad = tmp_path / "forward.onnx"
    bad.write_bytes(b"not a protobuf")
    with pytest.raises(ExportedError, match=r"forward\.onnx: not a readable ONNX program \("):
        kestrel.exported.load(bad)
    assert main(["inspect", str(bad)]) == 2
    assert "forward.onnx: not a readable ONNX program" in capsys.readouterr().err
