"""DAVIS J (region IoU), F (boundary F-measure) and J&F on hand-made masks whose answers are worked out by hand."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from kestrel.pipelines.video_eval import (
    boundary,
    boundary_f,
    dilate,
    disk_offsets,
    evaluate_folder,
    region_similarity,
    score_label_maps,
    tolerance_pixels,
)
from kestrel.pipelines.video_io import VideoError


def square(shape=(100, 100), top=20, left=20, side=40) -> np.ndarray:
    m = np.zeros(shape, dtype=bool)
    m[top: top + side, left: left + side] = True
    return m


def test_region_similarity_known_values():
    a = np.zeros((20, 20), bool)
    b = np.zeros((20, 20), bool)
    a[0:10, 0:10] = True  # 100 px
    b[0:10, 5:15] = True  # 100 px, 50 shared
    assert region_similarity(a, b) == pytest.approx(50 / 150)
    assert region_similarity(a, a) == 1.0
    assert region_similarity(np.zeros_like(a), np.zeros_like(a)) == 1.0  # both empty: a perfect answer
    assert region_similarity(np.zeros_like(a), b) == 0.0
    void = np.zeros_like(a)
    void[:, 10:] = True  # ignore the right half: b's part there no longer counts
    assert region_similarity(a, b, void) == pytest.approx(50 / 100)


def test_boundary_of_a_square_counted_by_hand():
    # A 40 px square (rows/cols 20..59). Inside: row 59 (40 px) and column 59 above it (39). Outside: row 19,
    # columns 19..59 (41: below or below-right is inside), and column 19, rows 20..59 (40: right is inside).
    b = boundary(square())
    assert b.sum() == 40 + 39 + 41 + 40
    assert b[59, 20:60].all() and b[20:59, 59].all() and b[19, 19:60].all() and b[20:60, 19].all()
    assert not b[21:58, 21:58].any()
    # a single pixel: itself, left, above, above-left
    one = np.zeros((10, 10), bool)
    one[5, 5] = True
    assert sorted(zip(*np.nonzero(boundary(one)))) == [(4, 4), (4, 5), (5, 4), (5, 5)]


def test_tolerance_is_the_benchmarks():
    assert tolerance_pixels((100, 100)) == 2  # ceil(0.008 * 141.4)
    assert tolerance_pixels((480, 854)) == 8  # DAVIS 480p: ceil(0.008 * 979.6)
    assert len(disk_offsets(1)) == 5 and len(disk_offsets(2)) == 13


def test_dilation_matches_scipy_with_a_disk():
    ndimage = pytest.importorskip("scipy.ndimage")
    rng = np.random.default_rng(0)
    m = rng.random((37, 53)) > 0.97
    for r in (1, 2, 3, 8):
        y, x = np.ogrid[-r: r + 1, -r: r + 1]
        disk = x * x + y * y <= r * r
        assert np.array_equal(dilate(m, r), ndimage.binary_dilation(m, structure=disk))


def test_boundary_f_known_values():
    true = square()
    assert boundary_f(true, true) == 1.0
    # shifted by the tolerance (2 px at 100 x 100): every boundary pixel still has a match
    assert boundary_f(np.roll(true, 2, axis=1), true) == 1.0
    # plus a stray pixel far away: 4 more predicted boundary pixels, none matched
    pred = true.copy()
    pred[90, 90] = True
    precision, recall = 160 / 164, 1.0
    assert boundary_f(pred, true) == pytest.approx(2 * precision * recall / (precision + recall))
    # far apart: nothing matches
    assert boundary_f(square(top=0, left=0, side=10), square(top=60, left=60, side=30)) == 0.0
    # empty cases, as the benchmark defines them
    empty = np.zeros_like(true)
    assert boundary_f(empty, empty) == 1.0
    assert boundary_f(empty, true) == 0.0  # precision 1, recall 0
    assert boundary_f(true, empty) == 0.0  # precision 0, recall 1


def test_clip_scores_per_object_and_overall(tmp_path):
    # two frames, ground truth objects 1 and 2; the prediction gets 1 exactly, misses 2 on frame 0 and
    # gets it half on frame 1
    gt0 = np.zeros((100, 100), np.uint8)
    gt0[square()] = 1
    gt0[80:90, 0:20] = 2
    gt1 = gt0.copy()
    p0 = np.where(gt0 == 1, 1, 0).astype(np.uint8)  # object 2 missing
    p1 = gt1.copy()
    p1[80:90, 10:20] = 0  # object 2: 100 of 200 px
    score = score_label_maps({0: p0, 1: p1}, {0: gt0, 1: gt1})
    o1, o2 = score.objects
    assert (o1.object_id, o1.j, o1.f) == (1, 1.0, 1.0)
    f_half = boundary_f(p1 == 2, gt1 == 2)
    assert 0 < f_half < 1
    assert o2.j == pytest.approx((0 + 0.5) / 2) and o2.f == pytest.approx((0 + f_half) / 2)
    assert score.j == pytest.approx((1 + 0.25) / 2)
    assert score.jf == pytest.approx((score.j + score.f) / 2)
    assert score.untracked == () and score.frames == (0, 1)

    # the same through PNG folders (DAVIS palette PNGs for the ground truth)
    pred_dir, gt_dir = tmp_path / "pred", tmp_path / "gt"
    pred_dir.mkdir()
    gt_dir.mkdir()
    for i, (p, g) in enumerate([(p0, gt0), (p1, gt1)]):
        Image.fromarray(p, mode="L").save(pred_dir / f"{i:05d}.png")
        im = Image.fromarray(g, mode="P")
        im.putpalette([0, 0, 0, 128, 0, 0, 0, 128, 0] + [0] * 759)
        im.save(gt_dir / f"{i:05d}.png")
    again = evaluate_folder(pred_dir, gt_dir)
    assert again.as_dict() == score.as_dict()
    only_one = evaluate_folder(pred_dir, gt_dir, frames=[1])
    assert only_one.frames == (1,) and only_one.objects[1].j == pytest.approx(0.5)


def test_an_object_never_tracked_scores_zero_and_void_is_ignored():
    gt = np.zeros((50, 50), np.uint8)
    gt[10:20, 10:20] = 3
    gt[30:40, 30:40] = 255  # void
    pred = np.zeros_like(gt)
    pred[30:40, 30:40] = 5  # inside the void only: not an error of object 3
    score = score_label_maps({0: pred}, {0: gt})
    assert [o.object_id for o in score.objects] == [3]
    assert score.objects[0].j == 0.0 and score.objects[0].f == 0.0
    assert score.untracked == (3,) and score.extra == (5,)


def test_bad_ground_truth_is_one_clear_error(tmp_path):
    with pytest.raises(VideoError, match="no such folder"):
        evaluate_folder(tmp_path, tmp_path / "missing")
    with pytest.raises(VideoError, match=r"no \.png"):
        evaluate_folder(tmp_path, tmp_path)
    Image.new("RGB", (4, 4)).save(tmp_path / "00000.png")
    with pytest.raises(VideoError, match="palette or grey"):
        evaluate_folder(tmp_path, tmp_path)
