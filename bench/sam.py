"""SAM benchmark: Kestrel against transformers eager, side by side in one run, with peak memory.

Rows (one random-weight checkpoint built from the card's real config, saved with save_pretrained):
  encode 1024       the image encoder on one 1024 x 1024 input
  decode point      one point prompt on a cached embedding (single-mask output)
  decode box        one box prompt on a cached embedding
  everything NxN    segment everything on one image with an N x N point grid (Kestrel only, unless
                    --everything-reference: transformers' pipeline needs torchvision's NMS, given a
                    plain greedy one here)

Times are medians of interleaved runs in one process (Kestrel, transformers, Kestrel, ...), each after a
warm-up call (segment everything's on a 4 x 4 grid: one batch of points, so the first image's one-time
kernel calibration is not in the timed run, as it is not in the other rows); peak
memory is measured in a fresh process per row and implementation: the high-water mark of resident
memory over a first and a second call above the resident memory of the loaded model before any call
(Linux: VmHWM after clear_refs), so what an allocator keeps from one call to the next is counted.

  python bench/sam.py [--model sam-vit-base] [--repeat 3] [--points-per-side 32] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np
import torch

WARM_GRID = 4  # segment everything's warm-up: a 4 x 4 grid, one batch of 16 points


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _reset_peak() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _build(card_name: str, directory: Path) -> None:
    from transformers import SamConfig, SamModel

    from kestrel.models.cards import CARDS

    config = {k: v for k, v in CARDS[card_name].config.items() if k != "model_type"}
    torch.manual_seed(0)
    ref = SamModel(SamConfig(**config)).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, p[0].numel() ** -0.5)
            elif name.endswith(("rel_pos_h", "rel_pos_w", "pos_embed", "positional_embedding")):
                p.normal_(0, 0.5)
    ref.save_pretrained(directory)


def _photo() -> object:
    from PIL import Image

    rng = np.random.default_rng(0)
    img = (rng.random((768, 1024, 3)) * 255).astype(np.uint8)
    img[200:500, 300:700] = (200, 40, 40)
    return Image.fromarray(img)


def _fake_torchvision() -> None:
    from kestrel.pipelines.mask_generation import box_nms

    module = types.ModuleType("torchvision.ops.boxes")

    def batched_nms(boxes: torch.Tensor, scores: torch.Tensor, idxs: torch.Tensor,
                    iou_threshold: float) -> torch.Tensor:
        return torch.tensor(box_nms(boxes, scores, iou_threshold), dtype=torch.long)  # one class: idxs are all 0

    module.batched_nms = batched_nms  # type: ignore[attr-defined]
    sys.modules.update({"torchvision": types.ModuleType("torchvision"), "torchvision.ops": types.ModuleType("ops"),
                        "torchvision.ops.boxes": module})


def _tasks(impl: str, directory: Path, pps: int) -> dict[str, object]:
    """name -> zero-argument callable for one implementation."""
    x = torch.randn(1, 3, 1024, 1024)
    point = torch.tensor([[[[500.0, 375.0]]]])
    label = torch.tensor([[[1]]], dtype=torch.int32)
    box = torch.tensor([[[300.0, 200.0, 700.0, 500.0]]])
    # the decodes run on a drawn embedding, not an encode: a decode row's memory is the decoder's own
    emb = torch.randn(1, 256, 64, 64, generator=torch.Generator().manual_seed(1))
    if impl == "kestrel":
        import kestrel
        from kestrel.pipelines.mask_generation import generate_masks
        from kestrel.pipelines.segment import SamSegmenter

        model = kestrel.load(directory)
        seg = SamSegmenter(model)

        def decode_point():
            pts = torch.cat([point, point.new_zeros(1, 1, 1, 2)], 2)
            labs = torch.cat([label, label.new_full((1, 1, 1), -1)], 2)
            return model.decode(emb, model.embed_points(pts, labs), model.no_mask_embeddings(emb))

        tasks = {
            "encode 1024": lambda: model.encode_image(x),
            "decode point": decode_point,
            "decode box": lambda: model.decode(emb, model.embed_boxes(box), model.no_mask_embeddings(emb)),
            f"everything {pps}x{pps}": lambda n=pps: generate_masks(seg, _photo(), points_per_side=n),
        }
    else:
        from transformers import SamModel

        model = SamModel.from_pretrained(directory).eval()

        def everything(n: int = pps):
            from transformers import pipeline
            from transformers.models.sam import image_processing_pil_sam as ips

            _fake_torchvision()
            proc = ips.SamImageProcessorPil()
            proc.post_process_for_mask_generation = lambda *a: ips._post_process_for_mask_generation(*a)
            return pipeline("mask-generation", model=model, image_processor=proc, device="cpu")(
                _photo(), points_per_crop=n, points_per_batch=64)

        tasks = {
            "encode 1024": lambda: model.get_image_embeddings(x),
            "decode point": lambda: model(image_embeddings=emb, input_points=point, input_labels=label.long(),
                                          multimask_output=False),
            "decode box": lambda: model(image_embeddings=emb, input_boxes=box, multimask_output=False),
            f"everything {pps}x{pps}": everything,
        }
    return tasks


def _peak_child(impl: str, directory: str, task: str, pps: int, queue: mp.Queue) -> None:
    torch.set_num_threads(torch.get_num_threads())
    tasks = _tasks(impl, Path(directory), pps)
    with torch.no_grad():
        # from the loaded model (weights resident, nothing run yet) to the high-water mark of a cold
        # call and a warm one: memory an allocator keeps between calls counts, as the OS sees it
        before = _rss_kib("VmRSS")
        _reset_peak()
        for _ in range(1 if task.startswith("everything") else 2):
            tasks[task]()
        peak = _rss_kib("VmHWM")
    queue.put(max(0, peak - before) / 1024)


def peak_mib(impl: str, directory: Path, task: str, pps: int) -> float:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_peak_child, args=(impl, str(directory), task, pps, q))
    p.start()
    p.join()
    return q.get() if not q.empty() else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="sam-vit-base", help="a SAM card (its real config, random weights)")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs per implementation and row (median)")
    ap.add_argument("--points-per-side", type=int, default=32)
    ap.add_argument("--everything-reference", action="store_true", help="also time transformers' pipeline")
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory processes")
    ap.add_argument("--rows", default="encode,decode,everything",
                    help="comma list of the rows to run, by first word (default: all)")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()
    pps = args.points_per_side
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        _build(args.model, directory)
        impls = {"kestrel": _tasks("kestrel", directory, pps), "transformers": _tasks("transformers", directory, pps)}
        rows = []
        print(f"{args.model}, random weights, {torch.get_num_threads()} threads, torch {torch.__version__}")
        print(f"{'row':<18}{'kestrel s':>11}{'transf. s':>11}{'ratio':>8}{'kestrel MiB':>13}{'transf. MiB':>13}")
        for task in impls["kestrel"]:
            if task.split()[0] not in args.rows.split(","):
                continue
            names = ["kestrel"] if task.startswith("everything") and not args.everything_reference else list(impls)
            reps = 1 if task.startswith("everything") else args.repeat
            times: dict[str, list[float]] = {n: [] for n in names}
            with torch.no_grad():
                for n in names:  # warm-up; segment everything on a 4 x 4 grid: its first decode's shapes are calibrated
                    impls[n][task](*([WARM_GRID] if task.startswith("everything") else []))
                for _ in range(reps):
                    for n in names:  # interleaved
                        t0 = time.perf_counter()
                        impls[n][task]()
                        times[n].append(time.perf_counter() - t0)
            med = {n: statistics.median(v) for n, v in times.items()}
            mem = {} if args.no_memory else {n: peak_mib(n, directory, task, pps) for n in names}
            row = {"row": task, "seconds": med, "peak_mib": mem}
            rows.append(row)
            tk, tt = med.get("kestrel"), med.get("transformers")
            ratio = f"{tk / tt:.2f}" if tk and tt else "-"
            mk, mt = mem.get("kestrel"), mem.get("transformers")
            print(f"{task:<18}{tk:>11.3f}{(f'{tt:.3f}' if tt else '-'):>11}{ratio:>8}"
                  f"{(f'{mk:.0f}' if mk is not None else '-'):>13}{(f'{mt:.0f}' if mt is not None else '-'):>13}",
                  flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
