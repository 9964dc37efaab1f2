"""SAM ViT-B: the seed's declarations, a clean check, the ops SAM added, and parity with transformers.

The program fixes the seed's 1024 px input, 12 encoder layers and 64 x 64 grid, so the default-run
parity uses the real structure at small widths (D = Hd = 32); the real widths run under ``-m slow``.
"""

import json

import pytest
import torch
from transformers import SamModel
from transformers.models.sam.configuration_sam import SamVisionConfig
from transformers.models.sam.modeling_sam import SamVisionLayer

import kestrel
from kestrel.blocks import Block, Dim, EntryError, Float, Param
from kestrel.checker.check import check_block_class, check_program
from kestrel.inspect.printer import format_block, listed_blocks
from kestrel.models import sam
from kestrel.models.cards import CARDS
from kestrel.std import ops
from reference import SMALL, rel_diff, seeded_sam
from seeds import read_seed

TOL = 1e-4




# ---------------------------------------------------------------------------------------- declarations


# what Model adds beyond the seed: the mask-prompt encoder and the entries of mixed prompts
MODEL_ADDITIONS = ("sub mask_conv1", "sub mask_norm1", "sub mask_conv2", "sub mask_norm2", "sub mask_conv3",
                   "pub entry embed_points<", "pub entry embed_boxes<", "pub entry embed_masks<",
                   "pub entry no_mask_embeddings", "pub entry decode<")


def test_every_block_prints_exactly_as_the_seed():
    seed = read_seed("000")
    ours = {b.qualname: format_block(b) for b in listed_blocks(sam.Model)}
    assert list(ours) == list(seed.blocks)
    for name, text in seed.blocks.items():
        if name != "sam::Model":
            assert ours[name] == text, f"{name}:\n{ours[name]}\n--- seed:\n{text}"
    # Model: the seed's lines, in order, and after them only the listed additions
    mine = ours["sam::Model"].splitlines()
    kept = [line for line in mine if not line.strip().startswith(MODEL_ADDITIONS)]
    assert kept == seed.blocks["sam::Model"].splitlines()
    assert len(mine) - len(kept) == len(MODEL_ADDITIONS)


def test_encoder_layers_come_from_the_layout():
    base = [f"  sub layer_{i}: VisionLayer{'Global' if i % 3 == 2 else 'Windowed'}<D, Heads, Inner, T>"
            for i in range(12)]
    assert [line for line in format_block(sam.VisionEncoder.decl()).splitlines() if "layer_" in line] == base
    large = sam.model_for(24, [5, 11, 17, 23])
    assert sam.model_for(24, (23, 17, 11, 5)) is large and sam.model_for(12, [2, 5, 8, 11]) is sam.Model
    listing = {b.qualname: format_block(b) for b in listed_blocks(large)}
    assert list(listing) == list(read_seed("000").blocks)  # the same blocks, the encoder's own copy
    layers = [line for line in listing["sam::VisionEncoder"].splitlines() if "layer_" in line]
    assert len(layers) == 24 and layers[5].startswith("  sub layer_5: VisionLayerGlobal<")
    assert sum("Global" in line for line in layers) == 4
    with pytest.raises(ValueError, match="global attention"):
        sam.model_for(4, [4])


@pytest.mark.parametrize("layout", [(12, (2, 5, 8, 11)), (24, (5, 11, 17, 23)), (32, (7, 15, 23, 31))])
def test_program_checks_clean(layout):
    report = check_program(sam.model_for(*layout))
    assert report.ok, "\n".join(map(str, report.diagnostics))
    assert report.checked == 27  # every function of every block ran symbolically


def test_cards_of_the_family():
    assert CARDS["sam-vit-large"].generics()["D"] == 1024 and CARDS["sam-vit-huge"].generics()["VisionInner"] == 5120
    huge = CARDS["sam-vit-huge"]
    enc = huge.family.root(huge.config).decl().subs[0].block
    assert len(enc.layout["layer"]) == 32 and len(enc.decl().subs) == 34


def test_card_binds_the_seed_generics():
    card = CARDS["sam-vit-base"]
    assert card.family.root(card.config) is sam.Model
    assert card.generics() == {"D": 768, "VisionHeads": 12, "VisionInner": 3072, "Hd": 256, "MaskHeads": 8,
                               "MaskInner": 2048, "T": "f32"}
    assert card.family.settings(card.config) == {"eps": 1e-6}


@pytest.mark.parametrize("change, field", [
    ({"vision_config": {"window_size": 16}}, "window_size"),
    ({"vision_config": {"global_attn_indexes": [5, 11, 17, 23]}}, "global_attn_indexes"),
    ({"prompt_encoder_config": {"mask_input_channels": 8}}, "mask_input_channels"),
    ({"vision_config": {"image_size": 512}}, "image_size"),
    ({"mask_decoder_config": {"hidden_size": 128}}, "hidden_size"),
])
def test_card_refuses_what_the_program_fixes(change, field):
    card = CARDS["sam-vit-base"]
    cfg = {k: (dict(v, **change.get(k, {})) if isinstance(v, dict) else v) for k, v in card.config.items()}
    with pytest.raises(ValueError, match=field):
        card.family.generics(cfg)


# ------------------------------------------------------------------------------------------- std ops


def test_relative_positions_matches_plain_torch():
    table = torch.randn(2 * 5 - 1, 3)
    idx = torch.arange(5)
    want = table[(idx[:, None] - idx[None, :] + 4).long()]
    assert torch.equal(ops.relative_positions(table, 5), want)
    assert torch.equal(ops.relative_positions(table, 5)[2, 2], table[4])


def test_eq_and_where_match_plain_torch():
    labels = torch.tensor([[1, 0], [-1, -10]], dtype=torch.int32)
    a, b = torch.randn(2, 2, 3), torch.randn(1, 3)
    cond = ops.eq(labels, -1)[..., None]
    assert torch.equal(cond, (labels == -1)[..., None])
    assert torch.equal(ops.where(cond, b, a), torch.where(cond, b, a))
    assert torch.equal(ops.where(cond, 0.0, a), torch.where(cond, 0.0, a))


class _BadRelative(Block, module="test_sam"):
    N: Dim
    C: Dim
    T: Float

    table: Param["2 * N, C; T"]

    def forward(self, x: "Tensor[N, N, C; T]") -> "Tensor[N, N, C; T]":
        return x + ops.relative_positions(self.table, self.N)


class _BadWhere(Block, module="test_sam"):
    N: Dim
    T: Float

    def forward(self, x: "Tensor[N; T]", y: "Tensor[N; i32]") -> "Tensor[N; T]":
        return ops.where(y, x, 0.0)


def test_new_op_rules_report_misuse():
    diag = check_block_class(_BadRelative).diagnostics
    assert len(diag) == 1 and "2n - 1" in diag[0].message
    diag = check_block_class(_BadWhere).diagnostics
    assert len(diag) == 1 and "bool tensor" in diag[0].message


# -------------------------------------------------------------------------------------------- parity





POINTS = torch.tensor([[[[500.0, 300.0], [100.0, 900.0]], [[10.0, 20.0], [1000.0, 3.0]], [[7.0, 1010.0],
                                                                                          [300.0, 301.0]]]])
LABELS = torch.tensor([[[1, 0], [1, -10], [0, -1]]], dtype=torch.int32)
BOXES = torch.tensor([[[100.0, 200.0, 500.0, 700.0], [0.0, 0.0, 1023.0, 1023.0], [3.0, 4.0, 50.0, 60.0]]])


def _reference_masks(ref: SamModel, emb: torch.Tensor, **prompts) -> tuple[torch.Tensor, torch.Tensor]:
    """All four masks: upstream returns the single-mask output or the three multimask ones."""
    with torch.no_grad():
        one = ref(image_embeddings=emb, multimask_output=False, **prompts)
        three = ref(image_embeddings=emb, multimask_output=True, **prompts)
    return torch.cat([one.pred_masks, three.pred_masks], 2), torch.cat([one.iou_scores, three.iou_scores], 2)


def _check_decoders(ref: SamModel, ours, emb: torch.Tensor, figures: dict[str, float]) -> None:
    b = emb.shape[0]
    points, labels, boxes = POINTS.expand(b, -1, -1, -1), LABELS.expand(b, -1, -1), BOXES.expand(b, -1, -1)
    want_masks, want_iou = _reference_masks(ref, emb, input_points=points, input_labels=labels)
    with torch.no_grad():
        masks, iou = ours.decode_points(emb, points, labels)
    figures["points masks"], figures["points iou"] = rel_diff(masks, want_masks), rel_diff(iou, want_iou)
    want_masks, want_iou = _reference_masks(ref, emb, input_boxes=boxes)
    with torch.no_grad():
        masks, iou = ours.decode_boxes(emb, boxes)
    figures["boxes masks"], figures["boxes iou"] = rel_diff(masks, want_masks), rel_diff(iou, want_iou)
    assert max(figures.values()) <= TOL, figures


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    ref = seeded_sam(SMALL)
    path = tmp_path_factory.mktemp("sam-small")
    ref.save_pretrained(path)
    return ref, kestrel.load(path)


def test_small_image_encoder_matches_reference(small):
    ref, ours = small
    x = torch.randn(1, 3, 1024, 1024)
    with torch.no_grad():
        want = ref.get_image_embeddings(x)
        got = ours.encode_image(x)
    assert got.shape == (1, 32, 64, 64)
    assert rel_diff(got, want) <= TOL
    with torch.no_grad():  # the weights are random enough that the embedding depends on the image
        assert rel_diff(ours.encode_image(torch.randn(1, 3, 1024, 1024)), want) > 0.1


@pytest.mark.parametrize("fold", ["always", "0"])  # the attentions folded into the prompt tokens' side, or not
def test_small_decoders_match_reference(small, fold, monkeypatch):
    from kestrel.kernels import folded_attention

    monkeypatch.setenv("KESTREL_FOLD", fold)
    folds = []
    real = folded_attention.folded_attention
    monkeypatch.setattr(folded_attention, "folded_attention", lambda *a: folds.append(1) or real(*a))
    ref, ours = small
    emb = torch.randn(2, 32, 64, 64)
    figures: dict[str, float] = {}
    _check_decoders(ref, ours, emb, figures)
    assert len(folds) == (2 * 7 if fold == "always" else 0)  # two decodes of seven attentions (two among the tokens)


def test_loaded_model_drops_the_neck_biases(small):
    _, ours = small
    neck = ours.vision_encoder.neck
    assert neck.conv1.bias is None and neck.conv2.bias is None
    assert ours.vision_encoder.patch_embed.bias is not None


@pytest.mark.parametrize("window", [14, 0])
def test_vision_layer_matches_reference(window):
    torch.manual_seed(1)
    cfg = SamVisionConfig(hidden_size=32, num_attention_heads=2, mlp_dim=64)
    cfg._attn_implementation = "sdpa"
    ref = SamVisionLayer(cfg, window_size=window).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.3)
    block = (sam.VisionLayerWindowed if window else sam.VisionLayerGlobal)(D=32, Heads=2, Inner=64, T="f32")
    block.load_state_dict(ref.state_dict())
    x = torch.randn(2, 64, 64, 32)
    with torch.no_grad():
        assert rel_diff(block(x), ref(x)) <= TOL


def test_entries_check_their_inputs(small):
    _, ours = small
    with pytest.raises(EntryError, match="input_labels"):
        ours.decode_points(torch.randn(1, 32, 64, 64), POINTS, LABELS.long())
    with pytest.raises(EntryError, match="pixel_values"):
        ours.encode_image(torch.randn(1, 3, 512, 512))


LAYOUTS = [
    pytest.param(4, [1, 3], id="large-like"),  # every third-ish layer global, as ViT-L/H, at a test's depth
    pytest.param(5, [0, 4], id="huge-like"),
    pytest.param(24, [5, 11, 17, 23], id="vit-large", marks=pytest.mark.slow),
    pytest.param(32, [7, 15, 23, 31], id="vit-huge", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("layers, globals_", LAYOUTS)
def test_other_layouts_match_reference(tmp_path, layers, globals_):
    """ViT-L and ViT-H shaped configs: their own depth, global layers and more heads, at small widths."""
    config = {**SMALL, "vision_config": dict(SMALL["vision_config"], num_hidden_layers=layers, num_attention_heads=8,
                                              global_attn_indexes=globals_)}
    ref = seeded_sam(config, seed=3)
    ref.save_pretrained(tmp_path)
    ours = kestrel.load(tmp_path)
    assert len(ours.vision_encoder.layout["layer"]) == layers and hasattr(ours.vision_encoder, f"layer_{layers - 1}")
    x = torch.randn(1, 3, 1024, 1024)
    with torch.no_grad():
        want = ref.get_image_embeddings(x)
        got = ours.encode_image(x)
    assert rel_diff(got, want) <= TOL


@pytest.mark.slow
def test_sam_vit_base_real_config(tmp_path):
    card = CARDS["sam-vit-base"]
    config = {k: v for k, v in card.config.items() if k != "model_type"}
    ref = seeded_sam(config)
    ref.save_pretrained(tmp_path)
    ours = kestrel.load(tmp_path)
    assert {k: v for k, v in ours.generics.items() if k != "T"} == {
        k: v for k, v in card.generics().items() if k != "T"}
    x = torch.randn(1, 3, 1024, 1024)
    with torch.no_grad():
        want = ref.get_image_embeddings(x)
        got = ours.encode_image(x)
    figures = {"image embeddings": rel_diff(got, want)}
    _check_decoders(ref, ours, want, figures)
    print(figures)


@pytest.mark.parametrize("grad", [False, True], ids=["in-place", "autograd"])
@pytest.mark.parametrize("budget", [None, 4096, 1 << 20])
def test_decomposed_attention_slices_give_the_same_numbers(budget, grad):
    """Whole heads, several heads, or rows of one head per slice (the last one short), in the eager
    in-place form and the out-of-place one autograd takes: the full-bias formula's numbers."""
    from kestrel.std.ops_attention import decomposed_attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 36, 8, requires_grad=grad) for _ in range(3))
    rel_h, rel_w = torch.randn(2, 3, 36, 6), torch.randn(2, 3, 36, 6)
    bias = (rel_h[..., :, None] + rel_w[..., None, :]).reshape(2, 3, 36, 36)
    want = torch.softmax(q @ k.transpose(-1, -2) * 8 ** -0.5 + bias, -1) @ v
    got = decomposed_attention(q, k, v, rel_h, rel_w, budget=budget)
    assert rel_diff(got.detach(), want.detach()) <= 1e-6
    if grad:  # and it differentiates
        got.sum().backward()
        assert q.grad is not None and torch.isfinite(q.grad).all()


def test_decomposed_attention_measures_its_slice_size_once_per_shape(tmp_path, monkeypatch):
    """Eager inference times every candidate slice budget at a shape's first call, keeps the fastest in the
    calibration table, and gives the same numbers whichever it runs."""
    from kestrel.kernels import attention as ops_attention
    from kestrel.kernels import calibration as calibrate

    monkeypatch.setenv("KESTREL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("KESTREL_ATTENTION_BUDGET", raising=False)
    monkeypatch.delenv("KESTREL_CALIBRATE", raising=False)
    monkeypatch.setattr(ops_attention, "MIN_CALIBRATED_SCORES", 1)
    monkeypatch.setattr(ops_attention, "SLICE_CANDIDATES", (4096, 1 << 20))
    calibrate.forget()
    runs: list[int] = []
    attend = ops_attention._attend
    monkeypatch.setattr(ops_attention, "_attend", lambda *a: runs.append(a[6]) or attend(*a))
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 36, 8) for _ in range(3))
    rel_h, rel_w = torch.randn(2, 3, 36, 6), torch.randn(2, 3, 36, 6)
    want = ops_attention.decomposed_attention(q, k, v, rel_h, rel_w, budget=1 << 20)
    runs.clear()
    with torch.inference_mode():
        first = ops_attention.decomposed_attention(q, k, v, rel_h, rel_w)
        assert sorted(runs) == sorted([4096, 1 << 20] * ops_attention.ROUNDS)  # every candidate, timed
        entry = calibrate.table().shapes[ops_attention.budget_key(6, 36, 36, 8)]
        assert int(entry["kernel"]) in (4096, 1 << 20) and len(entry["seconds"]) == 2
        runs.clear()
        second = ops_attention.decomposed_attention(q, k, v, rel_h, rel_w)
        assert runs == [int(entry["kernel"])]  # cached: one run with the choice
    calibrate.forget()
    assert json.loads(calibrate.table().path.read_text())["shapes"][ops_attention.budget_key(6, 36, 36, 8)] == entry
    assert rel_diff(first, want) <= 1e-6 and rel_diff(second, want) <= 1e-6
    calibrate.forget()


@pytest.mark.parametrize("value", ["lots", "0", "-5"])
def test_a_bad_attention_budget_is_a_usage_error_naming_the_variable(monkeypatch, value):
    from kestrel.errors import UsageError
    from kestrel.std.ops_attention import decomposed_attention

    monkeypatch.setenv("KESTREL_ATTENTION_BUDGET", value)
    q = torch.randn(1, 1, 4, 2)
    with pytest.raises(UsageError, match=f"KESTREL_ATTENTION_BUDGET={value!r}: expected a positive number of bytes"):
        decomposed_attention(q, q, q, torch.randn(1, 1, 4, 2), torch.randn(1, 1, 4, 2))


def test_cli_segment_point_writes_mask_and_overlay(small, tmp_path, capsys):
    import numpy as np
    from PIL import Image

    from kestrel.cli.main import main

    ref, ours = small
    rng = np.random.default_rng(0)
    Image.fromarray((rng.random((300, 400, 3)) * 255).astype(np.uint8)).save(tmp_path / "photo.jpg")
    model_dir = str(ours.loaded.directory)
    out, emb = tmp_path / "out", tmp_path / "photo.emb.safetensors"
    args = ["segment", str(tmp_path / "photo.jpg"), "--point", "200,150", "--model", model_dir, "--out", str(out),
            "--embeddings", str(emb)]
    assert main(args) == 0
    assert "saved the image embedding" in capsys.readouterr().out
    mask = np.array(Image.open(out / "mask_0.png"))
    assert mask.shape == (300, 400) and set(np.unique(mask)) <= {0, 255}
    assert Image.open(out / "overlay.png").size == (400, 300)
    info = json.loads((out / "segment.json").read_text())
    assert info["masks"][0]["area"] == int((mask > 0).sum())
    # a second prompt reuses the embedding; the mask is the reference's
    assert main([*args, "--point", "20,30:0", "--out", str(tmp_path / "out2")]) == 0
    assert "reused the image embedding" in capsys.readouterr().out
    from transformers import SamProcessor
    from transformers.models.sam.image_processing_pil_sam import SamImageProcessorPil

    proc = SamProcessor(image_processor=SamImageProcessorPil())
    inputs = proc(images=Image.open(tmp_path / "photo.jpg"), input_points=[[[200, 150], [20, 30]]],
                  input_labels=[[1, 0]], return_tensors="pt")
    with torch.no_grad():
        outputs = ref(pixel_values=inputs["pixel_values"], input_points=inputs["input_points"].float(),
                      input_labels=inputs["input_labels"], multimask_output=False)
    want = proc.image_processor.post_process_masks(outputs.pred_masks, inputs["original_sizes"],
                                                   inputs["reshaped_input_sizes"])[0][0, 0].numpy()
    got = np.array(Image.open(tmp_path / "out2" / "mask_0.png")) > 0
    assert (got & want).sum() / max(1, (got | want).sum()) >= 0.999
    # a stale embedding (another image) is refused, nothing written
    Image.fromarray((rng.random((300, 400, 3)) * 255).astype(np.uint8)).save(tmp_path / "photo.jpg")
    assert main([*args, "--out", str(tmp_path / "out3")]) == 2
    assert "another image" in capsys.readouterr().err and not (tmp_path / "out3").exists()
