"""SAM 2.1 in video: the memory blocks check, a Sam2VideoModel save loads with its video entries, and
the streaming tracker agrees with transformers' ``Sam2VideoModel`` driven through its inference session.

The default run uses small widths at a 128 px image (every part of the memory exercised: several
objects, a box and points on frame 0, a correction click and a new object on later frames, memory
and pointer windows shorter than the clip, occluded frames); the real Hiera-tiny widths at 1024 px
run under ``-m slow``.
"""

from __future__ import annotations

import copy
import gc
import os

import numpy as np
import PIL.Image
import pytest
import torch
import torch.nn.functional as F
from transformers import Sam2VideoConfig, Sam2VideoModel
from transformers.models.sam2_video import modeling_sam2_video
from transformers.models.sam2_video.modeling_sam2_video import Sam2VideoInferenceSession

import kestrel
from kestrel.checker.check import check_program
from kestrel.models import sam2_video
from kestrel.models.cards import CARDS
from kestrel.pipelines import video_tracker
from kestrel.pipelines.video_tracker import TrackError, TrackPrompt, VideoTracker, _merge, track_frames
from kestrel.types.dtypes import f32
from reference import SAM2_BUFFERS, SAM2_TABLES, rel_diff, spread_weights
from test_sam2 import small_config

TOL = 1e-5  # the bound for video logits, relative to the largest reference value


def video_config(image: int = 128, hd: int = 128, **video) -> dict:
    """A Sam2VideoConfig dict: small widths (Hiera-tiny's layout), the memory at ``hd`` wide."""
    cfg = small_config(image, hd=hd)
    e = image // 16
    cfg.update(model_type="sam2_video", image_size=image, memory_attention_hidden_size=hd,
               memory_encoder_hidden_size=hd, mask_downsampler_embed_dim=hd, memory_fuser_embed_dim=hd,
               memory_attention_rope_feat_sizes=[e, e], memory_attention_feed_forward_hidden_size=96,
               memory_fuser_intermediate_dim=80, memory_attention_num_layers=2)
    cfg.update(video)
    return cfg


def seeded_video(config: dict, seed: int = 0, object_bias: float = 0.0) -> Sam2VideoModel:
    """A transformers Sam2VideoModel with random weights everywhere (upstream zero-initialises the
    position tables, the no-memory, no-object and occlusion embeddings and the temporal encodings,
    and scales the fuser by 1e-6, which would hide them from the comparison)."""
    torch.manual_seed(seed)
    cfg = {k: v for k, v in config.items() if k != "model_type"}
    ref = Sam2VideoModel(Sam2VideoConfig(**cfg)).eval()
    with torch.no_grad():
        fuser = ((("memory_fuser.layers.0.scale", "memory_fuser.layers.1.scale"), 0.5, 0.1),)
        spread_weights(ref, SAM2_TABLES + fuser, SAM2_BUFFERS)
        # the object-score head's last bias decides how often an object "appears": both cases matter
        ref.mask_decoder.pred_obj_score_head.proj_out.bias.fill_(object_bias)
    return ref


def synthetic_frames(n: int, width: int = 96, height: int = 80, seed: int = 0) -> list[PIL.Image.Image]:
    """Frames of a smooth background with two discs moving across it."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 255, (height // 8 + 1, width // 8 + 1, 3)).astype(np.uint8)
    bg = np.asarray(PIL.Image.fromarray(base).resize((width, height), PIL.Image.BILINEAR)).astype(np.float32)
    yy, xx = np.mgrid[0:height, 0:width]
    out = []
    for t in range(n):
        img = bg.copy()
        for cx, cy, r, color in ((20 + 3 * t, 30 + t, 12, (250, 40, 40)), (70 - 2 * t, 50, 10, (30, 220, 60))):
            img[(xx - cx) ** 2 + (yy - cy) ** 2 <= r * r] = color
        out.append(PIL.Image.fromarray(img.clip(0, 255).astype(np.uint8)))
    return out


def reference_track(ref: Sam2VideoModel, pixels: torch.Tensor, size: tuple[int, int],
                    prompts: list[TrackPrompt], reverse: bool = False) -> dict[int, dict[int, torch.Tensor]]:
    """transformers' answer: its inference session over the whole clip, each frame's prompts added just
    before the frame is run (as ``Sam2VideoProcessor.add_inputs_to_inference_session`` adds them: box
    corners labelled 2 and 3 first, then the points, coordinates scaled to the model frame)."""
    return reference_session(ref, pixels, size, prompts, reverse)[0]


def reference_session(ref: Sam2VideoModel, pixels: torch.Tensor, size: tuple[int, int], prompts: list[TrackPrompt],
                      reverse: bool = False) -> tuple[dict[int, dict[int, torch.Tensor]], Sam2VideoInferenceSession]:
    """:func:`reference_track`'s answer and the session that holds what each frame stored (its memories)."""
    h, w = size
    s = ref.config.image_size
    session = Sam2VideoInferenceSession(video=pixels, video_height=h, video_width=w, dtype=torch.float32)
    n = pixels.shape[0]
    out: dict[int, dict[int, torch.Tensor]] = {}
    for f in (range(n - 1, -1, -1) if reverse else range(n)):
        here = list(_merge([p for p in prompts if p.frame == f]).values())  # one call's inputs per object
        if here:
            for p in here:
                idx = session.obj_id_to_idx(p.object_id)
                coords = ([[p.box[0], p.box[1]], [p.box[2], p.box[3]]] if p.box else []) + [list(q) for q in p.points]
                labels = ([2, 3] if p.box else []) + list(p.labels)
                xy = torch.tensor(coords, dtype=torch.float32)
                xy[:, 0] = xy[:, 0] * (s / w)
                xy[:, 1] = xy[:, 1] * (s / h)
                session.add_point_inputs(idx, f, {"point_coords": xy.reshape(1, 1, -1, 2),
                                                  "point_labels": torch.tensor(labels).reshape(1, 1, -1)})
                session.remove_mask_inputs(idx, f)
            session.obj_with_new_inputs = [p.object_id for p in here]
        if session.get_obj_num() == 0:
            out[f] = {}
            continue
        result = ref(inference_session=session, frame_idx=f, reverse=reverse)
        out[f] = {oid: result.pred_masks[i, 0] for i, oid in enumerate(result.object_ids)}
    return out, session


def compare(model, ref, frames, prompts, reverse=False, bound=TOL) -> dict[str, float]:
    """Run both; every frame's logits (low resolution, and at the frame's size by one bilinear step)
    must agree within ``bound`` and every mask (logits > 0) exactly. Returns the figures."""
    size = 16 * int(model.E)
    tracker = VideoTracker(model, len(frames))
    pixels = torch.cat([tracker.preprocess(f) for f in frames])
    want = reference_track(ref, pixels, (frames[0].height, frames[0].width), prompts, reverse)
    worst, mask_flips, frames_seen, absent = 0.0, 0, 0, 0
    for f, logits in track_frames(frames, model, prompts, reverse=reverse):
        assert set(logits) == set(want[f]), (f, set(logits), set(want[f]))
        for oid, got in logits.items():
            low = want[f][oid]
            assert low.shape == (size // 4, size // 4)
            up = F.interpolate(low[None, None].float(), size=got.shape, mode="bilinear", align_corners=False)[0, 0]
            worst = max(worst, rel_diff(got, up))
            mask_flips += int(((got > 0) != (up > 0)).sum())
            absent += int(bool((low <= -1024).all()))
        frames_seen += 1
    assert frames_seen == len(frames)
    figures = {"max rel diff": worst, "mask pixels differing": mask_flips, "occluded object-frames": absent}
    assert worst <= bound, figures
    assert mask_flips == 0, figures
    return figures


# ---------------------------------------------------------------------------------------- declarations


def test_program_checks_clean():
    report = check_program(sam2_video.VideoModel)
    assert report.ok, "\n".join(map(str, report.diagnostics))


def test_video_model_extends_the_image_model():
    decl = sam2_video.VideoModel.decl()
    names = [f.name for f in decl.entries]
    for entry in ("encode_image", "decode_points", "decode_boxes", "decode_tokens", "encode_frame", "attend_memory",
                  "track_step", "encode_memory"):
        assert entry in names, names
    members = [m.name for m in decl.members]
    assert members.index("mask_decoder") < members.index("memory_encoder")


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    cfg = video_config(num_maskmem=3, max_object_pointers_in_encoder=4)
    ref = seeded_video(cfg, object_bias=1.0)
    d = tmp_path_factory.mktemp("sam2video")
    ref.save_pretrained(d)
    return ref, kestrel.load(d), d


def test_video_save_loads_with_video_entries(small):
    _, model, _ = small
    assert isinstance(model, sam2_video.VideoModel)
    assert (model.Mem, model.MaskMem, model.MemLayers, model.E, model.Hd) == (64, 3, 2, 8, 128)
    names = set(dict(model.named_parameters()))
    assert "memory_attention.layers.1.cross_attn_image.k_proj.weight" in names
    assert "memory_encoder.mask_downsampler.layer_3.conv.weight" in names


def test_image_save_still_loads_image_model(tmp_path):
    from test_sam2 import seeded_sam2

    ref = seeded_sam2(small_config(128, hd=64))
    ref.save_pretrained(tmp_path)
    model = kestrel.load(tmp_path)
    assert not isinstance(model, sam2_video.VideoModel)
    with pytest.raises(TrackError, match="image model"):
        track_frames(synthetic_frames(2), model, [TrackPrompt(0, 1, ((5.0, 5.0),), (1,))])


class _MemoriesInF32:
    """transformers' ``torch`` as its video model module sees it, with ``torch.bfloat16`` meaning float32:
    the one place that module names bfloat16 is where it rounds a frame's memory for storage."""

    bfloat16 = torch.float32

    def __getattr__(self, name: str):
        return getattr(torch, name)


@pytest.fixture
def unrounded_memories(monkeypatch):
    """Both trackers keep their memories in float32 for the parity tests, not rounded to bfloat16.

    SAM 2.1 rounds each frame's memory to bf16 (as upstream stores it). A ~1e-7 difference between two
    f32 GEMM kernels (or torch's layer norm against its formula) then flips one rounding now and then, and a
    flipped rounding moves a later frame by ~1e-5: on an AMD EPYC these tests passed or failed from one
    session to the next with the kernels its calibration picked (1.01e-5 forward, 1.75e-5 and 1.92e-5 on the
    occluded clip), and no one kernel kept all three within the bound. Without the rounding the comparison
    measures the tracking itself, on whatever kernels the session picked. The rounding is the same cast on
    both sides (``VideoModel.encode_memory`` and the tracker's ``MEMORY_DTYPE``;
    ``test_bank_is_bounded_over_a_long_clip`` checks the bank keeps bf16)."""
    monkeypatch.setattr(modeling_sam2_video, "torch", _MemoriesInF32())
    monkeypatch.setattr(sam2_video, "bf16", f32)
    monkeypatch.setattr(video_tracker, "MEMORY_DTYPE", torch.float32)


def test_tracking_agrees_with_transformers(small, unrounded_memories):
    ref, model, _ = small
    frames = synthetic_frames(12)
    prompts = [
        TrackPrompt(0, 1, box=(8.0, 18.0, 33.0, 43.0)),
        TrackPrompt(0, 2, points=((70.0, 50.0),), labels=(1,)),
        TrackPrompt(0, 3, points=((40.0, 10.0), (60.0, 70.0)), labels=(1, 0)),
        TrackPrompt(3, 4, points=((50.0, 40.0),), labels=(1,)),  # an object that starts later
        TrackPrompt(6, 1, points=((38.0, 36.0),), labels=(1,)),  # a correction click on a later frame
        TrackPrompt(6, 1, points=((10.0, 10.0),), labels=(0,)),
    ]
    figures = compare(model, ref, frames, prompts)
    print("video parity (small, forward):", figures)


def test_tracking_in_reverse_agrees_with_transformers(small, unrounded_memories):
    ref, model, _ = small
    frames = synthetic_frames(8)
    prompts = [TrackPrompt(7, 2, points=((56.0, 50.0),), labels=(1,)),
               TrackPrompt(7, 5, box=(30.0, 25.0, 70.0, 60.0), points=((45.0, 40.0),), labels=(1,))]
    figures = compare(model, ref, frames, prompts, reverse=True)
    print("video parity (small, reverse):", figures)


def test_occluded_objects_agree_with_transformers(tmp_path, monkeypatch):
    """An object-score head that often says "no object": the occlusion embedding and no-object pointer.

    Run on torch's own GEMM, as transformers runs, and with the memories rounded to bf16 as both store them:
    this clip's object scores and mask logits stand near 0, where both trackers threshold them (occluded or
    not, the binarised mask of a prompted frame), so unrounded memories (``unrounded_memories``) moved it by
    2e-4 with no mask pixel changed, and other kernels by 1.75e-5-1.92e-5 through flipped roundings.
    Whether it passed hung on which kernel the calibration picked. The kernels' own agreement with
    F.linear (~1e-6) is tested in test_kernels."""
    monkeypatch.setenv("KESTREL_LINEAR", "torch")
    cfg = video_config(num_maskmem=3, max_object_pointers_in_encoder=4)
    ref = seeded_video(cfg, seed=1, object_bias=0.0)
    ref.save_pretrained(tmp_path)
    model = kestrel.load(tmp_path)
    frames = synthetic_frames(8, seed=2)
    prompts = [TrackPrompt(0, 1, points=((20.0, 30.0),), labels=(1,)),
               TrackPrompt(0, 2, points=((70.0, 50.0),), labels=(1,)),
               TrackPrompt(4, 2, points=((64.0, 50.0),), labels=(1,))]
    figures = compare(model, ref, frames, prompts)
    print("video parity (small, occlusion):", figures)
    assert figures["occluded object-frames"] > 0, figures


def teacher_forced(model, ref, frames, prompts) -> dict[str, float]:
    """Kestrel's tracker on transformers' bank: after each frame, the memory and object pointer Kestrel stored
    for every object are replaced by those transformers stored for the same frame. A difference then cannot
    compound through the memories (bf16, where a ~1e-7 difference can flip a rounding): each frame compares
    one step of the tracker, on whatever kernels the machine's calibration chose."""
    tracker = VideoTracker(model, len(frames))
    pixels = torch.cat([tracker.preprocess(f) for f in frames])
    want, session = reference_session(ref, pixels, (frames[0].height, frames[0].width), prompts)
    worst, flips, replaced, absent = 0.0, 0, 0, 0
    for f, frame in enumerate(frames):
        got = tracker.step(f, frame, [p for p in prompts if p.frame == f], reverse=False)
        assert set(got) == set(want[f]), (f, set(got), set(want[f]))
        for oid, logits in got.items():
            low = want[f][oid]
            up = F.interpolate(low[None, None].float(), size=logits.shape, mode="bilinear", align_corners=False)[0, 0]
            worst = max(worst, rel_diff(logits, up))
            flips += int(((logits > 0) != (up > 0)).sum())
            absent += int(bool((low <= -1024).all()))
        for oid, track in tracker.objects.items():
            stored = session.output_dict_per_obj[session.obj_id_to_idx(oid)]
            theirs = stored["cond_frame_outputs"].get(f) or stored["non_cond_frame_outputs"][f]
            ours = track.conditioning[f] if f in track.conditioning else track.recent[f]
            features = theirs["maskmem_features"]  # [E * E, 1, Mem]: the grid's cells first
            memory = features[:, 0].transpose(0, 1).reshape(ours.memory.shape)
            assert memory.dtype == ours.memory.dtype == torch.bfloat16
            assert rel_diff(ours.memory.float(), memory.float()) < 0.02  # the same memory, up to bf16 roundings
            ours.memory, ours.pointer = memory.clone(), theirs["object_pointer"].reshape(ours.pointer.shape).clone()
            replaced += 1
    assert replaced >= len(frames)
    return {"max rel diff": worst, "mask pixels differing": flips, "occluded object-frames": absent}


def test_occluded_objects_agree_step_by_step_on_the_calibrated_kernels(tmp_path):
    """The occlusion clip of the test above, on the kernels this machine's calibration picks and with the
    memories rounded to bf16, as both trackers keep them: step by step on transformers' bank (teacher forcing),
    each frame within the bound."""
    cfg = video_config(num_maskmem=3, max_object_pointers_in_encoder=4)
    ref = seeded_video(cfg, seed=1, object_bias=0.0)
    ref.save_pretrained(tmp_path)
    model = kestrel.load(tmp_path)
    frames = synthetic_frames(8, seed=2)
    prompts = [TrackPrompt(0, 1, points=((20.0, 30.0),), labels=(1,)),
               TrackPrompt(0, 2, points=((70.0, 50.0),), labels=(1,)),
               TrackPrompt(4, 2, points=((64.0, 50.0),), labels=(1,))]
    figures = teacher_forced(model, ref, frames, prompts)
    print("video parity (small, occlusion, teacher-forced):", figures)
    assert figures["occluded object-frames"] > 0, figures
    assert figures["max rel diff"] <= TOL, figures
    assert figures["mask pixels differing"] == 0, figures


@pytest.mark.parametrize("length", [24, pytest.param(200, marks=pytest.mark.slow)])
def test_bank_is_bounded_over_a_long_clip(small, length):
    """The bank holds the conditioning frames and a fixed window, whatever the clip's length."""
    _, model, _ = small
    frames = synthetic_frames(4)
    clip = _Repeat(frames, length)
    prompts = [TrackPrompt(0, 1, points=((20.0, 30.0),), labels=(1,)),
               TrackPrompt(length // 4, 2, box=(55, 35, 85, 65))]
    tracker = VideoTracker(model, len(clip))
    sizes = []
    for f in range(len(clip)):
        tracker.step(f, clip[f], [p for p in prompts if p.frame == f], reverse=False)
        sizes.append(tracker.bank_size())
    window = max(model.MaskMem - 1, 4 - 1)  # max_object_pointers_in_encoder = 4
    assert max(sizes) <= 2 * window + 2, max(sizes)  # two objects, one conditioning frame each
    assert sizes[-1] == sizes[length // 2]
    memories = [m.memory for o in tracker.objects.values() for m in [*o.conditioning.values(), *o.recent.values()]
                if m.memory is not None]
    assert memories and all(m.dtype == torch.bfloat16 for m in memories)  # kept as upstream keeps them


class _Repeat:
    """A long lazy clip made of a few frames."""

    def __init__(self, frames, n):
        self.frames, self.n = frames, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if not 0 <= i < self.n:
            raise IndexError(i)
        return self.frames[i % len(self.frames)]


@pytest.mark.parametrize("prompt, message", [
    (TrackPrompt(9, 1, ((1.0, 1.0),), (1,)), "out of range"),
    (TrackPrompt(0, 0, ((1.0, 1.0),), (1,)), "object ids"),
    (TrackPrompt(0, 1, ((1.0, 1.0),), (2,)), "label"),
    (TrackPrompt(0, 1, ((1.0, 1.0), (2.0, 2.0)), (1,)), "2 point"),
    (TrackPrompt(0, 1, box=(10.0, 10.0, 5.0, 20.0)), "box"),
    (TrackPrompt(0, 1), "at least one point"),
])
def test_bad_prompts_are_refused(small, prompt, message):
    _, model, _ = small
    with pytest.raises(TrackError, match=message):
        track_frames(synthetic_frames(3), model, [prompt])


def test_not_sam2_is_refused():
    with pytest.raises(TrackError, match="not SAM 2"):
        track_frames(synthetic_frames(2), torch.nn.Linear(2, 2), [TrackPrompt(0, 1, ((1.0, 1.0),), (1,))])


def test_card_binds_video_generics():
    cfg = copy.deepcopy(CARDS["sam2.1-hiera-tiny"].config)
    cfg["model_type"] = "sam2_video"
    g = CARDS["sam2.1-hiera-tiny"].family.generics(cfg)
    assert (g["Mem"], g["MaskMem"], g["MemLayers"], g["MemInner"], g["FuserInner"], g["FuserLayers"]) == (
        64, 7, 4, 2048, 1024, 2)


@pytest.mark.slow
def test_tracking_agrees_at_real_widths(tmp_path, unrounded_memories):
    """Hiera-tiny's real widths at 1024 px (random weights): several objects, a box, a correction."""
    cfg = CARDS["sam2.1-hiera-tiny"].config
    real = copy.deepcopy(cfg)
    real.update(model_type="sam2_video")
    ref = seeded_video(real, object_bias=1.0)
    ref.save_pretrained(tmp_path)
    del ref
    gc.collect()
    ref = Sam2VideoModel.from_pretrained(tmp_path).eval()
    model = kestrel.load(tmp_path)
    frames = synthetic_frames(6, width=160, height=120)
    prompts = [TrackPrompt(0, 1, box=(8.0, 18.0, 33.0, 43.0)),
               TrackPrompt(0, 2, points=((70.0, 50.0),), labels=(1,)),
               TrackPrompt(3, 1, points=((30.0, 36.0),), labels=(1,))]
    figures = compare(model, ref, frames, prompts)
    print("video parity (hiera-tiny widths, 1024):", figures)


if os.environ.get("KESTREL_VIDEO_DEBUG"):  # pragma: no cover
    torch.set_printoptions(precision=8)
