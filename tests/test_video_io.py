"""Frame sources (a folder, an .mp4 read in order, backwards and by jumps) and the mask writers."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from kestrel.pipelines.video_io import (
    AVFrames,
    FolderFrames,
    TrackWriter,
    VideoError,
    decode_rle,
    label_map,
    open_video,
    read_masks_json,
    write_overlay,
)


def shade(i: int) -> int:
    return 10 + 8 * i


def write_mp4(path, n: int = 30, size=(64, 48), gop: int = 6) -> None:
    """A clip whose frame i is a flat grey of value shade(i), key frames every ``gop`` frames."""
    import av

    w, h = size
    with av.open(str(path), mode="w") as c:
        s = c.add_stream("libx264", rate=12)
        s.width, s.height, s.pix_fmt = w, h, "yuv420p"
        s.options = {"g": str(gop), "bf": "2", "crf": "0"}
        for i in range(n):
            frame = np.full((h, w, 3), shade(i), np.uint8)
            for packet in s.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                c.mux(packet)
        for packet in s.encode():
            c.mux(packet)


def frame_value(image: Image.Image) -> int:
    return round(np.asarray(image).mean())


def test_mp4_random_access_in_any_order(tmp_path):
    path = tmp_path / "clip.mp4"
    write_mp4(path)
    frames = open_video(path)
    assert isinstance(frames, AVFrames) and len(frames) == 30 and frames.fps == pytest.approx(12)
    assert frames[0].size == (64, 48) and frames[0].mode == "RGB"
    for order in (range(30), range(29, -1, -1), [17, 3, 29, 4, 0, 28, 12, 12, 13]):
        for i in order:
            assert abs(frame_value(frames[i]) - shade(i)) <= 2, i
    assert len(frames._cache) <= AVFrames.CACHE  # bounded, whatever the order
    with pytest.raises(VideoError, match="frame 30 is out of range: the clip has 30 frames"):
        frames[30]


def test_folder_sorted_by_name_and_errors(tmp_path):
    for i, name in enumerate(["b.png", "a.jpg", "c.jpeg"]):
        Image.new("RGB", (8, 6), (shade(i),) * 3).save(tmp_path / name)
    (tmp_path / "notes.txt").write_text("not a frame")
    frames = open_video(tmp_path)
    assert isinstance(frames, FolderFrames) and len(frames) == 3
    assert [p.name for p in frames.files] == ["a.jpg", "b.png", "c.jpeg"]
    assert abs(frame_value(frames[0]) - shade(1)) <= 2
    Image.new("RGB", (9, 6)).save(tmp_path / "d.png")
    frames = FolderFrames(tmp_path)
    frames[0]
    with pytest.raises(VideoError, match="every frame must have one size"):
        frames[3]
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(VideoError, match="empty video"):
        open_video(empty)
    (tmp_path / "e.png").write_bytes(b"not a png")
    with pytest.raises(VideoError, match=r"e\.png: cannot read frame 4"):
        FolderFrames(tmp_path)[4]


def test_unreadable_and_missing_videos(tmp_path):
    bad = tmp_path / "bad.mp4"
    bad.write_bytes(b"\x00" * 100)
    with pytest.raises(VideoError, match="cannot read the video"):
        open_video(bad)
    with pytest.raises(VideoError, match="no such file"):
        open_video(tmp_path / "missing.mp4")


def test_label_map_lower_id_wins_and_json_keeps_whole_masks(tmp_path):
    a = np.zeros((6, 8), bool)
    b = np.zeros((6, 8), bool)
    a[1:4, 1:4] = True
    b[2:6, 2:8] = True
    lm = label_map({2: a, 1: b}, (6, 8))
    assert lm[1, 1] == 2 and lm[2, 2] == 1 and lm[5, 7] == 1 and lm[0, 0] == 0  # overlap: 1 wins
    writer = TrackWriter(tmp_path, video="v", size=(6, 8), objects=[1, 2])
    writer.write(3, {1: b, 2: a})
    writer.write(2, {1: b, 2: np.zeros_like(a)})
    writer.close()
    data = json.loads((tmp_path / "masks.json").read_text())
    assert data["objects"] == [1, 2] and (data["height"], data["width"]) == (6, 8)
    assert data["frames"]["3"]["2"]["size"] == [6, 8] and isinstance(data["frames"]["3"]["2"]["counts"], str)
    back = read_masks_json(tmp_path / "masks.json")
    assert np.array_equal(back[3][2], a) and np.array_equal(back[3][1], b) and not back[2][2].any()
    assert np.array_equal(decode_rle(data["frames"]["2"]["1"]), b)
    png = np.array(Image.open(tmp_path / "masks" / "00003.png"))
    assert png.dtype == np.uint8 and np.array_equal(png, lm)


def test_overlay_video_has_every_frame_in_order(tmp_path):
    import av

    frames = [Image.new("RGB", (33, 21), (shade(i),) * 3) for i in range(5)]  # odd sizes are padded
    (tmp_path / "masks").mkdir()
    for i in range(5):
        m = np.zeros((21, 33), np.uint8)
        m[: 2 * i + 1, :5] = 1
        Image.fromarray(m, mode="L").save(tmp_path / "masks" / f"{i:05d}.png")
    write_overlay(tmp_path / "overlay.mp4", frames, tmp_path / "masks", range(5), fps=10)
    with av.open(str(tmp_path / "overlay.mp4")) as c:
        decoded = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
    assert len(decoded) == 5 and decoded[0].shape == (22, 34, 3)
    assert abs(decoded[4][15:, 20:].mean() - shade(4)) < 3  # away from the mask: the frame
