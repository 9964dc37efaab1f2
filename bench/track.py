#!/usr/bin/env python
"""Video tracking, Kestrel beside transformers ``Sam2VideoModel``: frames per second and peak memory.

The script builds ``Sam2VideoModel`` from the SAM 2.1 Hiera-tiny config at its real widths (``--config small``
for a smoke test) with seeded random weights at 512 and 1024 px, saves each with ``save_pretrained``, and
tracks the same synthetic clip (854 x 480 frames, made on the fly: a textured background with two moving
shapes; object 1 prompted by a click and object 2 by a box on frame 0) with

    kestrel   ``kestrel.track(frames, model, prompts)``: frames decoded, pre-processed and encoded one at a time
    hf        transformers' inference session in streaming mode (``model(session, frame=pixels)`` per frame,
              prompts added through the session as ``Sam2VideoProcessor`` adds them), the same pre-processing
              (PIL bilinear to the model's size, /255, ImageNet mean and std) and post-processing (logits to the
              frame's size in one bilinear step, > 0)

each row in its own subprocess (so its memory figure is its own), interleaved over ``--rounds`` rounds:
kestrel, hf, kestrel, hf...

Before the rounds, Kestrel tracks 3 frames once per size, untimed (``--no-calibrate`` skips it): the first
run on a machine measures each new GEMM shape (``kestrel.kernels``; cached per machine afterwards, as
``bench/run.py`` calibrates before timing). Its time is printed: it is what a first run here pays once.

Columns: frames per second (median over rounds, first frame excluded: it carries the prompts), ``x HF``
(Kestrel's fps / transformers', > 1 is faster), peak MB (peak RSS while tracking minus RSS before the model
was loaded: weights + state + activations), and mask IoU against transformers on the last frame.

``--memory N`` instead tracks an N-frame clip with Kestrel alone (default 1000 when given without a value)
and prints RSS at checkpoints: memory must stay flat.

    python bench/track.py                           # tiny at 512 and 1024, 8 frames, 2 rounds
    python bench/track.py --config small --frames 4 --rounds 1     # a smoke test
    python bench/track.py --memory 1000 --size 512  # the long clip's peak memory
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import _reset_peak, _status_kb, cpu_name, physical_cores

MARK = "@@TRACK-BENCH "
FRAME_W, FRAME_H = 854, 480
MEAN = np.array([0.485, 0.456, 0.406], np.float32)
STD = np.array([0.229, 0.224, 0.225], np.float32)


def video_config(kind: str, image: int) -> dict[str, Any]:
    """The Sam2VideoConfig dict: Hiera-tiny (the card's widths, the video model's defaults) or a small one."""
    from kestrel.models.cards import CARDS

    cfg = json.loads(json.dumps({k: v for k, v in CARDS["sam2.1-hiera-tiny"].config.items() if k != "model_type"}))
    if kind == "small":  # the memory path's widths equal the decoder's and hold the 64-wide memories
        cfg["vision_config"]["backbone_config"].update(hidden_size=16, embed_dim_per_stage=[16, 32, 64, 128],
                                                       num_attention_heads_per_stage=[1, 2, 2, 4])
        cfg["vision_config"].update(backbone_channel_list=[128, 64, 32, 16], fpn_hidden_size=64)
        cfg["prompt_encoder_config"]["hidden_size"] = 64
        cfg["mask_decoder_config"].update(hidden_size=64, num_attention_heads=2, mlp_dim=64, iou_head_hidden_dim=64)
        cfg.update(memory_attention_hidden_size=64, memory_attention_num_layers=2,
                   memory_attention_feed_forward_hidden_size=64, memory_encoder_hidden_size=64,
                   mask_downsampler_embed_dim=64, memory_fuser_embed_dim=64, memory_fuser_intermediate_dim=64)
    s = image // 4
    cfg["vision_config"]["backbone_config"]["image_size"] = [image, image]
    cfg["vision_config"]["backbone_feature_sizes"] = [[s, s], [s // 2, s // 2], [s // 4, s // 4]]
    cfg["prompt_encoder_config"]["image_size"] = image
    cfg.update(image_size=image, memory_attention_rope_feat_sizes=[image // 16, image // 16])
    return cfg


def save_checkpoint(kind: str, image: int, directory: Path) -> None:
    from transformers import Sam2VideoConfig, Sam2VideoModel

    torch.manual_seed(0)
    Sam2VideoModel(Sam2VideoConfig(**video_config(kind, image))).eval().save_pretrained(directory)


class SyntheticClip(Sequence[Image.Image]):
    """``n`` frames of 854 x 480, each made when asked: a textured background, a disk and a square moving."""

    def __init__(self, n: int) -> None:
        self.n = n
        rng = np.random.default_rng(0)
        self.background = (rng.random(((FRAME_H + 7) // 8, (FRAME_W + 7) // 8, 3)) * 120 + 40).astype(np.uint8)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Image.Image:  # type: ignore[override]
        if not 0 <= i < self.n:
            raise IndexError(i)
        a = np.kron(self.background, np.ones((8, 8, 1), np.uint8))[:FRAME_H, :FRAME_W].copy()
        t = i % 200
        cx, cy = 200 + t, 240 + int(60 * np.sin(t / 15))
        y, x = np.ogrid[:FRAME_H, :FRAME_W]
        a[(x - cx) ** 2 + (y - cy) ** 2 < 60 ** 2] = (230, 60, 40)
        a[300 - t // 2: 400 - t // 2, 550: 650] = (40, 200, 90)
        return Image.fromarray(a)


POINT = (200.0, 240.0)  # object 1: the disk on frame 0
BOX = (545.0, 295.0, 655.0, 405.0)  # object 2: the square on frame 0


def kestrel_prompts() -> list[Any]:
    from kestrel.pipelines.video_tracker import TrackPrompt

    return [TrackPrompt(frame=0, object_id=1, points=(POINT,), labels=(1,)),
            TrackPrompt(frame=0, object_id=2, box=BOX)]


def pixels(frame: Image.Image, size: int) -> torch.Tensor:
    a = np.asarray(frame.resize((size, size), Image.BILINEAR), np.float32) / 255.0
    return torch.from_numpy(((a - MEAN) / STD).transpose(2, 0, 1).copy())


def hf_track(model: Any, frames: Sequence[Image.Image], size: int):
    """transformers' session, streaming: yields (frame, {object: bool mask}) as the processor's users get them."""
    from transformers.models.sam2_video.modeling_sam2_video import Sam2VideoInferenceSession

    session = Sam2VideoInferenceSession(video_height=FRAME_H, video_width=FRAME_W, dtype=torch.float32)
    sx, sy = size / FRAME_W, size / FRAME_H
    for obj, coords, labels in ((1, [[POINT[0] * sx, POINT[1] * sy]], [1]),
                                (2, [[BOX[0] * sx, BOX[1] * sy], [BOX[2] * sx, BOX[3] * sy]], [2, 3])):
        idx = session.obj_id_to_idx(obj)
        session.add_point_inputs(idx, 0, {"point_coords": torch.tensor([[coords]], dtype=torch.float32),
                                          "point_labels": torch.tensor([[labels]], dtype=torch.int32)})
        session.remove_mask_inputs(idx, 0)
    session.obj_with_new_inputs = [1, 2]
    for i in range(len(frames)):
        with torch.inference_mode():
            out = model(session, frame=pixels(frames[i], size).unsqueeze(0), frame_idx=i)
            logits = torch.nn.functional.interpolate(out.pred_masks.float(), size=(FRAME_H, FRAME_W),
                                                     mode="bilinear", align_corners=False)
        yield i, {obj: logits[k, 0] > 0 for k, obj in enumerate(out.object_ids)}


def worker(job: dict[str, Any]) -> dict[str, Any]:
    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(job["threads"])
    rss0 = _status_kb("VmRSS")
    frames = SyntheticClip(job["frames"])
    times: list[float] = []
    checkpoints: dict[int, float] = {}
    last: dict[int, torch.Tensor] = {}
    if job["variant"] == "kestrel":
        import kestrel
        from kestrel.pipelines.video_track import load_video_model

        model = load_video_model(job["dir"])
        it = kestrel.track(frames, model, kestrel_prompts())
    else:
        from transformers import Sam2VideoModel

        model = Sam2VideoModel.from_pretrained(job["dir"]).eval()
        it = hf_track(model, frames, job["size"])
    _reset_peak()
    t = time.perf_counter()
    for i, masks in it:
        now = time.perf_counter()
        times.append(now - t)
        t = now
        last = masks
        if (i + 1) in job.get("checkpoints", ()):
            checkpoints[i + 1] = (_status_kb("VmHWM") - rss0) / 1024
    res = {"variant": job["variant"], "size": job["size"], "frames": len(times), "total_s": sum(times),
           "fps": (len(times) - 1) / sum(times[1:]) if len(times) > 1 else float("nan"),
           "peak_mb": (_status_kb("VmHWM") - rss0) / 1024, "checkpoints": checkpoints}
    res["masks"] = {str(k): np.packbits(v.cpu().numpy()).tobytes().hex() for k, v in last.items()}
    return res


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1] / "src"),
                                                         os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(job)], capture_output=True, text=True,
                          env=env)
    for line in proc.stdout.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    raise RuntimeError(f"{job['variant']} at {job['size']} failed:\n{proc.stderr[-3000:]}")


def iou(a_hex: str, b_hex: str) -> float:
    a = np.unpackbits(np.frombuffer(bytes.fromhex(a_hex), np.uint8)).astype(bool)
    b = np.unpackbits(np.frombuffer(bytes.fromhex(b_hex), np.uint8)).astype(bool)
    union = (a | b).sum()
    return float((a & b).sum() / union) if union else 1.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--config", choices=["tiny", "small"], default="tiny")
    ap.add_argument("--sizes", default="512,1024")
    ap.add_argument("--size", type=int, default=512, help="--memory: the model size")
    ap.add_argument("--frames", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=physical_cores())
    ap.add_argument("--no-calibrate", action="store_true",
                    help="skip the untimed 3-frame Kestrel run per size that calibrates its kernels first")
    ap.add_argument("--memory", type=int, nargs="?", const=1000, default=None,
                    help="track an N-frame clip with Kestrel alone and print RSS at checkpoints (default 1000)")
    args = ap.parse_args(argv)
    if args.worker:
        print(MARK + json.dumps(worker(json.loads(args.worker))), flush=True)
        return 0
    print(f"# {cpu_name()}, {args.threads} threads, torch {torch.__version__}, config {args.config}")
    with tempfile.TemporaryDirectory() as tmp:
        if args.memory:
            d = Path(tmp) / str(args.size)
            save_checkpoint(args.config, args.size, d)
            marks = sorted({m for m in (10, 50, 100, 250, 500, 750, 1000, args.memory) if m <= args.memory})
            r = run_job({"variant": "kestrel", "dir": str(d), "size": args.size, "frames": args.memory,
                         "threads": args.threads, "checkpoints": marks})
            print(f"Kestrel, {args.config} at {args.size} px, {args.memory} frames of {FRAME_W} x {FRAME_H}: "
                  f"{r['fps']:.2f} frames/s")
            print("| frames tracked | peak RSS over the load (MB) |\n|---:|---:|")
            for k, v in sorted(r["checkpoints"].items(), key=lambda kv: int(kv[0])):
                print(f"| {k} | {v:.0f} |")
            return 0
        sizes = [int(s) for s in args.sizes.split(",")]
        dirs = {}
        for s in sizes:
            dirs[s] = Path(tmp) / str(s)
            save_checkpoint(args.config, s, dirs[s])
        if not args.no_calibrate:
            for s in sizes:
                r = run_job({"variant": "kestrel", "dir": str(dirs[s]), "size": s, "frames": 3,
                             "threads": args.threads})
                print(f"calibration run at {s} px (3 frames, untimed in the table): {r['total_s']:.1f} s", flush=True)
        results: dict[tuple[int, str], list[dict[str, Any]]] = {}
        for _ in range(args.rounds):
            for s in sizes:
                for variant in ("kestrel", "hf"):
                    job = {"variant": variant, "dir": str(dirs[s]), "size": s, "frames": args.frames,
                           "threads": args.threads}
                    results.setdefault((s, variant), []).append(run_job(job))
        print(f"\n{args.frames} frames of {FRAME_W} x {FRAME_H}, 2 objects (a click, a box), {args.rounds} rounds, "
              "interleaved\n")
        print("| size | | frames/s | x HF | peak MB | mask IoU vs HF (last frame) |\n|---:|---|---:|---:|---:|---:|")
        for s in sizes:
            hf_fps = statistics.median(r["fps"] for r in results[(s, "hf")])
            for variant in ("kestrel", "hf"):
                rows = results[(s, variant)]
                fps = statistics.median(r["fps"] for r in rows)
                peak = statistics.median(r["peak_mb"] for r in rows)
                ref = results[(s, "hf")][-1]["masks"]
                ious = [iou(rows[-1]["masks"][k], ref[k]) for k in sorted(ref) if k in rows[-1]["masks"]]
                name = "Kestrel" if variant == "kestrel" else "transformers"
                print(f"| {s} | {name} | {fps:.2f} | {fps / hf_fps:.2f} | {peak:.0f} | "
                      f"{min(ious) if ious else float('nan'):.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
