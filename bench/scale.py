#!/usr/bin/env python
"""Dataset embedding on this machine: the local engine beside Ray Data with 1 and 2 workers, in one run.

The script builds a DINOv2 checkpoint from a config with seeded random weights (small by default,
the real dinov2-base config with ``--base``), writes ``--images`` random PNGs, and runs
``kestrel.scale.run_job`` (the code behind ``kestrel embed SOURCE --out DIR``) over them:

    local      one process, torch threads = the CPUs of this machine
    ray-1      Ray Data, one actor with all the CPUs (torch threads = CPUs)
    ray-2      Ray Data, two actors with half the CPUs each (torch threads = CPUs / 2)

Ray is started once, before the timed runs, with this machine's CPUs; its start-up is shown apart.
Each run writes its own output folder; the features of every Ray run are compared with the local
run's (``bit-identical`` or the max |diff|). What is printed, per run:

    wall s      the job from start to finish, actor start-up and model loading included
    img/s       images / wall s
    busy img/s  images / (the longest worker's summed shard time): the rate once workers are up
    per worker  pid, shards, images, busy s, CPU s (all its threads), CPU use (CPU s / busy s, in
                cores), peak RSS MB (the worker process, model and torch included)

The machine may be shared: the share of CPU time other processes used during each run is printed
(``others``); a run with a large share was disturbed. Figures are one run each; compare them as
ratios within one run of the script.

    python bench/scale.py                      # 256 images, small config
    python bench/scale.py --base --images 64   # dinov2-base at 224
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))


def build_checkpoint(directory: Path, base: bool) -> None:
    import torch
    from transformers import BitImageProcessor, Dinov2Config, Dinov2Model

    if base:
        cfg = Dinov2Config(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                           image_size=518, patch_size=14, layerscale_value=1.0)
        proc = BitImageProcessor(size={"shortest_edge": 256}, crop_size={"height": 224, "width": 224})
    else:
        cfg = Dinov2Config(hidden_size=192, num_hidden_layers=4, num_attention_heads=3, intermediate_size=768,
                           image_size=112, patch_size=14)
        proc = BitImageProcessor(size={"shortest_edge": 128}, crop_size={"height": 112, "width": 112})
    torch.manual_seed(0)
    Dinov2Model(cfg).eval().save_pretrained(directory)
    proc.save_pretrained(directory)


def write_images(folder: Path, n: int) -> None:
    rng = np.random.default_rng(0)
    for i in range(n):
        sub = folder / f"{i // 64:03d}"
        sub.mkdir(parents=True, exist_ok=True)
        h, w = rng.integers(160, 320, 2)
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(sub / f"{i:05d}.png")


def cpu_times() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, from /proc/stat."""
    fields = [float(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields) - idle) / os.sysconf("SC_CLK_TCK"), sum(fields) / os.sysconf("SC_CLK_TCK")


def features(out: Path) -> np.ndarray:
    import pyarrow.parquet as pq

    t = pq.read_table(sorted(out.glob("part-*.parquet")))
    return np.stack(t.column("features").to_numpy(zero_copy_only=False))


def run(name: str, model: Path, photos: Path, out: Path, engine: str, workers: int | None, threads: int,
        batch: int, shard: int) -> dict:
    from kestrel.pipelines.jobs import JobSpec
    from kestrel.scale import run_job

    busy0, _ = cpu_times()
    start = time.perf_counter()
    summary = run_job(JobSpec("embed", str(model), batch_size=batch), photos, out, engine=engine, workers=workers,
                      threads=threads, shard_size=shard, progress=False)
    wall = time.perf_counter() - start
    busy1, _ = cpu_times()
    per: dict[str, dict] = defaultdict(lambda: {"shards": 0, "images": 0, "busy": 0.0, "cpu": 0.0, "rss": 0.0})
    for s in summary.manifest["shards"]:
        w = per[s["worker"]]
        w["shards"] += 1
        w["images"] += s["images"]
        w["busy"] += s["seconds"]
        w["cpu"] += s["cpu_seconds"]
        w["rss"] = max(w["rss"], s["max_rss_mb"])
    own_cpu = sum(w["cpu"] for w in per.values())
    ncpu = os.cpu_count() or 1
    others = max(0.0, (busy1 - busy0) - own_cpu) / max(wall * ncpu, 1e-9)
    longest = max(w["busy"] for w in per.values())
    return {"run": name, "wall_s": wall, "img_s": summary.rows / wall, "busy_img_s": summary.rows / longest,
            "rows": summary.rows, "threads": threads, "workers": dict(per), "others": others}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=256, help="how many images (default 256)")
    ap.add_argument("--base", action="store_true", help="the dinov2-base config at 224 instead of the small one")
    ap.add_argument("--batch-size", type=int, default=8, help="images per forward pass (default 8)")
    ap.add_argument("--shard-size", type=int, default=32, help="images per shard (default 32)")
    ap.add_argument("--runs", default="local,ray-1,ray-2", help="comma list from local, ray-1, ray-2")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    ncpu = os.cpu_count() or 1
    runs = args.runs.split(",")
    with tempfile.TemporaryDirectory(prefix="kestrel-scale-") as tmp:
        root = Path(tmp)
        build_checkpoint(root / "model", args.base)
        write_images(root / "photos", args.images)
        size = "dinov2-base 224" if args.base else "small dinov2 112"
        print(f"{args.images} images, {size}, batch {args.batch_size}, shard {args.shard_size}, {ncpu} CPUs")
        results = []
        if any(r.startswith("ray") for r in runs):
            import ray

            from kestrel.scale.ray_engine import start_ray

            t = time.perf_counter()
            start_ray(num_cpus=ncpu)
            print(f"ray start-up: {time.perf_counter() - t:.1f} s (not in the rows)")
        try:
            for name in runs:
                engine, workers = ("local", None) if name == "local" else ("ray", int(name.split("-")[1]))
                threads = ncpu if workers is None else max(1, ncpu // workers)
                results.append(run(name, root / "model", root / "photos", root / name, engine, workers, threads,
                                   args.batch_size, args.shard_size))
        finally:
            if any(r.startswith("ray") for r in runs):
                ray.shutdown()
        ref = features(root / "local") if "local" in runs else None
        print(f"\n{'run':7} {'wall s':>7} {'img/s':>7} {'busy img/s':>10} {'threads':>7} {'others':>6}  same as local")
        for r in results:
            same = "-"
            if ref is not None and r["run"] != "local":
                f = features(root / r["run"])
                same = "bit-identical" if np.array_equal(f, ref) else f"max|diff| {np.abs(f - ref).max():.2e}"
            r["same_as_local"] = same
            print(f"{r['run']:7} {r['wall_s']:7.1f} {r['img_s']:7.1f} {r['busy_img_s']:10.1f} {r['threads']:7d} "
                  f"{r['others']:6.0%}  {same}")
        print(f"\n{'run':7} {'worker':>16} {'shards':>6} {'images':>6} {'busy s':>7} {'CPU s':>7} {'cores':>5} "
              f"{'RSS MB':>7}")
        for r in results:
            for w, s in sorted(r["workers"].items()):
                print(f"{r['run']:7} {w:>16} {s['shards']:6d} {s['images']:6d} {s['busy']:7.1f} {s['cpu']:7.1f} "
                      f"{s['cpu'] / max(s['busy'], 1e-9):5.2f} {s['rss']:7.0f}")
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
