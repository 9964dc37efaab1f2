"""Whether half precision pays on this CPU: native bf16/f16 arithmetic is necessary, not sufficient.

A CPU whose flags show no native arithmetic for a dtype has torch convert to f32 for every GEMM
(:func:`~kestrel.kernels.calibration.native_half`). A CPU that has it can still run the dtype's GEMMs
slower than f32: on an Intel Xeon (family 6, model 207) with ``avx512_bf16`` and no AMX, oneDNN's bf16
GEMMs reached 181 GFLOP/s where f32 reached 334 (2 threads), while an AMD EPYC with the same flag runs bf16
at about twice its f32 rate. So the rate is measured: one square GEMM in f32 and in the dtype,
interleaved, once per machine key, kept in the calibration table (key ``rate bf16``) unless other
processes took the cores meanwhile.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from . import calibration, settings
from .contention import note_load, others_share

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
PROBE = 1024  # the measured problem is PROBE x PROBE x PROBE: ~2 GFLOP, tens of milliseconds per dtype


def dtype_rates(names: tuple[str, ...] = ("f32", "bf16", "f16"), n: int = PROBE, rounds: int = 4) -> dict[str, float]:
    """Best GFLOP/s of ``F.linear`` on one ``n x n x n`` problem in each dtype of ``names``, interleaved."""
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)]
    cases = {name: [t.to(DTYPES[name]) for t in base] for name in names}
    best = dict.fromkeys(cases, float("inf"))
    with torch.no_grad():
        for x, w in cases.values():
            F.linear(x, w)
        for _ in range(rounds):
            for name, (x, w) in cases.items():
                t = time.perf_counter()
                F.linear(x, w)
                best[name] = min(best[name], time.perf_counter() - t)
    return {name: 2 * n ** 3 / t / 1e9 for name, t in best.items()}


def measured_rates(name: str) -> dict[str, float] | None:
    """f32's and ``name``'s (``"bf16"`` or ``"f16"``) GEMM rates at this thread count, GFLOP/s: measured the
    first time on this machine key (about a tenth of a second), then read from the calibration table. None
    with calibration off (``KESTREL_CALIBRATE=0``) and nothing cached."""
    table = calibration.table()
    key = f"rate {name}"
    hit = table.shapes.get(key)
    if isinstance(hit, dict) and isinstance(hit.get("gflops"), dict):
        return hit["gflops"]
    if not settings.calibrate():
        return None
    # measured while other processes took the cores, the rates serve this process and the next measures again
    rates, others = others_share(lambda: dtype_rates(("f32", name)))
    table.put_entry(key, note_load({"gflops": rates, "n": PROBE}, others))
    return rates
