"""The edge split of seed 002: ``kestrel export DIR --target executorch-webgpu --size 512``.

One small SAM 2.1 checkpoint (Hiera-tiny's four stages, window sizes and a global block, with fewer
blocks and small widths, random weights, saved by transformers) is exported once through the CLI;
the tests read what it wrote: the seed's file set,
the manifest's structure against the seed's, hashes recomputed, op counts read back, the portable
programs' numbers against Kestrel eager and transformers, and the decoder's padding invariance.
The real Hiera-tiny widths and blocks run under ``-m slow``. The default run keeps one block per stage
(two in the third, the second of them global): lowering to ExecuTorch costs time per graph node, and
Hiera-tiny's twelve blocks took the export from ~2 to ~3.5 minutes on a 2-core CPU without testing
anything the shorter stack does not.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("executorch", reason="the ExecuTorch targets need the edge extra: pip install 'kestrel[edge]'")
transformers = pytest.importorskip("transformers")

import kestrel  # noqa: E402
from kestrel.cli.main import main  # noqa: E402
from kestrel.export import edge_sam2  # noqa: E402
from kestrel.export.recipe import read_table  # noqa: E402
from kestrel.export.validation import pte_runner  # noqa: E402
from kestrel.pipelines.prompts import Prompt  # noqa: E402
from reference import SAM2_BUFFERS, SAM2_TABLES, spread_weights  # noqa: E402
from seeds import SEEDS  # noqa: E402

SIZE = 512
TOL = 1e-4
BLOCKS = [1, 1, 2, 1]  # Hiera blocks per stage of the small checkpoint (Hiera-tiny: 1, 2, 7, 2)


def seed_manifest() -> dict | None:
    """Seed 002 parsed (the table bars stripped), or None when ../shared is not beside the clone."""
    paths = sorted(SEEDS.glob("002_*.txt")) if SEEDS.is_dir() else []
    if not paths:
        return None
    lines = paths[0].read_text().splitlines()
    return json.loads("\n".join(line.strip()[1:-1] if line.strip().startswith("|") else line for line in lines))


def small_checkpoint(directory: Path, hd: int = 32, seed: int = 0) -> Path:
    """A transformers Sam2Model at small widths, Hiera-tiny's stages shortened, every weight random."""
    config = transformers.Sam2Config(
        vision_config=dict(backbone_config=dict(
            model_type="sam2_hiera_det_model", hidden_size=16, embed_dim_per_stage=[16, 32, 64, 128],
            num_attention_heads_per_stage=[1, 2, 2, 4], blocks_per_stage=BLOCKS,
            window_size_per_stage=[8, 4, 14, 7], global_attention_blocks=[3],
            window_positional_embedding_background_size=[7, 7]),
            backbone_channel_list=[128, 64, 32, 16], fpn_hidden_size=hd),
        prompt_encoder_config=dict(hidden_size=hd),
        mask_decoder_config=dict(hidden_size=hd, num_attention_heads=2, mlp_dim=64, iou_head_hidden_dim=hd))
    torch.manual_seed(seed)
    ref = transformers.Sam2Model(config).eval()
    with torch.no_grad():  # upstream zero-initialises some tables: make every number count
        spread_weights(ref, SAM2_TABLES, SAM2_BUFFERS, norms=False)
    ref.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory) -> Path:
    ckpt = small_checkpoint(tmp_path_factory.mktemp("sam2_small"))
    out = tmp_path_factory.mktemp("sam2_edge")
    assert main(["export", str(ckpt), "--target", "executorch-webgpu", "--size", str(SIZE), "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def manifest(export_dir) -> dict:
    return json.loads((export_dir / "manifest.json").read_text())


def structure_mismatches(seed, ours, path: str = "") -> list[str]:
    """Every key of ``seed`` present in ``ours`` with the same JSON type, recursively (each list item
    against the seed's item at the same index, or its last one); returns what differs."""
    out: list[str] = []
    if isinstance(seed, dict):
        if not isinstance(ours, dict):
            return [f"{path}: object expected, got {type(ours).__name__}"]
        if path.endswith((".ops", ".non_delegated_kernels")):  # op name -> count: the names depend on the model
            return [f"{path}.{k}: count expected" for k, v in ours.items() if not isinstance(v, int)]
        for k, v in seed.items():
            if k not in ours:
                out.append(f"{path}.{k}: missing")
            else:
                out += structure_mismatches(v, ours[k], f"{path}.{k}")
    elif isinstance(seed, list):
        if not isinstance(ours, list):
            return [f"{path}: array expected, got {type(ours).__name__}"]
        if seed and ours:
            for i, item in enumerate(ours):
                out += structure_mismatches(seed[min(i, len(seed) - 1)], item, f"{path}[{i}]")
    elif isinstance(seed, bool) or isinstance(ours, bool):
        if type(seed) is not type(ours):
            out.append(f"{path}: {type(seed).__name__} expected, got {type(ours).__name__}")
    elif isinstance(seed, (int, float)):
        if not isinstance(ours, (int, float)):
            out.append(f"{path}: number expected, got {type(ours).__name__}")
    elif type(seed) is not type(ours):
        out.append(f"{path}: {type(seed).__name__} expected, got {type(ours).__name__}")
    return out


def test_structure_helper_catches_differences():
    seed = {"a": {"b": [{"c": 1}]}, "d": "x"}
    assert structure_mismatches(seed, {"a": {"b": [{"c": 2.5}]}, "d": "y", "extra": 1}) == []
    assert structure_mismatches(seed, {"a": {"b": [{"c": "1"}]}}) == [".a.b[0].c: number expected, got str",
                                                                       ".d: missing"]


def test_manifest_has_every_key_of_the_seed(manifest):
    seed = seed_manifest()
    if seed is None:
        pytest.skip("seed 002 is not beside the clone (../shared/seeds)")
    assert structure_mismatches(seed, manifest) == []
    # the file-named tables carry the seed's names
    for key in ("programs", "prompt_tables", "prompt_table_sources"):
        assert set(manifest["export"][key]) == set(seed["export"][key]), key
    assert set(manifest["files"]) == set(seed["files"])
    assert set(manifest["graph"]) >= set(seed["graph"])


def test_file_set_and_hashes(export_dir, manifest):
    written = sorted(p.name for p in export_dir.iterdir())
    assert written == sorted([*manifest["files"], "manifest.json", "validation.json"])
    for name, row in manifest["files"].items():
        data = (export_dir / name).read_bytes()
        assert row["bytes"] == len(data), name
        assert row["sha256"] == hashlib.sha256(data).hexdigest(), name
    for name in ("sam2_encoder_portable.pte", "sam2_decoder_portable.pte"):
        assert "not for release" in manifest["files"][name]["note"]


def test_programs_and_tables_as_declared(export_dir, manifest):
    e, hd = SIZE // 16, 32
    progs = manifest["export"]["programs"]
    enc, dec = progs["sam2_encoder.pte"], progs["sam2_decoder.pte"]
    assert [(p["name"], p["shape"]) for p in enc["inputs"]] == [("pixels", [1, 3, SIZE, SIZE])]
    assert [(p["name"], p["shape"]) for p in enc["outputs"]] == [
        ("image_embeddings", [1, hd, e, e]), ("hr0", [1, hd, 4 * e, 4 * e]), ("hr1", [1, hd, 2 * e, 2 * e])]
    assert dec["prompt_tokens"] == 3
    assert [p["name"] for p in dec["inputs"]] == ["image_embeddings", "image_pe", "sparse", "dense", "hr0", "hr1"]
    assert [(p["name"], p["shape"]) for p in dec["outputs"]] == [
        ("masks", [1, 3, 4 * e, 4 * e]), ("iou_scores", [1, 1, 3]), ("object_score_logits", [1, 1, 1])]
    model = kestrel.load(manifest["upstream"]["model"], E=e)
    tables = {n: t for n, (t, _) in edge_sam2.prompt_tables(model).items()}
    for name, row in manifest["export"]["prompt_tables"].items():
        got = read_table(export_dir / name, row["shape"])
        assert torch.equal(got, tables[name].reshape(row["shape"])), name
    assert torch.equal(read_table(export_dir / "prompt_not_a_point.bin", [hd]), model.not_a_point_embed[0])
    for name, summary in manifest["graph"].items():
        assert summary["io_contract"].startswith("matches"), (name, summary["io_contract"])


def test_op_counts_read_back(manifest):
    """The WebGPU programs' op counts come from the serialized Vulkan graph; the portable ones run
    every op as a portable kernel. Whatever did not delegate is named, never hidden."""
    for stem in ("sam2_encoder", "sam2_decoder"):
        web, portable = manifest["graph"][stem], manifest["graph"][f"{stem}_portable"]
        assert portable["delegates"] == [] and sum(portable["non_delegated_kernels"].values()) > 50
        assert web["delegates"] and all(d["id"] == "VulkanBackend" for d in web["delegates"])
        ops = op_totals(d["ops"] for d in web["delegates"])
        assert ops["aten.convolution.default"] >= (5 if stem == "sam2_encoder" else 4)
        assert ops["et_vk.sdpa.default"] == (sum(BLOCKS) if stem == "sam2_encoder" else 7)  # every attention rewritten
    rewrites = manifest["export"]["graph_rewrites"]
    assert any(r.startswith("attention via torch.ops.et_vk.sdpa") and r.endswith(f"({sum(BLOCKS) + 7} nodes)")
               for r in rewrites)


def op_totals(rows) -> dict[str, int]:
    total: dict[str, int] = {}
    for row in rows:
        for k, v in row.items():
            total[k] = total.get(k, 0) + v
    return total


def test_validation_numbers(export_dir):
    report = json.loads((export_dir / "validation.json").read_text())
    assert report["summary"]["passed"], report["summary"]
    refs = {c["reference"].split(" ")[0] for c in report["cases"]}
    assert refs == {"kestrel", "transformers"}
    decodes = [c for c in report["cases"] if c["program"] == "sam2_decoder_portable.pte"]
    assert len(decodes) == 2 * len(edge_sam2.prompts_for(SIZE))
    for c in report["cases"]:
        for name, o in c["outputs"].items():
            assert o["relative"] <= TOL, (c["program"], c["reference"], name, o)
            if name == "masks":
                assert o["mask_iou"] >= 0.99
                assert o["max_abs_reference"] > 0


def test_decoder_program_padding_invariance(export_dir, manifest):
    """One point padded to three tokens through the portable program equals Kestrel's
    ``decode_tokens`` on the unpadded two tokens (the point and upstream's not-a-point)."""
    e = SIZE // 16
    model = kestrel.load(manifest["upstream"]["model"], E=e)
    tables = edge_sam2.load_tables(export_dir, 32, e)
    prompt = Prompt([(100.0, 300.0)], [1])
    padded = edge_sam2.compose_tokens(tables, prompt, SIZE, 3)
    unpadded = edge_sam2.compose_tokens(tables, prompt, SIZE, 2)
    assert torch.equal(padded[:, :, :2], unpadded)
    pixels = edge_sam2.preprocess(edge_sam2.photo_like(SIZE, seed=5), SIZE)
    with torch.no_grad():
        emb, hr0, hr1 = model.encode_image(pixels)
        pe, dense = tables["prompt_img_pos.bin"], tables["prompt_dense.bin"]
        want = model.decode_tokens(emb, pe, unpadded, dense, hr0, hr1)
    got = pte_runner(export_dir / "sam2_decoder_portable.pte")([emb, pe, padded, dense, hr0, hr1])
    masks = want[0].reshape(1, 3, 4 * e, 4 * e)
    for a, b in zip(got, [masks, want[1], want[2]]):
        assert float((a - b).abs().max()) <= TOL * float(b.abs().max())


def test_compose_rejects_a_prompt_that_does_not_fit():
    tables = {n: torch.ones(8) for n in edge_sam2.TABLE_SHAPES}
    tables["prompt_gaussian.bin"] = torch.randn(2, 4)
    prompt = Prompt([(1.0, 2.0)] * 3, [1, 1, 0])
    with pytest.raises(ValueError, match="needs 4 tokens"):
        edge_sam2.compose_tokens(tables, prompt, 64)


# ----------------------------------------------------------------------------------- ONNX, real size


@pytest.mark.slow
def test_onnx_split_validates_with_onnxruntime(tmp_path):
    pytest.importorskip("onnxruntime")
    ckpt = small_checkpoint(tmp_path / "ckpt")
    out = tmp_path / "onnx"
    assert main(["export", str(ckpt), "--target", "onnx", "--size", str(SIZE), "--out", str(out)]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert set(manifest["export"]["programs"]) == {"sam2_encoder.onnx", "sam2_decoder.onnx"}
    report = json.loads((out / "validation.json").read_text())
    assert report["summary"]["passed"] and report["summary"]["lowest_mask_iou"] >= 0.99
    assert {c["runtime"] for c in report["cases"]} == {"onnxruntime (CPUExecutionProvider)"}
    seed = seed_manifest()
    if seed is not None:
        assert structure_mismatches(seed["export"], manifest["export"]) == []


@pytest.mark.slow
def test_real_tiny_config_fully_delegated(tmp_path):
    """Hiera-tiny's real widths (Sam2Config defaults) at 512: the seed's claim that the encoder has
    no non-delegated kernel, and the validation bounds."""
    torch.manual_seed(0)
    ckpt = tmp_path / "tiny"
    transformers.Sam2Model(transformers.Sam2Config()).eval().save_pretrained(ckpt)
    out = tmp_path / "edge"
    assert main(["export", str(ckpt), "--target", "executorch-webgpu", "--size", "512", "--out", str(out)]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    seed = seed_manifest()
    if seed is not None:
        assert structure_mismatches(seed, manifest) == []
    assert manifest["graph"]["sam2_encoder"]["non_delegated_kernels"] == {}
    assert manifest["export"]["programs"]["sam2_decoder.pte"]["inputs"][2]["shape"] == [1, 1, 3, 256]
    assert json.loads((out / "validation.json").read_text())["summary"]["passed"]


def test_unknown_target_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:  # argparse's usage error, in Kestrel's style
        main(["export", str(tmp_path), "--target", "executorch-metal", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("kestrel export: error: argument --target: invalid choice: "
                                                "'executorch-metal'") and "executorch-webgpu" in err
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_any_model_one_program_per_entry(tmp_path):
    """The generic recipe: a small ViT, every entry as a portable and an XNNPACK program."""
    torch.manual_seed(0)
    config = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                    image_size=32, patch_size=8, num_labels=5)
    transformers.ViTForImageClassification(config).eval().save_pretrained(tmp_path / "vit")
    for target, suffix in (("executorch-portable", "_portable.pte"), ("executorch-xnnpack", "_xnnpack.pte")):
        out = tmp_path / target
        assert main(["export", str(tmp_path / "vit"), "--target", target, "--out", str(out)]) == 0
        manifest = json.loads((out / "manifest.json").read_text())
        assert set(manifest["files"]) == {f"forward{suffix}", f"features{suffix}"}
        assert json.loads((out / "validation.json").read_text())["summary"]["passed"]


def test_programs_carry_their_signatures(export_dir, manifest, capsys):
    """Issue 26: each program's typed signature in the manifest, its ports the program's own, and
    ``kestrel.exported.load`` of the portable twin checking calls before executorch.runtime runs them."""
    import kestrel.exported
    from kestrel.runtime.signature import SignatureError

    for name, row in manifest["export"]["programs"].items():
        sig = row["signature"]
        assert [(p["name"], p["shape"]) for p in sig["inputs"]] == [(p["name"], p["shape"]) for p in row["inputs"]]
        assert [(p["name"], p["shape"]) for p in sig["outputs"]] == [(p["name"], p["shape"]) for p in row["outputs"]]
        assert sig["dynamic"] == [] and sig["fixed"]["B"] == 1, name
    decoder = kestrel.exported.load(export_dir / "sam2_decoder_portable.pte")
    assert decoder.runtime == "executorch" and decoder.signature.fixed == {"B": 1, "Pts": 1, "N": 3}
    e, hd = SIZE // 16, 32
    torch.manual_seed(0)
    inputs = [torch.randn(1, hd, e, e), torch.randn(1, hd, e, e), torch.randn(1, 1, 3, hd), torch.randn(1, hd, e, e),
              torch.randn(1, hd, 4 * e, 4 * e), torch.randn(1, hd, 2 * e, 2 * e)]
    masks, iou, obj = decoder(*inputs)
    assert masks.shape == (1, 3, 4 * e, 4 * e) and iou.shape == (1, 1, 3) and obj.shape == (1, 1, 1)
    with pytest.raises(SignatureError, match="sparse has N = 4, but the program was exported with N = 3"):
        decoder(*inputs[:2], torch.randn(1, 1, 4, hd), *inputs[3:])
    with pytest.raises(SignatureError, match="hr0 has B = 2, but the program was exported with B = 1"):
        decoder(*inputs[:4], torch.randn(2, hd, 4 * e, 4 * e), inputs[5])
    assert main(["inspect", str(export_dir / "manifest.json")]) == 0
    out = capsys.readouterr().out
    assert "sam2_decoder.pte, sam2_decoder_portable.pte: sam2::Model.sam2_decoder" in out
