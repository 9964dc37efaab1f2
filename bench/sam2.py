#!/usr/bin/env python
"""SAM 2.1 Hiera beside transformers ``Sam2Model``: the image encoder and one decode, at 512 and 1024 px.

The script builds ``Sam2Model`` from the Hiera-tiny config (``--config small`` for a smoke test)
with seeded random weights, saves it with ``save_pretrained``, and for each size and part runs
Kestrel eager and transformers eager, each in its own subprocess (so the peak-memory figure is the
row's own), interleaved: kestrel, hf, kestrel, hf... over ``--rounds`` rounds; the row reports the
median over all its timed calls.

    encoder   Kestrel ``encode_image`` / transformers ``get_image_embeddings`` on one image
              (transformers also applies conv_s0 / conv_s1 there; Kestrel in the decoder)
    decode    one point prompt: Kestrel ``decode_points`` (all four masks) / transformers
              ``Sam2Model(image_embeddings=..., multimask_output=True)`` (prompt encoder + decoder);
              every call on the same features, as a second prompt on an image: transformers projected
              them (conv_s0 / conv_s1) in get_image_embeddings, Kestrel's decoder keeps its projections
              for as long as the same features come back (``ops.kept``)

Columns: median and min seconds, ``x HF`` (Kestrel median / transformers median, < 1 is faster),
peak MB (peak RSS during the timed calls minus RSS before loading: weights + activations), and
rel diff (max |kestrel - hf| / max |hf| of the image embedding / the three multimask logits).
The machine may be shared: ``others`` is the share of CPU time other processes used during the
row, so a disturbed row can be recognised.

    python bench/sam2.py                      # tiny, 512 and 1024, 3 timed calls per row and round
    python bench/sam2.py --config small --repeat 1 --rounds 1   # a smoke test
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
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import OtherLoad, _reset_peak, _status_kb, cpu_name, physical_cores

MARK = "@@SAM2-BENCH "


def config(kind: str, image: int) -> dict[str, Any]:
    """The Sam2Config dict: Hiera-tiny (the card's) or a small one, at ``image`` px."""
    from kestrel.models.cards import CARDS

    cfg = json.loads(json.dumps({k: v for k, v in CARDS["sam2.1-hiera-tiny"].config.items() if k != "model_type"}))
    if kind == "small":
        cfg["vision_config"]["backbone_config"].update(hidden_size=16, embed_dim_per_stage=[16, 32, 64, 128],
                                                       num_attention_heads_per_stage=[1, 2, 2, 4])
        cfg["vision_config"].update(backbone_channel_list=[128, 64, 32, 16], fpn_hidden_size=32)
        cfg["prompt_encoder_config"]["hidden_size"] = 32
        cfg["mask_decoder_config"].update(hidden_size=32, num_attention_heads=2, mlp_dim=64, iou_head_hidden_dim=32)
    s = image // 4
    cfg["vision_config"]["backbone_config"]["image_size"] = [image, image]
    cfg["vision_config"]["backbone_feature_sizes"] = [[s, s], [s // 2, s // 2], [s // 4, s // 4]]
    cfg["prompt_encoder_config"]["image_size"] = image
    return cfg


def save_checkpoint(kind: str, directory: Path) -> None:
    from transformers import Sam2Config, Sam2Model

    torch.manual_seed(0)
    ref = Sam2Model(Sam2Config(**config(kind, 1024))).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith(("pos_embed", "pos_embed_window", "no_memory_embedding")):
                p.normal_(0, 0.5)
            elif p.dim() >= 2:
                p.normal_(0, p[0].numel() ** -0.5)
    ref.save_pretrained(directory)


def worker(job: dict[str, Any]) -> dict[str, Any]:
    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(job["threads"])
    image, impl, part = job["image"], job["impl"], job["part"]
    torch.manual_seed(1)
    pixels = torch.randn(1, 3, image, image)
    point = torch.tensor([[[[0.3 * image, 0.6 * image]]]])
    label = torch.tensor([[[1]]], dtype=torch.int32)
    rss0 = _status_kb("VmRSS") or 0
    if impl == "kestrel":
        import kestrel

        model = kestrel.load(job["checkpoint"], E=image // 16)
        with torch.no_grad():
            emb, hr0, hr1 = model.encode_image(pixels)
        if part == "encoder":
            def fn():
                return model.encode_image(pixels)[0]
        else:
            def fn():
                return model.decode_points(emb, hr0, hr1, point, label)[0][:, :, 1:]
    else:
        from transformers import Sam2Config, Sam2Model

        model = Sam2Model(Sam2Config(**config(job["kind"], image))).eval()
        from safetensors.torch import load_file

        model.load_state_dict(load_file(str(Path(job["checkpoint"]) / "model.safetensors")))
        with torch.no_grad():
            feats = model.get_image_embeddings(pixels)
        if part == "encoder":
            def fn():
                return model.get_image_embeddings(pixels)[-1]
        else:
            def fn():
                return model(image_embeddings=feats, input_points=point, input_labels=label,
                             multimask_output=True).pred_masks
    with torch.no_grad():
        for _ in range(job["warmup"]):
            out = fn()
        _reset_peak()
        times = []
        with OtherLoad() as load:
            for _ in range(job["repeat"]):
                t = time.perf_counter()
                out = fn()
                times.append(time.perf_counter() - t)
        others = load.share or 0.0
    peak = (_status_kb("VmHWM") or 0) - rss0
    from safetensors.torch import save_file

    save_file({"out": out.contiguous()}, job["output"])
    return {"times": times, "peak_mb": peak / 1024, "others": others}


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(job)], capture_output=True, text=True,
                          env=env, timeout=job["timeout"])
    for line in proc.stdout.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    raise RuntimeError(f"{job['impl']} {job['part']} {job['image']}: worker failed:\n{proc.stderr[-3000:]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--config", choices=("tiny", "small"), default="tiny")
    ap.add_argument("--sizes", default="512,1024", help="image sizes, comma-separated (default 512,1024)")
    ap.add_argument("--parts", default="encoder,decode")
    ap.add_argument("--repeat", type=int, default=3, help="timed calls per row and round")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2, help="interleaved kestrel/hf rounds")
    ap.add_argument("--threads", type=int, default=physical_cores())
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(MARK + json.dumps(worker(json.loads(args.worker))), flush=True)
        return 0

    from safetensors.torch import load_file

    print(f"# SAM 2.1 Hiera-{args.config}: {cpu_name()}, {args.threads} threads, torch {torch.__version__}")
    print(f"{'part':8} {'size':>5} {'impl':18} {'median s':>9} {'min s':>8} {'x HF':>6} {'peak MB':>8} "
          f"{'rel diff':>9} {'others':>7}")
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "ckpt"
        save_checkpoint(args.config, ckpt)
        for size in [int(s) for s in args.sizes.split(",")]:
            for part in args.parts.split(","):
                rows: dict[str, dict[str, Any]] = {}
                for _ in range(args.rounds):
                    for impl in ("kestrel", "hf"):
                        job = {"image": size, "impl": impl, "part": part, "kind": args.config,
                               "checkpoint": str(ckpt), "threads": args.threads, "warmup": args.warmup,
                               "repeat": args.repeat, "timeout": args.timeout,
                               "output": str(Path(tmp) / f"{impl}-{part}-{size}.safetensors")}
                        res = run_job(job)
                        row = rows.setdefault(impl, {"times": [], "peak_mb": 0.0, "others": []})
                        row["times"] += res["times"]
                        row["peak_mb"] = max(row["peak_mb"], res["peak_mb"])
                        row["others"].append(res["others"])
                ours = load_file(str(Path(tmp) / f"kestrel-{part}-{size}.safetensors"))["out"]
                ref = load_file(str(Path(tmp) / f"hf-{part}-{size}.safetensors"))["out"]
                diff = float((ours - ref).abs().max() / ref.abs().max())
                hf_median = statistics.median(rows["hf"]["times"])
                for impl, label in (("kestrel", "kestrel eager"), ("hf", "transformers eager")):
                    row = rows[impl]
                    med = statistics.median(row["times"])
                    print(f"{part:8} {size:>5} {label:18} {med:9.4f} {min(row['times']):8.4f} "
                          f"{med / hf_median:6.2f} {row['peak_mb']:8.0f} "
                          f"{(f'{diff:.1e}' if impl == 'kestrel' else '-'):>9} {max(row['others']):7.0%}",
                          flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
