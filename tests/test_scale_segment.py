"""Segment-everything over a dataset: COCO RLE masks per image, the same as ``generate_masks`` on each image."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image
from transformers.models.sam.image_processing_pil_sam import SamImageProcessorPil

from kestrel.cli.main import main
from kestrel.pipelines.coco import coco_annotations, decode
from kestrel.pipelines.images import load_image
from kestrel.pipelines.mask_generation import generate_masks
from kestrel.pipelines.segment import SamSegmenter
from reference import SMALL, seeded_sam

OPTIONS = dict(points_per_side=3, pred_iou_thresh=0.0, stability_score_thresh=0.0)


@pytest.fixture(scope="module")
def sam_photos(tmp_path_factory):
    root = tmp_path_factory.mktemp("scale_sam")
    seeded_sam(SMALL, seed=5).save_pretrained(root / "sam")
    SamImageProcessorPil().save_pretrained(root / "sam")
    rng = np.random.default_rng(0)
    for i, (h, w) in enumerate([(60, 80)]):  # one image: each costs a 1024 x 1024 encode, twice
        img = (rng.random((h, w, 3)) * 255).astype(np.uint8)
        img[h // 4: h // 2, w // 3: 2 * w // 3] = (200, 40, 40)
        (root / "photos").mkdir(exist_ok=True)
        Image.fromarray(img).save(root / "photos" / f"p{i}.png")
    (root / "photos" / "broken.png").write_bytes(b"not an image")
    return root / "sam", root / "photos"


def test_segment_everything_dataset_equals_generate_masks(sam_photos, tmp_path, capsys):
    import kestrel

    model, photos = sam_photos
    out = tmp_path / "masks"
    assert main(["segment", str(photos), "--everything", "--model", str(model), "--out", str(out),
                 "--points-per-side", "3", "--pred-iou-thresh", "0", "--stability-score-thresh", "0",
                 "--quiet"]) == 0
    rows = pq.read_table(sorted(out.glob("part-*.parquet"))).to_pylist()
    seg = SamSegmenter(kestrel.load(model))
    assert [r["path"] for r in rows] == [str(photos / "p0.png")]
    assert pq.read_table(out / "failures.parquet").column("path").to_pylist() == [str(photos / "broken.png")]
    for row in rows:
        want = coco_annotations(generate_masks(seg, load_image(row["path"]), **OPTIONS))["annotations"]
        assert len(row["masks"]) == len(want) > 0
        for got, ann in zip(row["masks"], want):
            assert got["segmentation"] == ann["segmentation"] and got["area"] == ann["area"]
            assert got["predicted_iou"] == pytest.approx(ann["predicted_iou"], abs=1e-6)
        assert (row["height"], row["width"]) == tuple(decode(row["masks"][0]["segmentation"]).shape)
