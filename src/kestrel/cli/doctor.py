"""``kestrel doctor`` (this machine, its GEMM rates and the kernel choices) and ``kestrel bench MODEL``."""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import UsageError
from ..kernels.contention import others_share
from .options import Choice, Command, IntList, ModelRef, Option, PositiveInt, Text, Threads, register, weights_option

DOCTOR_EPILOG = """examples:
  kestrel doctor                          machine, libraries, f32 GEMM rate of every kernel at 1..cores threads
  kestrel doctor --model DIR --batch 8    also calibrate every GEMM shape that model uses at batch 8
  kestrel doctor --model DIR --onnxruntime   and race the entry against its onnxruntime export (kept if faster)
  kestrel doctor --reset                  forget every cached choice (they are measured again at next use)
"""

BENCH_EPILOG = """examples:
  kestrel bench DIR                       time the first entry at batch 1 and 8 (a save_pretrained directory)
  kestrel bench vit-base-patch16-224 --weights DIR --entry features --batch 1 --repeat 10
  kestrel bench DIR --threads 1 --compile compare eager and torch.compile on one thread
  kestrel bench DIR --dtype bf16 --accuracy   bf16 beside f32 (speed-up), then what bf16 costs in accuracy
  kestrel bench DIR --quantize int8 --accuracy --batch 1,8
FLOPs are counted by torch's FlopCounterMode on one call (matmuls, convolutions, attention).
With --dtype or --quantize the fast path is timed interleaved with f32 on the same inputs ("speed-up" is
f32's median over its own); --accuracy then compares it with f32 as the family's users see the output: feature cosine,
top-1/top-5 agreement (classifiers), zero-shot ranking agreement (image-text models), mask IoU after
post-processing (segmenters). Where bf16 is slower than f32 (no native bf16, or bf16 GEMMs measured
slower, as on a Xeon with avx512_bf16 but no AMX) a warning says so.
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


def gemm_rates(n: int = 1024, rounds: int = 5) -> dict[str, float]:
    """Best f32 GFLOP/s of every installed kernel on one square problem, interleaved."""
    from ..kernels import gemm as kernels

    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g), torch.randn(n, generator=g)
    res = kernels.measure(x, w, b, budget_s=0.05 * rounds)
    return res["gflops"]


def cmd_doctor(args: argparse.Namespace) -> int:
    """this machine: GEMM rates, the kernel chosen per shape, and why

    Measure this machine's f32 GEMM rate with every installed kernel at 1 and all cores' threads, and
    print the cached per-shape kernel choices (measured at a shape's first use, cached per CPU model,
    threads and library versions).
    """
    from ..kernels import calibration as calibrate
    from ..kernels import gemm as kernels
    from ..kernels import half, library, settings

    if args.reset:
        from ..runtime.onnxruntime_entries import remove_programs

        gone = calibrate.reset()
        print(f"removed {len(gone)} cached calibration file(s) from {calibrate.cache_dir()}")
        programs = remove_programs()
        if programs:
            print(f"removed {len(programs)} cached onnxruntime program(s) from {settings.cache_dir('onnxruntime')}")
        return 0
    if args.onnxruntime and not args.model:
        raise UsageError("--onnxruntime races a model's entry: give the model with --model NAME|DIR")
    # the model and its entry first: a name that resolves to nothing fails before a minute of measuring
    model = _load(args) if args.model else None
    entry = _entry(model, args.entry) if model is not None else None
    cores = physical_cores()
    print(f"machine: {calibrate.cpu_model()} ({os.cpu_count()} logical CPUs, {cores} physical cores)")
    print(f"  instruction sets: {' '.join(calibrate.cpu_flags()) or '?'}")
    print(f"libraries: torch {torch.__version__}, oneDNN {library.onednn_version()}, MKL {library.mkl_version()}; "
          f"kernels: " + ", ".join(f"{k.name} ({k.library})" for k in kernels.KERNELS.values()))
    if kernels.int8_available():  # --quantize int8 races these per shape
        print("int8 kernels: " + ", ".join(f"{name} (quantized engine {engine})"
                                           for name, engine in kernels.INT8_KERNELS.items()))
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
        rates, other = others_share(lambda: gemm_rates(args.size))
        best_at[t] = max(rates.values())
        cells = "  ".join(f"{k} {v:.1f}" for k, v in rates.items())
        print(f"  {t} thread(s): {cells}   (others used {_pct(other)} of the CPUs meanwhile)")
    torch.set_num_threads(args.threads or before)
    rp = half.dtype_rates(n=min(args.size, half.PROBE))
    faster = [k for k in ("bf16", "f16") if rp[k] > rp["f32"] * 1.1]
    rates = ", ".join(f"{k} {v:.1f}" for k, v in rp.items())
    print(f"  reduced precision at {torch.get_num_threads()} thread(s): {rates}"
          + (f": {' and '.join(faster)} faster than f32 here (--dtype {faster[0]} pays)" if faster
             else ": no faster than f32 here; keep the f32 default"))
    try:
        _report(args, best_at, model, entry)
    finally:
        torch.set_num_threads(before)
    return 0


def _report(args: argparse.Namespace, best_at: dict[int, float], model: Any, entry: str | None) -> None:
    from ..kernels import calibration as calibrate

    if len(best_at) > 1:
        pick = max(best_at, key=lambda t: best_at[t])
        print(f"  best at {pick} thread(s); Kestrel uses torch's thread count ({torch.get_num_threads()} now); "
              "set it with torch.set_num_threads or --threads")
    if model is not None and entry is not None:
        _calibrate_model(args, model, entry)
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


def _load(args: argparse.Namespace, **options: Any) -> Any:
    import kestrel

    kw: dict[str, Any] = {"weights": args.weights} if getattr(args, "weights", None) else {}
    return kestrel.load(args.model, **kw, **options)


def _fast_path(args: argparse.Namespace) -> tuple[str, dict[str, Any]] | None:
    """The reduced-precision path asked for (``--dtype``, ``--quantize``) as a label and ``kestrel.load``'s
    keywords; None for plain f32."""
    kw: dict[str, Any] = {}
    if getattr(args, "dtype", "f32") != "f32":
        kw["dtype"] = args.dtype
    if getattr(args, "quantize", None):
        kw["quantize"] = args.quantize
    return ("+".join(str(v) for v in kw.values()), kw) if kw else None


def _entry(model: Any, name: str | None) -> str:
    from ..blocks import EntryError
    from ..runtime.examples import entry_names

    names = entry_names(model)
    if name is None:
        return names[0]
    if name not in names:
        raise EntryError(f"{model.loaded.name} has no entry {name!r}; entries: {', '.join(names)}")
    return name


def _calibrate_model(args: argparse.Namespace, model: Any, entry: str) -> None:
    from ..kernels import calibration as calibrate
    from ..runtime.examples import example_inputs

    inputs = example_inputs(model, entry, args.batch)
    t = time.perf_counter()
    rows = calibrate.calibrate_model(lambda: getattr(model, entry)(*inputs))
    print(f"\n{model.loaded.name}.{entry} at batch {args.batch}, {torch.get_num_threads()} thread(s): "
          f"{len(rows)} kernel choices: GEMM shapes and attention problems ({time.perf_counter() - t:.1f} s, "
          "measuring included)")
    print("\n".join(calibrate.format_choices(rows)))
    if args.onnxruntime:
        _race_onnxruntime(model, entry, inputs)


def _race_onnxruntime(model: Any, entry: str, inputs: tuple[torch.Tensor, ...]) -> None:
    from ..export.onnxruntime_race import format_result, race_entry
    from ..runtime.race import call_signature

    t = time.perf_counter()
    result = race_entry(model, entry, inputs, progress=lambda msg: print(f"  {msg}", flush=True))
    print(f"\n{model.loaded.name}.{entry} eager against its onnxruntime export ({time.perf_counter() - t:.1f} s, "
          "export included; recorded for this machine, KESTREL_ONNXRUNTIME=0 ignores it):")
    print(format_result(entry, call_signature(inputs, {}), result))


def _flops(call: Any) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter, torch.inference_mode():
        call()
    return int(counter.get_total_flops())


def cmd_bench(args: argparse.Namespace) -> int:
    """time a model's entry on this machine (eager, optionally compiled)

    Time one entry of a model on seeded example inputs at each batch, after calibrating its GEMM shapes;
    prints median and min seconds, GFLOP/s (FLOPs counted by torch) and the share of the best GEMM rate
    measured in the same run.
    """
    from ..kernels import calibration as calibrate

    if args.threads:
        torch.set_num_threads(args.threads)
    fast = _fast_path(args)
    if args.accuracy and fast is None:
        raise UsageError("--accuracy compares a fast path with f32: give --dtype bf16|f16 or --quantize int8")
    model = _load(args)
    entry = _entry(model, args.entry)
    batches = list(args.batch)
    print(f"{model.loaded.name}.{entry}: {calibrate.cpu_model()}, {torch.get_num_threads()} thread(s), "
          f"torch {torch.__version__}, f32" + (f" and {fast[0]}" if fast else ""))
    peak = max(gemm_rates(1024).values())
    print(f"best f32 GEMM rate measured now (1024^3, any kernel): {peak:.1f} GFLOP/s")
    variants: list[Variant] = [Variant("f32" if fast else "eager", model, getattr(model, entry))]
    if fast:
        fast_model = _load(args, **fast[1])
        variants.append(Variant(fast[0], fast_model, getattr(fast_model, entry)))
    if args.compile:
        variants.append(Variant("compile", model, torch.compile(getattr(model, entry), dynamic=False)))
    print(f"\n{'variant':<9} {'batch':>5} {'median s':>9} {'min s':>8} {'GFLOP/s':>8} {'% peak':>7} "
          f"{'speed-up':>8} {'others':>7}")
    for b in batches:
        _bench_batch(args, entry, variants, b, peak)
    if args.accuracy:
        _print_accuracy(model, variants[1], max(batches))
    return 0


@dataclass
class Variant:
    """One way of running the entry: its label, the model it belongs to and the callable timed."""

    name: str
    model: Any
    fn: Any

    def inputs(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """The seeded f32 inputs in this variant's float dtype (a bf16 model takes bf16 images)."""
        from ..pipelines.accuracy import cast_inputs

        return cast_inputs(inputs, self.model)


def _bench_batch(args: argparse.Namespace, entry: str, variants: list[Variant], b: int, peak: float) -> None:
    from ..kernels import calibration as calibrate
    from ..runtime.examples import example_inputs

    inputs = example_inputs(variants[0].model, entry, b)
    rows = calibrate.calibrate_model(lambda: variants[0].fn(*inputs))
    fast = variants[1] if len(variants) > 1 and variants[1].name != "compile" else None
    if fast is not None:  # the fast path's own choices (int8 races each shape against its f32 kernel)
        own = fast.inputs(inputs)
        rows += calibrate.calibrate_model(lambda: fast.fn(*own))
    flops = _flops(lambda: variants[0].fn(*inputs))
    times: dict[str, list[float]] = {v.name: [] for v in variants}
    with torch.inference_mode():
        for v in variants:
            v.fn(*v.inputs(inputs))  # warm-up (and compile, and the fast path's own calibration)

        def timed() -> None:
            for _ in range(args.repeat):
                for v in variants:  # interleaved: every variant sees the same load
                    own = v.inputs(inputs)
                    t = time.perf_counter()
                    v.fn(*own)
                    times[v.name].append(time.perf_counter() - t)

        _, other = others_share(timed)
    base = statistics.median(times[variants[0].name])
    for name, ts in times.items():
        med = statistics.median(ts)
        rate = flops / med / 1e9
        print(f"{name:<9} {b:>5} {med:>9.4f} {min(ts):>8.4f} {rate:>8.1f} {100 * rate / peak:>6.0f}% "
              f"{base / med:>7.2f}x {_pct(other):>7}")
    if args.verbose:
        print("\n".join(calibrate.format_choices(rows)))


def _print_accuracy(model: Any, fast: Variant, batch: int) -> None:
    from ..pipelines import accuracy

    t = time.perf_counter()
    acc = accuracy.measure(model, fast.model, batch=max(batch, 8))
    cells = accuracy.row(model.loaded.name, fast.name, acc)
    shown = [i for i, c in enumerate(cells) if i < 2 or c != "-"]
    heads = ["model", "option", *accuracy.COLUMNS]
    print(f"\naccuracy against f32 ({acc.inputs}; {time.perf_counter() - t:.1f} s):")
    print("| " + " | ".join(heads[i] for i in shown) + " |")
    print("|" + " --- |" * len(shown))
    print("| " + " | ".join(cells[i] for i in shown) + " |")


register(Command(
    "doctor", run=cmd_doctor, raw=True, epilog=DOCTOR_EPILOG,
    options=[
        Option("--model", ModelRef(), help="a card name or save_pretrained directory: calibrate every shape it uses"),
        weights_option(help="local directory of the card's files"),
        Option("--entry", Text(what="entry name", metavar="ENTRY"),
               help="the entry to run (default: the model's first)"),
        Option("--batch", PositiveInt(4096), default=1, help="batch for --model, 1 to 4096 (default 1)"),
        Option("--threads", Threads(), help="measure at this thread count only (default: 1 and all cores)"),
        Option("--size", PositiveInt(8192, what="a GEMM size"), default=1024,
               help="square GEMM size for the rates, 1 to 8192 (default 1024)"),
        Option("--onnxruntime", help="with --model: also race the entry against its own ONNX export on onnxruntime "
               "at this batch, and run it there from now on if that is faster (needs kestrel[export])"),
        Option("--reset", help="delete the cached choices and stop"),
    ]))

register(Command(
    "bench", run=cmd_bench, raw=True, epilog=BENCH_EPILOG,
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
        Option("--dtype", Choice(choices=("f32", "bf16", "f16")), default="f32",
               help="also time the model in this dtype, interleaved with f32 (default f32: f32 only)"),
        Option("--quantize", Choice(choices=("int8",)),
               help="also time int8 dynamic quantisation of every linear, interleaved with f32"),
        Option("--accuracy", help="with --dtype or --quantize: after timing, print what the fast path costs in "
                                  "accuracy against f32 (cosine, top-1/top-5, ranking, mask IoU)"),
        Option("-v --verbose", help="print the kernel chosen for every GEMM shape"),
    ]))
