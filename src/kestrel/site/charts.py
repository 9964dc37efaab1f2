"""Benchmark charts: ``bench/run.py --out`` results as grouped bars, Kestrel beside the reference, by batch."""

from __future__ import annotations

from html import escape
from typing import Any

LABELS = {"kestrel": "Kestrel eager", "kestrel-compile": "Kestrel compiled", "hf": "transformers eager",
          "hf-compile": "transformers compiled", "onnx": "onnxruntime (Kestrel export)"}
ORDER = list(LABELS)


def _cases_for(results: dict[str, Any], family: str) -> list[dict[str, Any]]:
    """The result cases measured on this family (``siglip-text`` belongs to ``siglip``)."""
    return [c for c in results.get("cases", [])
            if c.get("model") == family or str(c.get("model", "")).startswith(family + "-")]


def bench_charts(results: dict[str, Any], family: str) -> str:
    cases = _cases_for(results, family)
    if not cases:
        return ""
    parts = ["<p>Median seconds per call (lower is better), measured in one run by <code>bench/run.py</code> "
             "on random weights from the family's config; each bar is labelled with its time and, for "
             "Kestrel, its ratio to transformers eager at that batch.</p>"]
    for case in cases:
        parts.append(_case_chart(case))
    return "\n".join(parts)


def _case_chart(case: dict[str, Any]) -> str:
    rows = [r for r in case.get("rows", []) if isinstance(r.get("median"), int | float)]
    batches = sorted({r["batch"] for r in rows})
    variants = [v for v in ORDER if any(r["variant"] == v for r in rows)]
    title = f"{case.get('case', case.get('model'))}: {case.get('gflop_per_item', 0):.1f} GFLOP per item"
    if not rows:
        return f"<h3>{escape(title)}</h3><p>No timed rows (every variant failed).</p>"
    top = max(r["median"] for r in rows)
    bar_h, gap, label_w, width = 18, 10, 190, 720
    scale = (width - label_w - 150) / top
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
            svg.append(f'<text x="{label_w - 6}" y="{y + 13}" text-anchor="end" class="bc-label">'
                       f"{escape(LABELS.get(v, v))}</text>")
            svg.append(f'<rect x="{label_w}" y="{y}" width="{w:.1f}" height="{bar_h}" class="bc-bar bc-{v}"/>')
            svg.append(f'<text x="{label_w + w + 6:.1f}" y="{y + 13}" class="bc-value">'
                       f"{r['median']:.3f} s{escape(ratio)}</text>")
            table.append(f"<tr><td>{b}</td><td>{escape(LABELS.get(v, v))}</td><td>{r['median']:.4f}</td></tr>")
            y += bar_h + 4
        y += gap
    chart = (f'<svg class="bench-chart" viewBox="0 0 {width} {y}" width="{width}" height="{y}" role="img" '
             f'aria-label="{escape(title)}">' + "".join(svg) + "</svg>")
    return (f'<figure class="bench"><figcaption>{escape(title)}</figcaption>{chart}'
            "<details><summary>As a table</summary><table><thead><tr><th>Batch</th><th>Variant</th>"
            f"<th>Median s</th></tr></thead><tbody>{''.join(table)}</tbody></table></details></figure>")
