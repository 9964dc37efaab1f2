"""Segment everything against transformers' mask-generation pipeline; COCO RLE against pycocotools.

torchvision (which the pipeline's final NMS imports) does not work on these machines, so the test
gives the pipeline a plain greedy NMS written below, independently of Kestrel's.
"""

from __future__ import annotations

import json
import sys
import types

import numpy as np
import pytest
import torch
from PIL import Image

import kestrel
from kestrel.pipelines import coco as rle
from kestrel.pipelines.mask_generation import box_nms, crop_boxes, generate_masks, mask_boxes, point_grid
from kestrel.pipelines.segment import SamSegmenter
from reference import SMALL, seeded_sam

pycocotools_mask = pytest.importorskip("pycocotools.mask")


def _greedy_nms(boxes, scores, idxs, iou_threshold):
    """Reference NMS for the pipeline: highest score first, drop boxes overlapping a kept one."""
    order = sorted(range(len(scores)), key=lambda i: -float(scores[i]))
    keep = []
    for i in order:
        bi = [float(v) for v in boxes[i]]
        ok = True
        for j in keep:
            bj = [float(v) for v in boxes[j]]
            iw = max(0.0, min(bi[2], bj[2]) - max(bi[0], bj[0]))
            ih = max(0.0, min(bi[3], bj[3]) - max(bi[1], bj[1]))
            inter = iw * ih
            union = (bi[2] - bi[0]) * (bi[3] - bi[1]) + (bj[2] - bj[0]) * (bj[3] - bj[1]) - inter
            if union > 0 and inter / union > iou_threshold:
                ok = False
                break
        if ok:
            keep.append(i)
    return torch.tensor(keep, dtype=torch.long)


@pytest.fixture(scope="module")
def sharp(tmp_path_factory):
    """A small random SAM whose mask logits are large enough for masks to pass the stability filter."""
    ref = seeded_sam(SMALL, seed=0)
    with torch.no_grad():
        for mlp in ref.mask_decoder.output_hypernetworks_mlps:
            mlp.proj_out.weight.mul_(30)
    path = tmp_path_factory.mktemp("sam-sharp")
    ref.save_pretrained(path)
    return ref, path


def _photo() -> Image.Image:
    rng = np.random.default_rng(0)
    img = (rng.random((150, 200, 3)) * 255).astype(np.uint8)
    img[40:90, 60:140] = (200, 30, 30)
    return Image.fromarray(img)


def test_everything_matches_the_pipeline(sharp, monkeypatch):
    from transformers import pipeline
    from transformers.models.sam import image_processing_pil_sam as ips

    ref, path = sharp
    boxes_mod = types.ModuleType("torchvision.ops.boxes")
    boxes_mod.batched_nms = _greedy_nms
    for name, mod in (("torchvision", types.ModuleType("torchvision")), ("torchvision.ops", types.ModuleType("ops")),
                      ("torchvision.ops.boxes", boxes_mod)):
        monkeypatch.setitem(sys.modules, name, mod)
    processor = ips.SamImageProcessorPil()
    monkeypatch.setattr(processor, "post_process_for_mask_generation",
                        lambda *a: ips._post_process_for_mask_generation(*a))
    gen = pipeline("mask-generation", model=ref, image_processor=processor, device="cpu")
    photo = _photo()
    # NMS at 1.01 keeps every box: the random model's masks all span the image, so at 0.7 one would remain
    settings = dict(points_per_batch=16, pred_iou_thresh=0.9, stability_score_thresh=0.5, crops_nms_thresh=1.01)
    want = gen(photo, points_per_crop=8, output_rle_mask=True, output_bboxes_mask=True, **settings)
    ours = generate_masks(SamSegmenter(kestrel.load(path)), photo, points_per_side=8, **settings)
    assert len(want["masks"]) > 5, "the filters should keep a few masks"
    assert len(ours.scores) == len(want["masks"])
    assert np.allclose(ours.scores, want["scores"].numpy(), atol=1e-4)
    for k, (mine, theirs) in enumerate(zip(ours.masks, want["masks"])):
        inter, union = (mine & theirs).sum(), (mine | theirs).sum()
        assert union == 0 or inter / union >= 0.99, k
    assert np.array_equal(np.array(ours.boxes), want["bounding_boxes"].numpy())


def test_box_nms_suppresses_overlaps_best_first():
    boxes = torch.tensor([[0, 0, 10, 10], [1, 1, 10, 10], [20, 20, 30, 30], [0, 0, 10, 9]], dtype=torch.float)
    scores = torch.tensor([0.5, 0.9, 0.7, 0.6])
    assert box_nms(boxes, scores, 0.7) == [1, 2]
    assert box_nms(boxes, scores, 0.95) == [1, 2, 3, 0]
    assert _greedy_nms(boxes, scores, None, 0.7).tolist() == [1, 2]


def test_grid_crops_and_boxes():
    g = point_grid(2)
    assert g.tolist() == [[0.25, 0.25], [0.75, 0.25], [0.25, 0.75], [0.75, 0.75]]
    crops, layers = crop_boxes((150, 200), 1, 512 / 1500)
    assert crops[0] == [0, 0, 200, 150] and layers == [0, 1, 1, 1, 1]
    assert all(c[2] <= 200 and c[3] <= 150 for c in crops)
    m = torch.zeros(2, 5, 6, dtype=torch.bool)
    m[0, 1:3, 2:5] = True
    assert mask_boxes(m).tolist() == [[2, 1, 4, 2], [0, 0, 0, 0]]


@pytest.mark.parametrize("shape", [(1, 1), (7, 5), (64, 48)])
def test_rle_matches_pycocotools(shape):
    rng = np.random.default_rng(shape[0])
    for mask in (rng.random(shape) > 0.5, np.zeros(shape, bool), np.ones(shape, bool)):
        ours = rle.encode(mask)
        theirs = pycocotools_mask.encode(np.asfortranarray(mask.astype(np.uint8)))
        assert ours["counts"] == theirs["counts"].decode() and ours["size"] == list(theirs["size"])
        assert np.array_equal(pycocotools_mask.decode(ours), mask)
        assert np.array_equal(rle.decode(ours), mask)


def test_cli_everything_writes_rle_that_pycocotools_reads(sharp, tmp_path, capsys):
    from kestrel.cli.main import main

    _, path = sharp
    _photo().save(tmp_path / "photo.png")
    out = tmp_path / "out"
    rc = main(["segment", str(tmp_path / "photo.png"), "--everything", "--model", str(path), "--out", str(out),
               "--points-per-side", "4", "--pred-iou-thresh", "0.5", "--stability-score-thresh", "0.3",
               "--quiet"])
    assert rc == 0
    data = json.loads((out / "masks.json").read_text())
    assert data["height"] == 150 and data["width"] == 200 and data["annotations"]
    for k, ann in enumerate(data["annotations"]):
        mask = pycocotools_mask.decode(ann["segmentation"])
        png = np.array(Image.open(out / f"mask_{k}.png")) > 0
        assert mask.shape == (150, 200) and np.array_equal(mask.astype(bool), png)
        assert int(mask.sum()) == ann["area"]
    assert (out / "overlay.png").is_file()
    assert "masks:" in capsys.readouterr().out
