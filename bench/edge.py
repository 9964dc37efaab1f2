#!/usr/bin/env python
"""SAM 2.1's edge programs on this CPU: portable .pte, XNNPACK .pte, onnxruntime and Kestrel eager.

The script exports the encoder/decoder split (``kestrel.export.edge``, validation skipped) for the
portable, XNNPACK and ONNX targets from one SAM 2.1 checkpoint directory at ``--size`` (512 by
default), unless ``--work`` already holds them, then times each program on the same inputs
(the photo-like image, one composed point prompt), interleaved round by round so that a busy
machine slows every runner alike:

    median s   median wall time over --repeat rounds (after one warm-up call each)
    x eager    median / Kestrel eager's median for the same program (< 1: faster than eager)

Threads: torch and onnxruntime use --threads (default: the physical cores); ExecuTorch's portable
kernels are single-threaded, XNNPACK uses its own thread pool.

Without ``--model`` a random-weight checkpoint is built from the real Hiera-tiny config
(transformers ``Sam2Config`` defaults), saved with ``save_pretrained``, and used.

Examples:
    python bench/edge.py                                  # Hiera-tiny at 512, random weights
    python bench/edge.py --model ./sam2-dir --repeat 5 --work /tmp/edge
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import kestrel  # noqa: E402
from kestrel.export import edge_sam2  # noqa: E402
from kestrel.export.edge import SUFFIX, export_edge  # noqa: E402
from kestrel.export.validation import onnx_runner, pte_runner  # noqa: E402


def physical_cores() -> int:
    try:
        ids = {line.split(":")[1].strip() for line in open("/proc/cpuinfo") if line.startswith("core id")}
        return max(1, len(ids))
    except OSError:
        return os.cpu_count() or 1


def tiny_checkpoint(directory: Path) -> Path:
    from transformers import Sam2Config, Sam2Model

    torch.manual_seed(0)
    Sam2Model(Sam2Config()).eval().save_pretrained(directory)
    return directory


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="SAM 2.1 save_pretrained directory (default: random Hiera-tiny)")
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=physical_cores())
    ap.add_argument("--work", help="where the exported programs are (or go); default: a temporary folder")
    ap.add_argument("--targets", default="executorch-portable,executorch-xnnpack,onnx")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    work = Path(args.work or tempfile.mkdtemp(prefix="kestrel-edge-bench-"))
    model_dir = Path(args.model) if args.model else tiny_checkpoint(work / "checkpoint")
    model = kestrel.load(model_dir, E=args.size // 16)

    runners: dict[str, dict[str, object]] = {}
    targets = [t for t in args.targets.split(",") if t]
    for target in targets:
        out = work / target
        backend = {"executorch-portable": "portable", "executorch-xnnpack": "xnnpack", "onnx": "onnx"}[target]
        files = {stem: out / f"{stem}{SUFFIX[backend]}" for stem in ("sam2_encoder", "sam2_decoder")}
        if not all(p.exists() for p in files.values()):
            t0 = time.perf_counter()
            export_edge(model, out, target, validate=False, progress=lambda m: print(m, file=sys.stderr))
            print(f"# exported {target} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        if backend == "onnx":
            runners[target] = {
                "sam2_encoder": onnx_runner(files["sam2_encoder"], ["pixels"], args.threads),
                "sam2_decoder": onnx_runner(files["sam2_decoder"], ["image_embeddings", "image_pe", "sparse", "dense",
                                                                   "hr0", "hr1"], args.threads)}
        else:
            runners[target] = {stem: pte_runner(p) for stem, p in files.items()}

    recipe = edge_sam2.Sam2Recipe(model)
    enc, dec = recipe.programs()
    runners["kestrel eager"] = {"sam2_encoder": lambda xs: enc.module(*xs), "sam2_decoder": lambda xs: dec.module(*xs)}
    inputs = {"sam2_encoder": enc.examples, "sam2_decoder": dec.examples}
    times: dict[tuple[str, str], list[float]] = {}
    with torch.no_grad():
        for progs in runners.values():  # warm-up
            for stem, run in progs.items():
                run(inputs[stem])  # type: ignore[operator]
        for _ in range(args.repeat):
            for name, progs in runners.items():
                for stem, run in progs.items():
                    t0 = time.perf_counter()
                    run(inputs[stem])  # type: ignore[operator]
                    times.setdefault((name, stem), []).append(time.perf_counter() - t0)

    print(f"SAM 2.1 edge programs at {args.size} px, {args.threads} threads, {args.repeat} rounds, "
          f"torch {torch.__version__}, {model_dir}")
    print(f"{'runner':24} {'program':14} {'median s':>9} {'min s':>8} {'x eager':>8}")
    for stem in ("sam2_encoder", "sam2_decoder"):
        base = statistics.median(times[("kestrel eager", stem)])
        for name in runners:
            t = times[(name, stem)]
            print(f"{name:24} {stem:14} {statistics.median(t):9.4f} {min(t):8.4f} {statistics.median(t) / base:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
