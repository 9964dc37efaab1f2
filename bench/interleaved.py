"""Kestrel beside transformers and onnxruntime in one process, call by call: ratios the machine's drift
cannot skew.

``bench/run.py`` gives every row its own process, which keeps each row's memory its own, but on a
virtual machine whose speed drifts between minutes two rows measured minutes apart can differ by
30-40% for reasons that are not theirs. Here one process per model and batch loads all three:

    kestrel   Kestrel eager (``kestrel.load(dir).<entry>``, its GEMM shapes calibrated first)
    hf        transformers eager, the same checkpoint (random weights from the real config, seed 0)
    onnx      onnxruntime on Kestrel's ONNX export (dynamic batch), what a race of
              ``kestrel doctor --onnxruntime`` would choose where it is faster
    int8      with ``--int8``: Kestrel eager loaded with ``quantize="int8"`` (its int8 races run first), for
              int8's speed-up over f32 measured call by call, not across processes
    bf16      with ``--bf16``: Kestrel eager loaded with ``dtype="bf16"`` (its bf16 GEMM shapes calibrated
              first), for bf16's speed-up over f32 in the same way

Each round runs every path in turn (the order rotates every round), each after 0.1 s idle (``--settle``) and
twice in a row with the second call timed: a runtime's threads spin for a while after a call (onnxruntime's
for ~50 ms) and slow whatever runs meanwhile. The medians of the timed calls are compared. No memory figures:
the paths share a process.

    python bench/interleaved.py --models vit,dinov2,siglip,siglip-text,sam-decode --rounds 7 --out r.json
    python bench/interleaved.py --models sam-decode --int8 --rounds 9
    python bench/interleaved.py --models vit,dinov2 --batch 8 --bf16 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kestrel.runtime.race import SETTLE_S  # idle before each path: onnxruntime's threads spin after a run

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import REGISTRY, OtherLoad, bf16_inputs, cpu_name, export_job, physical_cores, save_checkpoint

MODELS = "vit,dinov2,siglip,siglip-text,sam-decode"  # the rows of run.py --quick


def _paths(spec: Any, cfg: Any, ckpt: Path, image: int, batch: int, onnx_path: str,
           threads: int, int8: bool, bf16: bool) -> dict[str, Callable[[], Any]]:
    import onnxruntime as ort

    import kestrel
    from kestrel.kernels import calibration

    inputs = spec.inputs(cfg, image, batch)

    def eager(**options: Any) -> Callable[[], Any]:
        model = kestrel.load(ckpt, **spec.load_kwargs(cfg, image), **options)
        entry = getattr(type(model), spec.entry).__get__(model)  # eager, whatever a race recorded
        args = inputs
        if options.get("dtype") == "bf16":  # a bf16 model takes bf16 images (the cast is the caller's, untimed)
            args = bf16_inputs(inputs)
        with torch.no_grad():
            calibration.calibrate_model(lambda: entry(*args))
        return lambda: entry(*args)

    paths = {"kestrel": eager()}
    reference = spec.reference_class().from_pretrained(ckpt).eval()
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    session = ort.InferenceSession(onnx_path, opts, providers=["CPUExecutionProvider"])
    feeds = dict(zip([i.name for i in session.get_inputs()], (x.numpy() for x in inputs)))
    paths |= {"hf": lambda: spec.reference_output(reference, inputs), "onnx": lambda: session.run(None, feeds)}
    if int8:
        paths["int8"] = eager(quantize="int8")
    if bf16:
        paths["bf16"] = eager(dtype="bf16")
    return paths


def measure(paths: dict[str, Callable[[], Any]], rounds: int, settle_s: float = SETTLE_S) -> dict[str, list[float]]:
    """Timed calls per path: every round runs each path twice in a row, the second timed, after ``settle_s``
    of idle time in which the previous path's threads stop spinning."""
    names = list(paths)
    times: dict[str, list[float]] = {n: [] for n in names}
    with torch.inference_mode():
        for fn in paths.values():
            fn()  # warm-up
        for r in range(rounds):
            shift = r % len(names)
            for name in names[shift:] + names[:shift]:
                time.sleep(settle_s)
                paths[name]()
                t = time.perf_counter()
                paths[name]()
                times[name].append(time.perf_counter() - t)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--models", default=MODELS, help=f"comma-separated rows of bench/run.py (default {MODELS})")
    parser.add_argument("--batch", default="1,8", help="comma-separated batches (default 1,8)")
    parser.add_argument("--rounds", type=int, default=7, help="timed calls per path (default 7)")
    parser.add_argument("--threads", type=int, default=physical_cores(), help="default: the physical cores")
    parser.add_argument("--int8", action="store_true",
                        help="also time Kestrel with quantize='int8' (its speed-up over f32)")
    parser.add_argument("--bf16", action="store_true",
                        help="also time Kestrel with dtype='bf16' (its speed-up over f32)")
    parser.add_argument("--settle", type=float, default=SETTLE_S,
                        help=f"idle seconds before each path's calls, for the last one's threads to stop spinning "
                             f"(default {SETTLE_S})")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batch.split(",")]
    unknown = [m for m in args.models.split(",") if m not in REGISTRY]
    if unknown:
        parser.error(f"unknown row(s) {', '.join(unknown)}: choose from {', '.join(REGISTRY)}")
    results: dict[str, Any] = {"kind": "interleaved", "machine": {"cpu": cpu_name(), "threads": args.threads},
                               "versions": {"torch": torch.__version__}, "rounds": args.rounds,
                               "settle_s": args.settle, "rows": []}
    print(f"{cpu_name()}, {args.threads} threads; median of {args.rounds} timed calls per path, interleaved")
    print(f"{'row':<18} {'batch':>5} {'kestrel s':>10} {'hf s':>9} {'onnx s':>9} {'K / HF':>7} {'K / ORT':>8} "
          f"{'others':>7}" + (f" {'int8 s':>9} {'f32 / int8':>10}" if args.int8 else "")
          + (f" {'bf16 s':>9} {'f32 / bf16':>10}" if args.bf16 else ""))
    with tempfile.TemporaryDirectory(prefix="kestrel-interleaved-") as tmp:
        for m in args.models.split(","):
            spec = REGISTRY[m]
            ckpt = Path(tmp) / m
            cfg, _ = save_checkpoint(spec, "full", ckpt)
            images = spec.images("full")
            for image in images:
                big = len(images) > 1 and image == max(images)  # as run.py --quick: the large image at batch 1
                job = {"model": m, "size": "full", "image": image, "checkpoint": str(ckpt), "threads": args.threads,
                       "out": str(Path(tmp) / f"onnx-{m}-{image}")}
                onnx_path = export_job(job)["onnx"]
                for b in ([min(batches)] if big else batches):
                    if b > spec.max_batch:
                        continue
                    paths = _paths(spec, cfg, ckpt, image, b, onnx_path, args.threads, args.int8, args.bf16)
                    with OtherLoad() as load:
                        times = measure(paths, args.rounds, args.settle)
                    med = {n: statistics.median(t) for n, t in times.items()}
                    row = {"model": m, "image": image, "batch": b, "median": med, "times": times,
                           "other_load": load.share}
                    results["rows"].append(row)
                    others = "?" if load.share is None else f"{100 * load.share:.0f}%"
                    fast = "".join(f" {med[p]:>9.4f} {med['kestrel'] / med[p]:>9.2f}x" for p in ("int8", "bf16")
                                   if p in med)
                    print(f"{m + '@' + str(image):<18} {b:>5} {med['kestrel']:>10.4f} {med['hf']:>9.4f} "
                          f"{med['onnx']:>9.4f} {med['kestrel'] / med['hf']:>6.2f}x "
                          f"{med['kestrel'] / med['onnx']:>7.2f}x {others:>7}{fast}", flush=True)
                    del paths
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
