"""``kestrel track``: prompts, outputs, --reverse, --start/--end, --eval and every error path.

These tests drive the command's plumbing with a TEST DOUBLE of the tracking engine (``track_double``: boxes
carried from frame to frame, no model); the model directory is still a real ``Sam2VideoModel`` save,
loaded and vetted by the command. ``test_track_engine.py`` runs the real engine end to end.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

import kestrel
import track_double
from kestrel.cli.main import main
from kestrel.pipelines import video_track
from kestrel.pipelines.video_io import read_masks_json
from test_video_io import write_mp4

W, H, N = 96, 64, 8


def video_config(image: int = 128) -> dict:
    """A Sam2VideoConfig dict at small widths (Hiera-tiny's layout), memory blocks included."""
    from test_sam2 import small_config

    s = image // 16
    return dict(small_config(image, hd=64), image_size=image, memory_attention_hidden_size=64,
                memory_attention_num_layers=2, memory_attention_feed_forward_hidden_size=64,
                memory_attention_rope_feat_sizes=[s, s], memory_encoder_hidden_size=64,
                mask_downsampler_embed_dim=64, memory_fuser_embed_dim=64, memory_fuser_intermediate_dim=64)


@pytest.fixture(scope="module")
def video_model(tmp_path_factory):
    from transformers import Sam2VideoConfig, Sam2VideoModel

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("sam2video")
    Sam2VideoModel(Sam2VideoConfig(**video_config())).eval().save_pretrained(path)
    return path


@pytest.fixture
def double(monkeypatch):
    monkeypatch.setattr(video_track, "_engine", lambda: track_double)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("frames")
    for i in range(N):
        a = np.full((H, W, 3), 40, np.uint8)
        a[20:40, 10 + 5 * i: 30 + 5 * i] = 220
        Image.fromarray(a).save(root / f"frame_{i:03d}.jpg")
    return root


def run(*argv: str) -> int:
    """The exit status of ``kestrel track ARGV``, whether the command returned it or argparse exited."""
    try:
        return main(["track", *map(str, argv), "--quiet"])
    except SystemExit as e:
        return int(e.code or 0)


def leftovers(parent) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".partial-" in p.name or ".old-" in p.name)


def pngs(out) -> dict[int, np.ndarray]:
    return {int(p.stem): np.array(Image.open(p)) for p in sorted((out / "masks").glob("*.png"))}


def test_folder_two_objects_overlap_rule(double, video_model, folder, tmp_path, capsys):
    out = tmp_path / "out"
    rc = run(folder, "--model", video_model, "--point", "0:30,30", "--object", "2", "--box", "0:20,10,60,50",
             "--out", out)
    assert rc == 0, capsys.readouterr().err
    masks = pngs(out)
    assert sorted(masks) == list(range(N))
    m = masks[3]
    assert m.shape == (H, W) and m.dtype == np.uint8
    assert m[30, 30] == 1  # inside both objects: the lower id wins
    assert m[45, 55] == 2 and m[5, 5] == 0
    data = read_masks_json(out / "masks.json")
    assert sorted(data) == list(range(N)) and sorted(data[3]) == [1, 2]
    assert data[3][2][30, 30] and data[3][2].sum() == 40 * 40  # masks.json keeps object 2's whole mask
    assert data[3][1].sum() == 12 * 12
    assert (out / "overlay.mp4").stat().st_size > 0 and leftovers(tmp_path) == []
    assert "8 frames" in capsys.readouterr().out


def test_mp4_reverse_and_a_correction(double, video_model, tmp_path, capsys):
    import av

    clip = tmp_path / "clip.mp4"
    write_mp4(clip, n=12, size=(64, 48))
    out = tmp_path / "out"
    assert run(clip, "--model", video_model, "--point", "11:20,20", "--point", "5:40,30", "--reverse",
               "--out", out) == 0
    masks = pngs(out)
    assert sorted(masks) == list(range(12))
    assert masks[11][20, 20] == 1 and masks[6][20, 20] == 1  # from frame 11 down to 6
    assert masks[5][30, 40] == 1 and masks[5][20, 20] == 0 and masks[0][30, 40] == 1  # corrected at 5
    with av.open(str(out / "overlay.mp4")) as c:
        assert sum(1 for _ in c.decode(video=0)) == 12


def test_start_end_limit_the_frames(double, video_model, folder, tmp_path):
    out = tmp_path / "out"
    assert run(folder, "--model", video_model, "--point", "3:30,30", "--start", "2", "--end", "6",
               "--out", out) == 0
    masks = pngs(out)
    assert sorted(masks) == [2, 3, 4, 5]
    assert not masks[2].any() and masks[3][30, 30] == 1  # before the first prompt: background
    assert sorted(json.loads((out / "masks.json").read_text())["frames"], key=int) == ["2", "3", "4", "5"]


def test_eval_scores_against_ground_truth(double, video_model, folder, tmp_path, capsys):
    gt = tmp_path / "gt"
    gt.mkdir()
    for i in range(N):
        m = np.zeros((H, W), np.uint8)
        m[24:36, 24:36] = 1  # exactly the double's square around 30,30
        if i >= 4:
            m[24:36, 24:30] = 0  # half of it on the last four frames
        Image.fromarray(m, mode="L").save(gt / f"{i:05d}.png")
    out = tmp_path / "out"
    assert run(folder, "--model", video_model, "--point", "0:30,30", "--out", out, "--eval", gt) == 0
    report = json.loads((out / "eval.json").read_text())
    assert report["objects"]["1"]["J"] == pytest.approx((4 * 1.0 + 4 * 0.5) / 8)
    assert report["J&F"] == pytest.approx((report["J"] + report["F"]) / 2) and report["F"] < 1
    printed = capsys.readouterr().out
    assert "J&F" in printed and f"{report['J&F']:6.3f}" in printed


def error(capsys) -> str:
    """The one error line; a flag argparse refuses is followed by the command's usage, nothing else."""
    err = capsys.readouterr().err.strip().splitlines()
    assert err and (len(err) == 1 or err[1].startswith("usage: kestrel track")), err
    assert err[-1:] == err or err[-1] == "run 'kestrel track --help' for more", err
    assert sum(" error: " in line for line in err) == 1, err
    return err[0]


@pytest.mark.parametrize("flags, message", [
    (["--point", "0:30"], "expected 2 comma-separated finite numbers"),
    (["--point", "x:30,30"], "starting with a frame index"),
    (["--point", "0:30,30:2"], "is 1 (foreground) or 0 (background)"),
    (["--point", "8:30,30"], "on frame 8, outside the tracked frames 0 to 7"),
    (["--point", "0:300,30"], "point 300,30 lies outside the 96 x 64 frame"),
    (["--box", "0:50,10,20,40"], "needs x0 < x1 and y0 < y1"),
    (["--box", "0:1,1,5,5", "--box", "0:2,2,6,6"], "already has a box on frame 0"),
    (["--object", "0", "--point", "0:30,30"], "expected an object id from 1 to 255, got 0"),
    (["--point", "0:30,30", "--start", "8"], "--start 8 is out of range"),
    (["--point", "0:30,30", "--end", "9"], "--end 9 is out of range"),
    (["--point", "5:30,30", "--end", "4"], "outside the tracked frames 0 to 3"),
    ([], "nothing to track"),
])
def test_bad_prompts_and_ranges(double, video_model, folder, tmp_path, capsys, flags, message):
    out = tmp_path / "out"
    assert run(folder, "--model", video_model, *flags, "--out", out) == 2
    line = error(capsys)
    assert line.startswith("kestrel track: error: ") and message in line, line
    assert not out.exists() and leftovers(tmp_path) == []


def test_bad_videos_and_models(double, video_model, folder, tmp_path, capsys):
    out = tmp_path / "out"
    bad = tmp_path / "bad.mp4"
    bad.write_bytes(b"garbage" * 20)
    empty = tmp_path / "empty"
    empty.mkdir()
    vit = tmp_path / "vit"
    vit.mkdir()
    (vit / "config.json").write_text(json.dumps({"model_type": "vit", "image_size": 32, "patch_size": 16}))
    image_only = tmp_path / "sam2img"
    image_only.mkdir()
    config = json.loads((video_model / "config.json").read_text())
    (image_only / "config.json").write_text(json.dumps(dict(config, model_type="sam2")))
    cases = [
        ((bad, "--model", video_model), "cannot read the video"),
        ((empty, "--model", video_model), "empty video"),
        ((tmp_path / "missing.mp4", "--model", video_model), "no such file"),
        ((folder, "--model", vit), "a vit model; tracking needs SAM 2"),
        ((folder, "--model", image_only), "model_type 'sam2' is SAM 2's image model"),
        ((folder, "--model", video_model, "--eval", tmp_path / "nogt"), "--eval"),
    ]
    for argv, message in cases:
        assert run(*argv, "--point", "0:30,30", "--out", out) == 2
        line = error(capsys)
        assert message in line, line
        assert not out.exists() and leftovers(tmp_path) == []


def test_a_failure_midway_leaves_nothing_and_keeps_the_old_output(video_model, folder, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "masks.json").write_text("{}")  # an earlier run's output

    def failing(frames, model, prompts, **kw):
        yield from list(track_double.track_frames(frames, model, prompts, **kw))[:3]
        raise video_track.TrackError("the engine gave up on frame 3")

    engine = type("Engine", (), {"TrackPrompt": track_double.TrackPrompt, "track_frames": staticmethod(failing)})
    monkeypatch.setattr(video_track, "_engine", lambda: engine)
    assert run(folder, "--model", video_model, "--point", "0:30,30", "--out", out) == 2
    assert "gave up on frame 3" in error(capsys)
    assert sorted(p.name for p in out.iterdir()) == ["masks.json"] and leftovers(tmp_path) == []
    # a folder with other things in it is never replaced
    (out / "masks.json").unlink()
    (out / "thesis.tex").write_text("precious")
    assert run(folder, "--model", video_model, "--point", "0:30,30", "--out", out) == 2
    assert "not empty" in error(capsys) and (out / "thesis.tex").read_text() == "precious"


def test_python_api_is_a_generator(double, video_model, folder):
    model = video_track.load_video_model(video_model)
    prompts = [track_double.TrackPrompt(frame=2, object_id=4, points=((30.0, 30.0),), labels=(1,))]
    it = kestrel.track(folder, model, prompts, end=5)
    frame, masks = next(it)
    assert frame == 2 and set(masks) == {4} and masks[4].dtype == torch.bool and masks[4].shape == (H, W)
    assert [f for f, _ in it] == [3, 4]
    frames = [Image.new("RGB", (W, H))] * 3  # any sequence of PIL images
    assert [f for f, _ in kestrel.track(frames, model, prompts)] == [2]
    with pytest.raises(video_track.TrackError, match="outside the tracked frames 0 to 1"):
        next(kestrel.track(frames[:2], model, prompts))
