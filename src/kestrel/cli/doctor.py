"""``kestrel doctor`` (this machine, its GEMM rates and the kernel choices) and ``kestrel bench MODEL``."""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from .options import (
    Command,
    IntList,
    ModelRef,
    Option,
    PositiveInt,
    Text,
    Threads,
    register,
    weights_option,
)

DOCTOR_EPILOG = """examples:
  kestrel doctor                          machine, libraries, f32 GEMM rate of every kernel at 1..cores threads
  kestrel doctor --model DIR --batch 8    also calibrate every GEMM shape that model uses at batch 8
  kestrel doctor --reset                  forget every cached choice (they are measured again at next use)
"""

BENCH_EPILOG = """examples:
  kestrel bench DIR                       time the first entry at batch 1 and 8 (a save_pretrained directory)
  kestrel bench vit-base-patch16-224 --weights DIR --entry features --batch 1 --repeat 10
  kestrel bench DIR --threads 1 --compile compare eager and torch.compile on one thread
FLOPs are counted by torch's FlopCounterMode on one call (matmuls, convolutions, attention).
"""


def physical_cores() -> int:
    """Cores, not hardware threads, among the CPUs this process may use."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    seen = set()
    for c in cpus:
        base = Path(f"/sys/devices/system/cpu/cpu{c}/topology")
        try:
            seen.add((base.joinpath("physical_package_id").read_text().strip(),
                      base.joinpath("core_id").read_text().strip()))
        except OSError:
            seen.add(("?", str(c)))
    return max(1, len(seen))


def others_load(fn: Any) -> tuple[Any, float | None]:
    """Run fn; return its result and the share of the machine's CPU time other processes used meanwhile."""
    def sample() -> tuple[float, float] | None:
        try:
            fields = [float(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        except (OSError, ValueError):
            return None
        return sum(fields) - fields[3] - (fields[4] if len(fields) > 4 else 0), sum(fields)

    before, own0 = sample(), time.process_time()
    out = fn()
    after, own1 = sample(), time.process_time()
    if before is None or after is None or after[1] <= before[1]:
        return out, None
    tick = os.sysconf("SC_CLK_TCK")
    busy = (after[0] - before[0]) / tick - (own1 - own0)
    total = (after[1] - before[1]) / tick
    return out, max(0.0, min(1.0, busy / total))


def gemm_rates(n: int = 1024, rounds: int = 5) -> dict[str, float]:
    """Best f32 GFLOP/s of every installed kernel on one square problem, interleaved."""
    from ..kernels import gemm as kernels

    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g), torch.randn(n, generator=g)
    res = kernels.measure(x, w, b, budget_s=0.05 * rounds)
    return res["gflops"]


def reduced_precision_rates(n: int = 1024, rounds: int = 4) -> dict[str, float]:
    """Best GFLOP/s of f32, bf16 and f16 ``F.linear`` on one square problem, interleaved (what ``--dtype`` gets)."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    base = [torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)]
    cases = {name: [t.to(dt) for t in base] for name, dt in (("f32", torch.float32), ("bf16", torch.bfloat16),
                                                                ("f16", torch.float16))}
    best = dict.fromkeys(cases, float("inf"))
    for x, w in cases.values():
        F.linear(x, w)
    for _ in range(rounds):
        for name, (x, w) in cases.items():
            t = time.perf_counter()
            F.linear(x, w)
            best[name] = min(best[name], time.perf_counter() - t)
    return {name: 2 * n ** 3 / t / 1e9 for name, t in best.items()}


def cmd_doctor(args: argparse.Namespace) -> int:
    from ..kernels import calibration as calibrate
    from ..kernels import gemm as kernels
    from ..kernels import library, settings

    if args.reset:
        gone = calibrate.reset()
        print(f"removed {len(gone)} cached calibration file(s) from {calibrate.cache_dir()}")
        return 0
    cores = physical_cores()
    print(f"machine: {calibrate.cpu_model()} ({os.cpu_count()} logical CPUs, {cores} physical cores)")
    print(f"  instruction sets: {' '.join(calibrate.cpu_flags()) or '?'}")
    print(f"libraries: torch {torch.__version__}, oneDNN {library.onednn_version()}, MKL {library.mkl_version()}; "
          f"kernels: " + ", ".join(f"{k.name} ({k.library})" for k in kernels.KERNELS.values()))
    print(f"calibration cache: {calibrate.cache_dir()}"
          + ("" if settings.calibrate() else " (KESTREL_CALIBRATE=0: off)")
          + (f"; KESTREL_LINEAR={kernels.forced()} forces one kernel" if kernels.forced() else ""))
    was = torch.set_flush_denormal(True)  # True: supported (then put back: it is process-wide FP state)
    torch.set_flush_denormal(False)
    print(f"flush denormals: {'supported' if was else 'not supported by this CPU'}; off unless you call "
          "torch.set_flush_denormal(True) (process-wide: it changes every float op, not only Kestrel's)")
    counts = [args.threads] if args.threads else sorted({1, cores})
    before = torch.get_num_threads()
    print(f"\nf32 GEMM {args.size} x {args.size} x {args.size}, best of interleaved calls (GFLOP/s):")
    best_at: dict[int, float] = {}
    for t in counts:
        torch.set_num_threads(t)
        rates, other = others_load(lambda: gemm_rates(args.size))
        best_at[t] = max(rates.values())
        cells = "  ".join(f"{k} {v:.1f}" for k, v in rates.items())
        print(f"  {t} thread(s): {cells}   (others used {_pct(other)} of the CPUs meanwhile)")
    torch.set_num_threads(args.threads or before)
    rp = reduced_precision_rates(min(args.size, 1024))
    faster = [k for k in ("bf16", "f16") if rp[k] > rp["f32"] * 1.1]
    rates = ", ".join(f"{k} {v:.1f}" for k, v in rp.items())
    print(f"  reduced precision at {torch.get_num_threads()} thread(s): {rates}"
          + (f": {' and '.join(faster)} faster than f32 here (--dtype {faster[0]} pays)" if faster
             else ": no faster than f32 here; keep the f32 default"))
    try:
        _report(args, best_at)
    finally:
        torch.set_num_threads(before)
    return 0


def _report(args: argparse.Namespace, best_at: dict[int, float]) -> None:
    from ..kernels import calibration as calibrate

    if len(best_at) > 1:
        pick = max(best_at, key=lambda t: best_at[t])
        print(f"  best at {pick} thread(s); Kestrel uses torch's thread count ({torch.get_num_threads()} now); "
              "set it with torch.set_num_threads or --threads")
    if args.model:
        _calibrate_model(args)
    else:
        _print_cached(calibrate)


def _pct(x: float | None) -> str:
    return "?" if x is None else f"{100 * x:.0f}%"


def _print_cached(calibrate: Any) -> None:
    t = calibrate.table()
    print(f"\ncached choices at {torch.get_num_threads()} thread(s) ({t.path}):")
    if not t.shapes:
        print("  none yet: shapes are measured the first time a model runs them (or: kestrel doctor --model DIR)")
        return
    print("\n".join(calibrate.format_choices(sorted(t.shapes.items()))))


def _load(args: argparse.Namespace) -> Any:
    import kestrel

    kw: dict[str, Any] = {"weights": args.weights} if getattr(args, "weights", None) else {}
    return kestrel.load(args.model, **kw)


def _entry(model: Any, name: str | None) -> str:
    from ..blocks import EntryError
    from ..runtime.examples import entry_names

    names = entry_names(model)
    if name is None:
        return names[0]
    if name not in names:
        raise EntryError(f"{model.loaded.name} has no entry {name!r}; entries: {', '.join(names)}")
    return name


def _calibrate_model(args: argparse.Namespace) -> None:
    from ..kernels import calibration as calibrate
    from ..runtime.examples import example_inputs

    model = _load(args)
    entry = _entry(model, args.entry)
    inputs = example_inputs(model, entry, args.batch)
    t = time.perf_counter()
    rows = calibrate.calibrate_model(lambda: getattr(model, entry)(*inputs))
    print(f"\n{model.loaded.name}.{entry} at batch {args.batch}, {torch.get_num_threads()} thread(s): "
          f"{len(rows)} GEMM shapes ({time.perf_counter() - t:.1f} s, measuring included)")
    print("\n".join(calibrate.format_choices(rows)))


def _flops(call: Any) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter, torch.inference_mode():
        call()
    return int(counter.get_total_flops())


def cmd_bench(args: argparse.Namespace) -> int:
    from ..kernels import calibration as calibrate

    if args.threads:
        torch.set_num_threads(args.threads)
    model = _load(args)
    entry = _entry(model, args.entry)
    batches = list(args.batch)
    print(f"{model.loaded.name}.{entry}: {calibrate.cpu_model()}, {torch.get_num_threads()} thread(s), "
          f"torch {torch.__version__}, f32")
    peak = max(gemm_rates(1024).values())
    print(f"best f32 GEMM rate measured now (1024^3, any kernel): {peak:.1f} GFLOP/s")
    variants: list[tuple[str, Any]] = [("eager", getattr(model, entry))]
    if args.compile:
        variants.append(("compile", torch.compile(getattr(model, entry), dynamic=False)))
    print(f"\n{'variant':<8} {'batch':>5} {'median s':>9} {'min s':>8} {'GFLOP/s':>8} {'% peak':>7} {'others':>7}")
    for b in batches:
        _bench_batch(args, model, entry, variants, b, peak)
    return 0


def _bench_batch(args: argparse.Namespace, model: Any, entry: str, variants: list[tuple[str, Any]], b: int,
                 peak: float) -> None:
    from ..kernels import calibration as calibrate
    from ..runtime.examples import example_inputs

    inputs = example_inputs(model, entry, b)
    rows = calibrate.calibrate_model(lambda: getattr(model, entry)(*inputs))
    flops = _flops(lambda: variants[0][1](*inputs))
    times: dict[str, list[float]] = {name: [] for name, _ in variants}
    with torch.inference_mode():
        for _, fn in variants:
            fn(*inputs)  # warm-up (and compile)

        def timed() -> None:
            for _ in range(args.repeat):
                for name, fn in variants:  # interleaved: every variant sees the same load
                    t = time.perf_counter()
                    fn(*inputs)
                    times[name].append(time.perf_counter() - t)

        _, other = others_load(timed)
    for name, ts in times.items():
        med = statistics.median(ts)
        rate = flops / med / 1e9
        print(f"{name:<8} {b:>5} {med:>9.4f} {min(ts):>8.4f} {rate:>8.1f} {100 * rate / peak:>6.0f}% "
              f"{_pct(other):>7}")
    if args.verbose:
        print("\n".join(calibrate.format_choices(rows)))


register(Command(
    "doctor", run=cmd_doctor, help="this machine: GEMM rates, the kernel chosen per shape, and why", raw=True,
    description="Measure this machine's f32 GEMM rate with every installed kernel at 1 and all "
                "cores' threads, and print the cached per-shape kernel choices (measured at a "
                "shape's first use, cached per CPU model, threads and library versions).",
    epilog=DOCTOR_EPILOG,
    options=[
        Option("--model", ModelRef(), help="a card name or save_pretrained directory: calibrate every shape it uses"),
        weights_option(help="local directory of the card's files"),
        Option("--entry", Text(what="entry name", metavar="ENTRY"),
               help="the entry to run (default: the model's first)"),
        Option("--batch", PositiveInt(4096), default=1, help="batch for --model, 1 to 4096 (default 1)"),
        Option("--threads", Threads(), help="measure at this thread count only (default: 1 and all cores)"),
        Option("--size", PositiveInt(8192, what="a GEMM size"), default=1024,
               help="square GEMM size for the rates, 1 to 8192 (default 1024)"),
        Option("--reset", help="delete the cached choices and stop"),
    ]))

register(Command(
    "bench", run=cmd_bench, help="time a model's entry on this machine (eager, optionally compiled)", raw=True,
    description="Time one entry of a model on seeded example inputs at each batch, after "
                "calibrating its GEMM shapes; prints median and min seconds, GFLOP/s (FLOPs "
                "counted by torch) and the share of the best GEMM rate measured in the same run.",
    epilog=BENCH_EPILOG,
    options=[
        Option("model", ModelRef(metavar="MODEL"), help="a card name or a save_pretrained directory"),
        weights_option(help="local directory of the card's files"),
        Option("--entry", Text(what="entry name", metavar="ENTRY"),
               help="the entry to time (default: the model's first)"),
        Option("--batch", IntList(1, 4096), default=[1, 8], help="comma list of batch sizes, each 1 to 4096 "
                                                                "(default 1,8)"),
        Option("--repeat", PositiveInt(100_000), default=5, help="timed calls per variant and batch (default 5)"),
        Option("--threads", Threads(), help="torch threads (default: torch's)"),
        Option("--compile", help="also time torch.compile of the entry, interleaved"),
        Option("-v --verbose", help="print the kernel chosen for every GEMM shape"),
    ]))
