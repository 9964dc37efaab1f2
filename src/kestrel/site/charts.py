"""Benchmark charts: ``bench/run.py --out`` results as grouped bars, Kestrel beside the references, by batch.

Each results file is one run on one machine; a model page shows, per run, where and how it was measured
(device, threads, date, command), then one chart per measured case with its table (seconds, the ratio to
transformers, peak memory).
"""

from __future__ import annotations

from html import escape
from typing import Any

from ..pipelines.accuracy import cell

LABELS = {"kestrel": "Kestrel eager", "kestrel-compile": "Kestrel compiled", "hf": "transformers eager",
          "hf-compile": "transformers compiled", "onnx": "onnxruntime (Kestrel export)",
          "executorch-xnnpack": "ExecuTorch XNNPACK .pte", "executorch-portable": "ExecuTorch portable .pte",
          "kestrel-int8": "Kestrel int8 (not exact)", "kestrel-bf16": "Kestrel bf16 (not exact)"}
ORDER = list(LABELS)


def _label(variant: str, row: dict[str, Any]) -> str:
    """A row's name; a Kestrel row whose entry ran on onnxruntime (its race chose it) says so."""
    if variant == "kestrel" and row.get("backend") == "onnxruntime":
        return "Kestrel (onnxruntime, raced)"
    return LABELS.get(variant, variant)


def _cases_for(results: dict[str, Any], family: str) -> list[dict[str, Any]]:
    """The result cases measured on this family (``siglip-text`` belongs to ``siglip``)."""
    return [c for c in results.get("cases", [])
            if c.get("model") == family or str(c.get("model", "")).startswith(family + "-")]


def _run_header(results: dict[str, Any]) -> str:
    m = results.get("machine", {})
    threads = m.get("threads")
    bits = [f"<strong>{escape(str(m.get('device', 'CPU')))}</strong>"]
    if m.get("cpu"):
        bits.append(escape(str(m["cpu"])))
    if m.get("physical"):
        bits.append(f"{m['physical']} cores")
    if threads:
        bits.append(f"{threads} thread{'s' if threads != 1 else ''}")
    if results.get("date"):
        bits.append(f"measured {escape(str(results['date']))}")
    peak = (results.get("peak_gflops") or {}).get("mm")
    if isinstance(peak, int | float):
        bits.append(f"f32 GEMM peak {peak:.0f} GFLOP/s")
    head = '<p class="bench-run">' + " · ".join(bits) + "</p>"
    if results.get("command"):
        head += f'<p class="bench-cmd"><code>{escape(str(results["command"]))}</code></p>'
    return head


def bench_charts(runs: list[dict[str, Any]] | dict[str, Any], family: str) -> str:
    """The Benchmarks section's body for a family, or "" when no run measured it."""
    if isinstance(runs, dict):
        runs = [runs]
    accuracy = "".join(accuracy_table(results, family) for results in runs if results.get("kind") == "accuracy")
    parts = []
    for results in runs:
        cases = _cases_for(results, family)
        if not cases:
            continue
        parts.append('<div class="bench-group">' + _run_header(results))
        parts.extend(_case_chart(case) for case in cases)
        parts.append("</div>")
    if not parts:
        return accuracy
    return accuracy + ("<p>Median seconds per call (lower is better), measured by <code>bench/run.py</code> on random "
            "weights built from the checkpoint's config, every row in its own process; each Kestrel bar is "
            "labelled with its ratio to transformers eager at that batch. Peak memory is the resident memory "
            "the row's calls added.</p>\n" + "\n".join(parts))


ACCURACY_COLUMNS = (("cosine", "feature cosine"), ("text cosine", "text cosine"), ("top-1", "top-1 agreement"),
                    ("top-5", "top-5 agreement"), ("ranking", "zero-shot ranking (Spearman)"),
                    ("ranking top-1", "zero-shot top-1"), ("mask IoU", "mask IoU"), ("rel diff", "max rel diff"))


def _metric(k: str, v: Any) -> str:
    return cell(k, v if isinstance(v, int | float) else None)


def accuracy_table(results: dict[str, Any], family: str) -> str:
    """A ``bench/accuracy.py --out`` run's rows for this family: what each fast path costs against f32."""
    rows = [r for r in results.get("rows", []) if r.get("family") == family and isinstance(r.get("metrics"), dict)]
    if not rows:
        return ""
    cols = [(k, label) for k, label in ACCURACY_COLUMNS if any(k in r["metrics"] for r in rows)]

    head = "".join(f"<th>{escape(label)}</th>" for _, label in cols)
    body = "".join(f"<tr><td><code>{escape(str(r.get('option')))}</code></td>"
                   + "".join(f"<td>{_metric(k, r['metrics'].get(k))}</td>" for k, _ in cols) + "</tr>" for r in rows)
    inputs = escape(str(rows[0].get("inputs", "")))
    return (f'<div class="bench-group"><h3>Accuracy of the fast paths against f32</h3>{_run_header(results)}'
            f"<p>The same checkpoint loaded with each option, on the same inputs ({inputs}); 1.0 is full agreement. "
            f"{escape(str(results.get('note', '')))}.</p>"
            f'<table class="bench-table"><thead><tr><th>option</th>{head}</tr></thead><tbody>{body}</tbody></table>'
            "</div>\n")


def _case_chart(case: dict[str, Any]) -> str:
    rows = [r for r in case.get("rows", []) if isinstance(r.get("median"), int | float)]
    batches = sorted({r["batch"] for r in rows})
    variants = [v for v in ORDER if any(r["variant"] == v for r in rows)]
    title = case.get("title") or case.get("case") or case.get("model")
    if case.get("gflop_per_item"):
        title = f"{title}: {case['gflop_per_item']:.1f} GFLOP per item"
    if not rows:
        return f"<h3>{escape(str(title))}</h3><p>No timed rows (every variant failed).</p>"
    top = max(r["median"] for r in rows)
    bar_h, gap, label_w, width = 18, 10, 190, 720
    scale = (width - label_w - 170) / top
    y = 10
    svg = []
    table = []
    for b in batches:
        svg.append(f'<text x="4" y="{y + 12}" class="bc-batch">batch {b}</text>')
        y += 20
        ref = next((r["median"] for r in rows if r["batch"] == b and r["variant"] == "hf"), None)
        for v in variants:
            r = next((r for r in rows if r["batch"] == b and r["variant"] == v), None)
            if r is None:
                continue
            w = max(1.0, r["median"] * scale)
            ratio = f"  ({r['median'] / ref:.2f}x transformers)" if ref and v.startswith("kestrel") else ""
            if top / r["median"] > 50:  # a bar too short to see beside the longest: say so
                ratio += f"  ({top / r['median']:.0f}x faster than the slowest)"
            svg.append(f'<text x="{label_w - 6}" y="{y + 13}" text-anchor="end" class="bc-label">'
                       f"{escape(_label(v, r))}</text>")
            svg.append(f'<rect x="{label_w}" y="{y}" width="{w:.1f}" height="{bar_h}" class="bc-bar bc-{v}"/>')
            svg.append(f'<text x="{label_w + w + 6:.1f}" y="{y + 13}" class="bc-value">'
                       f"{r['median']:.3g} s{escape(ratio)}</text>")
            vs = f"{r['median'] / ref:.2f}x" if ref else "-"
            mem = f"{r['peak_mb']:.0f}" if isinstance(r.get("peak_mb"), int | float) else "-"
            table.append(f"<tr><td>{b}</td><td>{escape(_label(v, r))}</td><td>{r['median']:.4g}</td>"
                         f"<td>{vs}</td><td>{mem}</td></tr>")
            y += bar_h + 4
        y += gap
    chart = (f'<svg class="bench-chart" viewBox="0 0 {width} {y}" width="{width}" height="{y}" role="img" '
             f'aria-label="{escape(str(title))}">' + "".join(svg) + "</svg>")
    return (f'<figure class="bench"><figcaption>{escape(str(title))}</figcaption>{chart}'
            '<table class="bench-table"><thead><tr><th>Batch</th><th>Variant</th><th>Median s</th>'
            f"<th>x transformers</th><th>Peak MB</th></tr></thead><tbody>{''.join(table)}</tbody></table>"
            "</figure>")
