"""COCO RLE: a hand-worked example and round trips."""

from __future__ import annotations

import numpy as np

from kestrel.pipelines.rle import decode, encode, runs


def test_hand_worked_example():
    mask = np.array([[0, 1], [1, 0]], dtype=bool)  # column-major: 0 1 1 0
    assert runs(mask) == [1, 2, 1]
    assert encode(mask) == {"size": [2, 2], "counts": "121"}
    assert runs(np.ones((2, 3), bool)) == [0, 6]


def test_round_trips_with_long_and_negative_deltas():
    rng = np.random.default_rng(0)
    for shape in [(1, 1), (7, 5), (64, 48), (300, 200)]:
        for p in (0.0, 0.02, 0.5, 1.0):
            mask = rng.random(shape) < p
            rle = encode(mask)
            assert np.array_equal(decode(rle), mask)
            assert np.array_equal(decode({"size": rle["size"], "counts": runs(mask)}), mask)
    big = np.zeros((500, 500), bool)
    big[10:490, 3:400] = True  # runs far above 31 and deltas of both signs
    assert np.array_equal(decode(encode(big)), big) and all(33 <= ord(c) < 112 for c in encode(big)["counts"])
