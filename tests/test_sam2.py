"""SAM 2.1 Hiera: a clean check, the card, and parity with transformers ``Sam2Model`` at 1024 and 512 px.

The default run uses the real block layout of every family size (tiny, small, base-plus, large:
depths, windows, global blocks, background tables) at small widths; the real tiny widths run under
``-m slow``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import Sam2Config, Sam2Model

import kestrel
from kestrel.blocks import EntryError
from kestrel.checker.check import check_program
from kestrel.models import sam2, sam2_video
from kestrel.models.cards import CARDS, CardError
from kestrel.models.cards.sam2 import FAMILY_BACKBONES, layout
from reference import at_size, rel_diff, seeded_sam2, small_config

TOL = 1e-4
HD = 32


def resized_reference(ref: Sam2Model, image: int) -> Sam2Model:
    """The same weights in a Sam2Model whose config says ``image_size = image``."""
    out = Sam2Model(Sam2Config(**at_size(ref.config.to_dict(), image))).eval()
    out.load_state_dict(ref.state_dict())
    return out


def reference_encode(ref: Sam2Model, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Upstream's image embedding and the two high-resolution features before conv_s0 / conv_s1."""
    with torch.no_grad():
        fpn = ref.vision_encoder(x).fpn_hidden_states  # (1/4, 1/8, 1/16)
        emb = fpn[2] + ref.no_memory_embedding.reshape(1, -1, 1, 1)  # as get_image_embeddings adds it
    return {"embedding": emb, "hr0": fpn[0], "hr1": fpn[1], "feat_s0": ref.mask_decoder.conv_s0(fpn[0]),
            "feat_s1": ref.mask_decoder.conv_s1(fpn[1])}


def reference_decode(ref: Sam2Model, emb: torch.Tensor, hr0: torch.Tensor, hr1: torch.Tensor, **prompts):
    """All four masks and IoUs (single-mask token first), object-score logits, and upstream's
    ``multimask_output=False`` answer (the dynamic choice by stability)."""
    feats = [ref.mask_decoder.conv_s0(hr0), ref.mask_decoder.conv_s1(hr1), emb]
    with torch.no_grad():
        dec = ref.mask_decoder
        sparse, dense = ref.prompt_encoder(input_points=prompts.get("input_points"),
                                           input_labels=prompts.get("input_labels"),
                                           input_boxes=prompts.get("input_boxes"), input_masks=None)
        pe = ref.get_image_wide_positional_embeddings().repeat(emb.shape[0], 1, 1, 1)
        saved = dec.dynamic_multimask_via_stability
        dec.dynamic_multimask_via_stability = False  # the single-mask token's own output
        one, one_iou, _, obj = dec(emb, pe, sparse, dense, False, feats[:2])
        dec.dynamic_multimask_via_stability = saved
        three, three_iou, _, _ = dec(emb, pe, sparse, dense, True, feats[:2])
        full = ref(image_embeddings=feats, multimask_output=False, **prompts)
    return (torch.cat([one, three], 2), torch.cat([one_iou, three_iou], 2), obj, full.pred_masks, full.iou_scores)


POINTS = torch.tensor([[[[500.0, 300.0], [100.0, 900.0]], [[10.0, 20.0], [1000.0, 3.0]],
                        [[7.0, 1010.0], [300.0, 301.0]]]])
LABELS = torch.tensor([[[1, 0], [1, -10], [0, -1]]], dtype=torch.int32)
BOXES = torch.tensor([[[100.0, 200.0, 500.0, 700.0], [0.0, 0.0, 1023.0, 1023.0], [3.0, 4.0, 50.0, 60.0]]])


def check_decoders(ref, ours, enc: dict[str, torch.Tensor], scale: float, figures: dict[str, float]) -> None:
    emb, hr0, hr1 = enc["embedding"], enc["hr0"], enc["hr1"]
    for kind, prompts, call in (
        ("points", dict(input_points=POINTS * scale, input_labels=LABELS),
         lambda: ours.decode_points(emb, hr0, hr1, POINTS * scale, LABELS)),
        ("boxes", dict(input_boxes=BOXES * scale), lambda: ours.decode_boxes(emb, hr0, hr1, BOXES * scale)),
    ):
        masks4, iou4, obj, single, single_iou = reference_decode(ref, emb, hr0, hr1, **prompts)
        with torch.no_grad():
            got_masks, got_iou, got_obj = call()
            got_single, got_single_iou = ours.select_single(got_masks, got_iou)
        figures[f"{kind} masks"] = rel_diff(got_masks, masks4)
        figures[f"{kind} iou"] = rel_diff(got_iou, iou4)
        figures[f"{kind} object score"] = rel_diff(got_obj, obj)
        figures[f"{kind} single mask"] = rel_diff(got_single, single)
        figures[f"{kind} single iou"] = rel_diff(got_single_iou, single_iou)
    assert max(figures.values()) <= TOL, figures


def check_encoder(ref, ours, image: int, figures: dict[str, float], sensitive: bool = True,
                  ) -> dict[str, torch.Tensor]:
    torch.manual_seed(3)
    x = torch.randn(1, 3, image, image)
    want = reference_encode(ref, x)
    with torch.no_grad():
        emb, hr0, hr1 = ours.encode_image(x)
    e = image // 16
    assert emb.shape == (1, ours.Hd, e, e) and hr0.shape == (1, ours.Hd, 4 * e, 4 * e)
    figures["image embedding"] = rel_diff(emb, want["embedding"])
    figures["hr0"], figures["hr1"] = rel_diff(hr0, want["hr0"]), rel_diff(hr1, want["hr1"])
    assert max(figures.values()) <= TOL, figures
    if not sensitive:
        return want
    with torch.no_grad():  # the weights are random enough that the embedding depends on the image
        assert rel_diff(ours.encode_image(torch.randn(1, 3, image, image))[0], want["embedding"]) > 0.1
    return want


# ---------------------------------------------------------------------------------------- declarations


def test_program_checks_clean():
    report = check_program(sam2.Model)
    assert report.ok, "\n".join(map(str, report.diagnostics))


def test_card_binds_tiny_at_both_sizes():
    card = CARDS["sam2.1-hiera-tiny"]
    g = card.generics()
    assert (g["E"], g["D0"], g["D3"], g["Win2"], g["Pad2"], g["Pad3"]) == (64, 96, 768, 14, 6, 3)
    assert not {"L0", "L1", "L3", "R0"} & set(g)  # layer counts are the layout's, not generics
    assert card.family.root(card.config) is sam2_video.VideoModel  # tiny's layout is the declared one
    assert card.family.root({**card.config, "model_type": "sam2"}) is sam2.Model  # the image model's, likewise
    g512 = card.family.rebind(card.config, {"E": 32})
    assert (g512["E"], g512["Pad2"], g512["Pad3"]) == (32, 10, 5)


@pytest.mark.parametrize("size", sorted(FAMILY_BACKBONES))
def test_card_lays_out_every_family_size(size):
    card = CARDS[f"sam2.1-hiera-{size}"]
    bb = card.config["vision_config"]["backbone_config"]
    assert {k: bb[k] for k in FAMILY_BACKBONES[size]} == FAMILY_BACKBONES[size]
    lay = layout(card.config)
    kinds = [lay["stage_0"]] + [("windowed", *lay[f"stage_{s}"]) for s in (1, 2, 3)]  # pool_s first
    assert [len(k) for k in kinds] == bb["blocks_per_stage"]
    flat = [k for stage in kinds for k in stage]
    assert [i for i, k in enumerate(flat) if k == "global"] == bb["global_attention_blocks"]
    root = card.family.root(card.config)
    assert root is sam2_video.model_for(lay) and root.decl().qualname == "sam2_video::VideoModel"
    assert card.family.root({**card.config, "model_type": "sam2"}) is sam2.model_for(lay)
    report = check_program(root)
    assert report.ok, "\n".join(map(str, report.diagnostics))


def sam2_generics(cfg):
    return CARDS["sam2.1-hiera-tiny"].family.generics(cfg)


@pytest.mark.parametrize("change, field", [
    ({"global_attention_blocks": [1, 7, 12]}, "global_attention_blocks"),
    ({"blocks_per_stage": [1, 2, 7]}, "four Hiera stages"),
    ({"global_attention_blocks": [3, 7, 9]}, "pooling block"),
    ({"query_stride": [3, 3]}, "query_stride"),
    ({"window_size_per_stage": [8, 5, 14, 7]}, "even windows"),
])
def test_card_refuses_what_the_program_fixes(change, field):
    cfg = copy.deepcopy(CARDS["sam2.1-hiera-tiny"].config)
    cfg["vision_config"]["backbone_config"].update(change)
    with pytest.raises(ValueError, match=field):
        sam2_generics(cfg)


# -------------------------------------------------------------------------------------------- parity


@pytest.fixture(scope="module")
def small(sam2_small):
    return sam2_small


@pytest.mark.parametrize("image", [1024, 512])
def test_small_tiny_layout_matches_reference(small, image):
    ref, path = small
    ours = kestrel.load(path) if image == 1024 else kestrel.load(path, E=image // 16)
    ref = ref if image == 1024 else resized_reference(ref, image)
    figures: dict[str, float] = {}
    enc = check_encoder(ref, ours, image, figures, sensitive=image == 512)  # one sensitivity check is enough
    check_decoders(ref, ours, enc, image / 1024, figures)
    print(image, figures)


@pytest.mark.parametrize("size", sorted(FAMILY_BACKBONES))
def test_family_layouts_match_reference(tmp_path, size):
    """Every family size's Hiera layout (depths, windows, global blocks, tables) at small widths,
    128 px (stage 2 is an 8 x 8 map, padded to one 14- or 16-window; stage 3 a padded 4 x 4 one).
    The mask decoder is the same for every size: the tiny-layout tests cover it."""
    over = dict(FAMILY_BACKBONES[size])
    widths = {"hidden_size": 16, "embed_dim_per_stage": [16, 32, 64, 128]}
    over.update(widths)
    ref = seeded_sam2(small_config(128, **over))
    ref.save_pretrained(tmp_path)
    ours = kestrel.load(tmp_path)
    figures: dict[str, float] = {}
    check_encoder(ref, ours, 128, figures, sensitive=False)


@pytest.mark.parametrize("blocks, globals_", [
    pytest.param([1, 2, 7, 2], [0, 2], id="global-in-stages-0-and-1"),
    pytest.param([2, 1, 3, 2], [], id="no-global-layer"),
    pytest.param([1, 2, 3, 3], [7, 8], id="global-in-stage-3"),
])
def test_layouts_beyond_the_released_match_reference(tmp_path, blocks, globals_):
    """Layouts transformers accepts that no release uses: the program follows the config's data."""
    ref = seeded_sam2(small_config(128, blocks_per_stage=blocks, global_attention_blocks=globals_))
    ref.save_pretrained(tmp_path)
    ours = kestrel.load(tmp_path)
    kinds = [ours.backbone.layout["stage_0"]] + [("windowed", *ours.backbone.layout[f"stage_{s}"]) for s in (1, 2, 3)]
    assert [i for i, k in enumerate(k for stage in kinds for k in stage) if k == "global"] == globals_
    report = check_program(type(ours))
    assert report.ok, "\n".join(map(str, report.diagnostics))
    check_encoder(ref, ours, 128, {}, sensitive=False)


def test_entries_check_their_inputs(small):
    _, path = small
    ours = kestrel.load(path, E=32)
    with pytest.raises(EntryError, match="pixel_values"):
        ours.encode_image(torch.randn(1, 3, 1024, 1024))
    e = torch.randn(1, HD, 32, 32)
    with pytest.raises(EntryError, match="input_labels"):
        ours.decode_points(e, torch.randn(1, HD, 128, 128), torch.randn(1, HD, 64, 64), POINTS, LABELS.long())


def test_load_refuses_an_odd_embedding_side(small):
    _, path = small
    with pytest.raises(CardError, match="even"):
        kestrel.load(path, E=33)


@pytest.mark.slow
@pytest.mark.parametrize("image", [1024, 512])
def test_sam2_hiera_tiny_real_config(tmp_path, image):
    config = {k: v for k, v in CARDS["sam2.1-hiera-tiny"].config.items() if k != "model_type"}
    ref = seeded_sam2(config)
    ref.save_pretrained(tmp_path)
    ours = kestrel.load(tmp_path) if image == 1024 else kestrel.load(tmp_path, E=image // 16)
    ref = ref if image == 1024 else resized_reference(ref, image)
    figures: dict[str, float] = {}
    enc = check_encoder(ref, ours, image, figures)
    check_decoders(ref, ours, enc, image / 1024, figures)
    print(image, figures)


@pytest.mark.slow
@pytest.mark.parametrize("size", sorted(FAMILY_BACKBONES))
def test_sam2_family_real_config(tmp_path, size):
    """Each released size at its real widths and layout, 1024 px: encoder and decoders against upstream."""
    card = CARDS[f"sam2.1-hiera-{size}"]
    ref = seeded_sam2({k: v for k, v in card.config.items() if k != "model_type"})
    ref.save_pretrained(tmp_path)
    ours = kestrel.load(tmp_path)
    assert type(ours) is card.family.root(card.config)
    figures: dict[str, float] = {}
    enc = check_encoder(ref, ours, 1024, figures)
    check_decoders(ref, ours, enc, 1.0, figures)
    print(size, figures)


# ------------------------------------------------------------------------------- prompt composition

PROMPTS = {  # every prompt that fits in the seed's three tokens or the padded five used here
    "one foreground point": dict(points=[(300.0, 200.0)], labels=[1]),
    "one background point": dict(points=[(40.0, 500.0)], labels=[0]),
    "two points": dict(points=[(300.0, 200.0), (10.0, 11.0)], labels=[1, 0]),
    "three points": dict(points=[(300.0, 200.0), (10.0, 11.0), (500.0, 1.0)], labels=[1, 0, 1]),
    "a box": dict(box=(100.0, 150.0, 400.0, 480.0)),
    "a box with a point": dict(points=[(250.0, 300.0)], labels=[1], box=(100.0, 150.0, 400.0, 480.0)),
}


def _upstream(ref: Sam2Model, feats: list[torch.Tensor], points=(), labels=(), box=None):
    kw = {}
    if points:
        kw["input_points"] = torch.tensor([[list(points)]], dtype=torch.float32)
        kw["input_labels"] = torch.tensor([[list(labels)]], dtype=torch.int32)
    if box is not None:
        kw["input_boxes"] = torch.tensor([[list(box)]], dtype=torch.float32)
    with torch.no_grad():
        out = ref(image_embeddings=feats, multimask_output=True, **kw)
    return out.pred_masks, out.iou_scores, out.object_score_logits


@pytest.fixture(scope="module")
def encoded_512(small):
    ref, path = small
    ref = resized_reference(ref, 512)
    ours = kestrel.load(path, E=32)
    torch.manual_seed(5)
    x = torch.randn(1, 3, 512, 512)
    with torch.no_grad():
        emb, hr0, hr1 = ours.encode_image(x)
        feats = [ref.mask_decoder.conv_s0(hr0), ref.mask_decoder.conv_s1(hr1), emb]
    return ref, ours, (emb, hr0, hr1), feats


@pytest.mark.parametrize("fold", ["always", "0"])  # the decoder's attentions folded into the tokens' side, or not
@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_padded_tokens_decode_as_the_unpadded_prompt(encoded_512, name, fold, monkeypatch):
    from kestrel.pipelines.sam2_processing import PromptError, PromptTables, compose

    monkeypatch.setenv("KESTREL_FOLD", fold)  # folded, the padding's -1e9 key bias goes into the scores the same way

    ref, ours, (emb, hr0, hr1), feats = encoded_512
    scaled = dict(PROMPTS[name])  # the prompts above are in 1024-px coordinates; the model runs at 512
    if "points" in scaled:
        scaled["points"] = [(x / 2, y / 2) for x, y in scaled["points"]]
    if "box" in scaled:
        scaled["box"] = tuple(v / 2 for v in scaled["box"])
    want = _upstream(ref, feats, **scaled)
    tables = PromptTables.from_model(ours)
    with torch.no_grad():
        pe, dense = ours.image_positions(), ours.dense_prompt()
        assert pe.is_contiguous() and ours.image_positions().data_ptr() != pe.data_ptr()  # the caller's own copy
        needed = len(scaled.get("points", ())) + (3 if "box" in scaled else 1)
        for count in (3, 5):
            if needed > count:
                with pytest.raises(PromptError, match="tokens"):
                    compose(tables, count=count, **scaled)
                continue
            got = ours.decode_tokens(emb, pe, compose(tables, count=count, **scaled), dense, hr0, hr1)
            figures = {what: rel_diff(g, w) for what, g, w in zip(("masks", "iou", "object score"), got, want)}
            assert max(figures.values()) <= TOL, (count, figures)
            if count > needed:  # the padding is masked, not merely harmless: unmasked it would differ
                tokens = compose(tables, count=count, **scaled)
                tokens[:, :, needed:] += 1e-3  # no longer not-a-point: no bias, and other values
                moved = ours.decode_tokens(emb, pe, tokens, dense, hr0, hr1)
                assert rel_diff(moved[0], want[0]) > TOL


# ------------------------------------------------------------------------------------- segmentation


@pytest.mark.parametrize("prompt", [dict(points=[(100.0, 50.0)], labels=[1]),
                                    dict(points=[(210.0, 120.0)], labels=[1], box=(40.0, 30.0, 380.0, 260.0))])
def test_segment_matches_reference_on_a_photo(encoded_512, prompt):
    """The pipeline at 512 px (the seed's recipe) against Sam2Model on the same pixels and prompt,
    with Sam2Processor's coordinate scaling and mask post-processing."""
    import numpy as np
    import torch.nn.functional as F
    from PIL import Image

    from kestrel.pipelines.sam2_processing import preprocess_for
    from kestrel.pipelines.sam2_segment import segment

    ref, ours, _, _ = encoded_512
    rng = np.random.default_rng(0)
    photo = Image.fromarray((rng.random((300, 400, 3)) * 255).astype("uint8"))
    got = segment(ours, photo, multimask=True, **prompt)
    sx, sy = 512 / 400, 512 / 300
    kw = dict(input_points=torch.tensor([[[[x * sx, y * sy] for x, y in prompt["points"]]]]),
              input_labels=torch.tensor([[prompt["labels"]]], dtype=torch.int32))
    if "box" in prompt:
        x1, y1, x2, y2 = prompt["box"]
        kw["input_boxes"] = torch.tensor([[[x1 * sx, y1 * sy, x2 * sx, y2 * sy]]])
    with torch.no_grad():
        out = ref(pixel_values=preprocess_for(512)(photo), multimask_output=True, **kw)
    order = torch.argsort(out.iou_scores[0, 0], descending=True)
    assert rel_diff(got.iou, out.iou_scores[0, 0][order]) <= TOL
    assert rel_diff(got.logits, out.pred_masks[0, 0][order]) <= TOL
    want = F.interpolate(out.pred_masks[0], size=(300, 400), mode="bilinear", align_corners=False)[0][order] > 0
    inter, union = (got.masks & want).sum(), (got.masks | want).sum()
    assert got.masks.shape == (3, 300, 400) and float(inter) / max(float(union), 1.0) >= 0.99


def test_cli_segment_at_512(small, tmp_path, capsys):
    """``kestrel segment --model DIR --size 512``: a mask PNG at the photo's size, overlay, JSON; bad
    sizes and mask prompts are refused by name."""
    import json

    import numpy as np
    from PIL import Image

    from kestrel.cli.main import main

    _, path = small
    photo = tmp_path / "photo.png"
    Image.fromarray((np.random.default_rng(1).random((120, 160, 3)) * 255).astype("uint8")).save(photo)
    out = tmp_path / "out"
    assert main(["segment", str(photo), "--model", str(path), "--point", "60,40", "--size", "512",
                 "--out", str(out)]) == 0
    mask = np.array(Image.open(out / "mask_0.png"))
    assert mask.shape == (120, 160) and set(np.unique(mask)) <= {0, 255}
    info = json.loads((out / "segment.json").read_text())
    assert info["size"] == [120, 160] and len(info["masks"]) == 1 and (out / "overlay.png").is_file()
    assert main(["segment", str(photo), "--model", str(path), "--point", "60,40", "--size", "500"]) == 2
    assert "--size 500" in capsys.readouterr().err


def test_single_mask_choice_matches_upstream_on_both_branches(encoded_512):
    """A stable single-mask output is kept; an unstable one gives way to the best multimask output."""
    ref, ours, _, _ = encoded_512
    torch.manual_seed(7)
    masks = torch.randn(1, 3, 4, 128, 128)
    masks[0, 0, 0] = torch.where(masks[0, 0, 0] > 0, 5.0, -5.0)  # stable: no logit near 0
    masks[0, 2, 0] = 3.0  # stable and all foreground
    iou = torch.rand(1, 3, 4)
    iou[0, 1, 1:] = torch.tensor([0.2, 0.9, 0.9])  # a tie among the multimasks: the first best wins
    want = ref.mask_decoder._dynamic_multimask_via_stability(masks, iou)
    with torch.no_grad():
        got = ours.select_single(masks, iou)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(got[0][0, 0, 0], masks[0, 0, 0]) and torch.equal(got[0][0, 1, 0], masks[0, 1, 2])


def test_a_video_model_config_binds_the_image_path():
    """The hub's SAM 2.1 checkpoints are Sam2VideoModel's (model_type sam2_video): the same image path,
    and the memory (``test_sam2_video.py``) bound too."""
    from transformers import Sam2VideoConfig

    from kestrel.models.cards import family_for_config
    from kestrel.models.cards.sam2 import bindings

    cfg = Sam2VideoConfig().to_dict()
    family = family_for_config(cfg, "config.json")
    assert family.name == "sam2"
    image = {k: v for k, v in CARDS["sam2.1-hiera-tiny"].generics().items() if k != "T"}
    assert {k: v for k, v in family.generics(cfg).items() if k in image} == image
    rows = bindings(cfg)
    path = "memory_attention.layers.0.self_attn.q_proj.weight"
    assert rows(path) == path
    assert bindings({**cfg, "model_type": "sam2"})(path) is None  # an image config binds the image path only
    assert rows("vision_encoder.backbone.blocks.11.attn.qkv.weight") == "backbone.stage_3_0.0.attn.qkv.weight"


def test_the_features_projections_are_kept_while_the_same_features_come_back(encoded_512):
    _, ours, (emb, hr0, hr1), _ = encoded_512
    runs = []
    hook = ours.mask_decoder.conv_s0.register_forward_hook(lambda *a: runs.append(1))
    point = torch.tensor([[[[150.0, 300.0]]]])
    label = torch.tensor([[[1]]], dtype=torch.int32)
    try:
        with torch.no_grad():
            h0 = hr0.clone()  # features of their own: no other test's calls have kept anything for them
            first = ours.decode_points(emb, h0, hr1, point, label)[0]
            again = ours.decode_points(emb, h0, hr1, point * 1.5, label)[0]  # another prompt, the same image
            assert len(runs) == 1  # projected once for both prompts
            assert torch.equal(ours.decode_points(emb, h0.clone(), hr1, point * 1.5, label)[0], again)
            assert len(runs) == 2  # new features (equal values, another tensor) are projected afresh
            h0.mul_(0.5)  # written to: the kept projection is stale
            halved = ours.decode_points(emb, h0, hr1, point, label)[0]
            assert len(runs) == 3 and not torch.equal(halved, first)
        with torch.inference_mode():
            x = hr0.clone()  # an inference tensor can be written unseen: never kept
            ours.decode_points(emb, x, hr1, point, label)
            ours.decode_points(emb, x, hr1, point, label)
        assert len(runs) == 5
    finally:
        hook.remove()
