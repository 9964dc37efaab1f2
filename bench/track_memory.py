"""Peak memory of Kestrel's streaming tracker over a long synthetic clip (issue 23, item 4).

A small random-weight SAM 2.1 video model (the test suite's config), one object prompted on frame 0,
another on a later frame; prints the bank size and the process's resident memory every ``--every``
frames. The bank (and RSS) must stay flat however long the clip.

    python bench/track_memory.py --frames 1000
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
from pathlib import Path

import torch


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frames", type=int, default=1000)
    ap.add_argument("--every", type=int, default=100)
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import kestrel
    from kestrel.pipelines.video_tracker import TrackPrompt, VideoTracker
    from test_sam2_video import seeded_video, synthetic_frames, video_config

    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as d:
        seeded_video(video_config(), object_bias=1.0).save_pretrained(d)
        model = kestrel.load(d)
    frames = synthetic_frames(8)
    prompts = {0: [TrackPrompt(0, 1, points=((20.0, 30.0),), labels=(1,))],
               10: [TrackPrompt(10, 2, box=(55.0, 35.0, 85.0, 65.0))]}
    tracker = VideoTracker(model, args.frames)
    peak = 0.0
    for f in range(args.frames):
        tracker.step(f, frames[f % len(frames)], prompts.get(f, []), reverse=False)
        peak = max(peak, rss_mib())
        if (f + 1) % args.every == 0:
            print(f"frame {f + 1:5d}  bank {tracker.bank_size():3d} frames  rss {rss_mib():7.1f} MiB  "
                  f"peak {peak:7.1f} MiB", flush=True)
    print(f"ru_maxrss {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.1f} MiB")


if __name__ == "__main__":
    main()
