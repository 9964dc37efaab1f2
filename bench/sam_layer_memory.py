"""Peak memory of one SAM global-attention layer: Kestrel's sliced kernel against transformers.

The global layers are where the full relative-position bias (Heads x 4096 x 4096 floats, about 800 MB
for ViT-B at 1024 px) appears. Each implementation runs one layer at ViT-B width on the 64 x 64 grid
in a fresh process; printed: the high-water mark of resident memory above the resident memory just
before the call (Linux VmHWM after clear_refs), and the call's time.

  python bench/sam_layer_memory.py [--attn eager|sdpa] [--width 768 --heads 12]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import torch


def _mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _worker(impl: str, attn: str, width: int, heads: int) -> None:
    torch.manual_seed(0)
    if impl == "kestrel":
        from kestrel.models import sam

        layer = sam.VisionLayerGlobal(D=width, Heads=heads, Inner=4 * width, T="f32")
        for p in layer.parameters():
            p.data.normal_(0, 0.02)
    else:
        from transformers.models.sam.configuration_sam import SamVisionConfig
        from transformers.models.sam.modeling_sam import SamVisionLayer

        cfg = SamVisionConfig(hidden_size=width, num_attention_heads=heads, mlp_dim=4 * width)
        cfg._attn_implementation = attn
        layer = SamVisionLayer(cfg, window_size=0)
    layer.eval()
    x = torch.randn(1, 64, 64, width)
    with torch.no_grad():
        before = _mib("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")
        t0 = time.perf_counter()
        layer(x)
        dt = time.perf_counter() - t0
        peak = _mib("VmHWM")
    print(f"{impl:<13}{peak - before:>10.0f}{dt:>10.2f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--attn", default="eager", choices=["eager", "sdpa"], help="transformers' attention")
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        _worker(args.worker, args.attn, args.width, args.heads)
        return 0
    print(f"one global layer, D={args.width}, {args.heads} heads, 64 x 64 grid (transformers attn={args.attn})")
    print(f"{'impl':<13}{'peak MiB':>10}{'seconds':>10}")
    for impl in ("kestrel", "transformers"):
        subprocess.run([sys.executable, __file__, "--worker", impl, "--attn", args.attn, "--width", str(args.width),
                        "--heads", str(args.heads)], check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
