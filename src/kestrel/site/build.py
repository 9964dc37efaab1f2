"""The registry site: an index with search, and one page per model laid out as the seeds show it.

A model page holds, in the seeds' order, the preview graph of the main entry, the entries table, the
generics table (as the checkpoint binds them) and every block as ``kestrel inspect`` prints it, each
block anchored and its sub types linked to their blocks. After those: the card (what the model is, the
checkpoint with revision and license, how to load it, the tasks it serves), the parameter manifest, a
graph per entry (its largest groups collapsible one by one: every combination is laid out here, the page
swaps them in), SAM 2.1's edge split (with an export's files when given), and benchmark charts.

Everything on a page is derived from the declarations, the checked graphs and the card.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from html import escape
from importlib import resources
from pathlib import Path
from typing import Any

from ..blocks import Block
from ..blocks.block import bind_generics
from ..blocks.decl import BlockDecl, SubDecl
from ..checker.check import Report, check_program
from ..errors import KestrelError
from ..inspect.diagram import Diagram, entry_diagram, render, theme_css, unit_nesting
from ..inspect.manifest import parameter_rows
from ..inspect.printer import format_block, format_signature, listed_blocks
from ..models.capabilities import TASKS
from ..models.cards import CARDS, Card
from ..types.dtypes import DTypeKind
from .charts import bench_charts
from .edge import EdgeExport, EdgeExportError, edge_section, has_edge_split, read_edge_export

ASSETS = ("site.css", "site.js")
PAN_ZOOM = "svg-pan-zoom.min.js"  # npm's svg-pan-zoom (web/package.json), copied in at build time
CHECKOUT = Path(__file__).resolve().parents[3]
BENCH_RESULTS = CHECKOUT / "bench" / "results"  # committed bench/run.py results (a checkout only)


def pan_zoom_js() -> Path | None:
    """svg-pan-zoom's script: ``$KESTREL_SVG_PAN_ZOOM``, else the checkout's ``web/node_modules``."""
    env = os.environ.get("KESTREL_SVG_PAN_ZOOM")
    path = Path(env) if env else CHECKOUT / "web" / "node_modules" / "svg-pan-zoom" / "dist" / PAN_ZOOM
    return path if path.is_file() else None


class SiteError(KestrelError, ValueError):
    """A site that cannot be built as asked (an unknown model, an unreadable results file)."""


# A graph's blocks (and helpers) that a reader can collapse one by one: the largest groups, at most
# TOGGLES_MAX of them (every combination is laid out at build time: 2**n graphs at most), each holding at
# least TOGGLE_MIN_NODES nodes (a smaller group drawn as one node saves nothing).
TOGGLES_MAX = 5
TOGGLE_MIN_NODES = 4


@dataclass
class Unit:
    """A group of an entry graph that collapses to one node: its key, caption and enclosing unit."""

    key: str
    caption: str
    parent: int  # the index of the unit it is drawn inside, or -1

    @property
    def name(self) -> str:
        """What the toolbar calls it: the sub's path (``mask_decoder``) or the helper's name."""
        return self.caption.split(":", 1)[0].replace("  (helper)", "()").strip()


@dataclass
class Program:
    """One root block, checked once, with its entry graphs rendered once (cards of a family share it)."""

    root: type[Block]
    report: Report
    svgs: dict[str, str]  # entry -> SVG, block calls expanded one level (what the page opens with)
    units: dict[str, list[Unit]] = field(default_factory=dict)  # entry -> its collapsible groups
    # entry -> mask (bit i: unit i collapsed; no bit under a set bit) -> SVG; mask 0 is ``svgs``
    variants: dict[str, dict[int, str]] = field(default_factory=dict)


def collapsible_units(d: Diagram) -> list[Unit]:
    """The groups of a fully expanded graph a reader can collapse, in drawing order."""
    nesting = unit_nesting(d)
    biggest = sorted((k for k in nesting if nesting[k][1] >= TOGGLE_MIN_NODES), key=lambda k: -nesting[k][1])
    chosen = set(biggest[:TOGGLES_MAX])
    keys = [k for k, _ in d.units if k in chosen]
    units = []
    for key, caption in d.units:
        if key not in chosen:
            continue
        parent = nesting[key][0]
        while parent is not None and parent not in chosen:  # the nearest enclosing unit that is a toggle
            parent = nesting[parent][0]
        units.append(Unit(key, caption, keys.index(parent) if parent is not None else -1))
    return units


def unit_masks(units: list[Unit]) -> list[int]:
    """Every state worth laying out: no unit collapsed inside a collapsed one (that looks the same)."""
    def ok(mask: int) -> bool:
        return all(not mask >> i & 1 or u.parent < 0 or not mask >> u.parent & 1 for i, u in enumerate(units))
    return [m for m in range(1 << len(units)) if ok(m)]


# -------------------------------------------------------------------------------------- helpers

def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]+", "-", text).strip("-")


def block_anchor(qualname: str) -> str:
    return "b-" + slug(qualname.replace("::", "--"))


def _page(title: str, body: str, depth: int, extra_head: str = "") -> str:
    up = "../" * depth
    return f"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{escape(title)}</title>
<link rel="icon" href="data:,">
<link rel="stylesheet" href="{up}assets/site.css">
<script src="{up}assets/theme.js"></script>
{extra_head}</head>
<body>
<header class="top">
  <a class="brand" href="{up}index.html">Kestrel registry</a>
  <nav><a href="{up}index.html#models">Models</a><a href="{up}index.html#search">Search</a></nav>
  <button id="theme-toggle" type="button" aria-label="switch between light and dark">Dark theme</button>
</header>
<main>
{body}
</main>
<footer>Built by <code>kestrel site</code> from the model declarations; every listing is derived, none is stored.
</footer>
<script src="{up}assets/{PAN_ZOOM}"></script>
<script src="{up}assets/site.js"></script>
</body>
</html>
"""


def _svg_size(svg: str) -> tuple[float, float]:
    """Graphviz's natural size of an SVG in CSS pixels (it writes points)."""
    m = re.search(r'<svg width="([\d.]+)pt" height="([\d.]+)pt"', svg)
    return (float(m[1]) * 4 / 3, float(m[2]) * 4 / 3) if m else (800.0, 600.0)


def _inline_svg(svg: str, prefix: str) -> str:
    """Graphviz's SVG for inlining: no XML prolog, ids made unique on the page, filling its box.

    The width and height become 100% of the figure's box and the viewBox stays, so the browser fits the
    whole graph in the box on load (and svg-pan-zoom zooms and pans from there).
    """
    start = svg.index("<svg")
    body = svg[start:]
    body = re.sub(r'\bid="', f'id="{prefix}-', body)
    body = re.sub(r'<svg width="([\d.]+)pt" height="([\d.]+)pt"',
                  '<svg width="100%" height="100%" class="kg-svg" role="img"', body, count=1)
    return body


def _generic_kind(g: Any) -> str:
    return g.kind.name if isinstance(g.kind, DTypeKind) else g.kind.__name__


def _block_html(decl: BlockDecl, known: dict[str, str]) -> str:
    """The block's ``inspect`` text with each sub's block type linked to that block's anchor."""
    lines = format_block(decl).split("\n")
    out = [escape(lines[0])]
    members = decl.members
    for i, line in enumerate(lines[1:]):
        m = members[i] if i < len(members) else None
        if isinstance(m, SubDecl):
            callee = m.block.decl()
            head, sep, rest = line.partition(": ")
            name_at = rest.find(callee.name + "<")
            if name_at < 0:
                name_at = rest.find(callee.name)
            if sep and name_at >= 0 and callee.qualname in known:
                rest_html = (escape(rest[:name_at]) + f'<a href="#{known[callee.qualname]}">{escape(callee.name)}</a>'
                             + escape(rest[name_at + len(callee.name):]))
                out.append(escape(head + sep) + rest_html)
                continue
        out.append(escape(line))
    return "\n".join(out)


def _table(headers: list[str], rows: Iterable[list[str]], cls: str) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = "\n".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f'<table class="{cls}">\n<thead><tr>{head}</tr></thead>\n<tbody>\n{body}\n</tbody>\n</table>'


# --------------------------------------------------------------------------------------- tasks

def served_tasks(card: Card) -> list[tuple[str, str]]:
    """The ``kestrel`` commands that run this card's model, as its family's capabilities declare them."""
    return [(task, TASKS[task]) for task in card.family.capabilities.tasks]


# --------------------------------------------------------------------------------------- pages

def _preview_caption(entry: str) -> str:
    return (f"The {entry} entry with one level of blocks expanded. Every edge carries the tensor type the "
            f"checker inferred at that point, in the model's own generics.")


def _graph_figure(card: Card, entry: str, svg: str, fig_id: str, caption: str, top: bool = False,
                  units: list[Unit] | None = None) -> str:
    href = f"../graphs/{card.name}.{entry}.svg"
    width, height = _svg_size(svg)
    # the box: the page's width, as tall as the graph needs up to 72% of the window (the whole graph is
    # fitted into it; zoom for detail); the preview under the page's title ends within the first screen
    window = f"max(320px, 100vh - {295 if units else 260}px)" if top else "72vh"  # less the "Blocks:" row
    box = f"height: min({window}, {max(height, 160):.0f}px)"
    tools = ('<button type="button" data-zoom="in" aria-label="zoom in" title="zoom in (+)">+</button>'
             '<button type="button" data-zoom="out" aria-label="zoom out" title="zoom out (-)">&#8722;</button>'
             '<button type="button" data-zoom="fit" title="fit the whole graph (0)">Fit</button>'
             '<button type="button" data-zoom="actual" title="natural size (1)">Actual size</button>'
             + ('<button type="button" class="level" title="every block below as one node, or all open">'
                'Collapse blocks</button>' if units else "")
             + '<span class="hint">drag: pan · wheel, + −, keys + − 0 1 ← → ↑ ↓: zoom, move · '
             "a block's name: its listing" + (" · [-] [+]: collapse, expand it" if units else "") + "</span>")
    # a switch per collapsible group (also drawn in the graph: [-] on its caption, [+] on its node); the
    # script fetches graphs/<card>.<entry>.m<mask>.svg, laid out at build time for each combination
    blocks = data = ""
    if units:
        blocks = ('<div class="graph-blocks" role="group" aria-label="collapse or expand a block">'
                  '<span class="label">Blocks:</span>'
                  + "".join(f'<button type="button" data-unit="{i}" aria-pressed="false" '
                            f'title="{escape(u.caption)}: draw it as one node, or open it">{escape(u.name)}</button>'
                            for i, u in enumerate(units)) + "</div>\n")
        data = (f' data-graphs="../graphs/{card.name}.{entry}"'
                f' data-parents="{" ".join(str(u.parent) for u in units)}"')
    return (f'<figure class="graph" id="{fig_id}" data-width="{width:.0f}" data-height="{height:.0f}"{data}>\n'
            f'<div class="graph-tools">{tools}<a href="{href}">Open the SVG</a></div>\n{blocks}'
            f'<div class="kg" tabindex="0" aria-label="graph of {escape(entry)}: drag to pan, + and - to zoom" '
            f'style="{box}">{_inline_svg(svg, fig_id)}</div>\n'
            f"<figcaption>{escape(caption)}</figcaption>\n</figure>")


def model_page(card: Card, program: Program, bench: list[dict[str, Any]] | None,
               export: EdgeExport | None = None) -> str:
    root = program.root
    decl = root.decl()
    blocks = listed_blocks(root)
    anchors = {b.qualname: block_anchor(b.qualname) for b in blocks}
    main_entry = decl.entries[0].name
    bound = bind_generics(decl, card.generics())
    parts: list[str] = [f'<h1>{escape(card.title)}</h1>\n<p class="sub"><code>{escape(card.name)}</code> · '
                        f"<code>{escape(decl.qualname)}</code> · {escape(card.family.description)}</p>"]
    edge = has_edge_split(card)
    toc = [("preview", "Graph"), ("entries", "Entries"), ("generics", "Generics"), ("blocks", "Blocks"),
           ("card", "Card"), ("parameters", "Parameters"), ("graphs", "Entry graphs"),
           *([("edge-split", "Edge split (512)")] if edge else []), ("benchmarks", "Benchmarks")]
    parts.append('<nav class="toc">' + " ".join(f'<a href="#{a}">{t}</a>' for a, t in toc) + "</nav>")
    parts.append(_graph_figure(card, main_entry, program.svgs[main_entry], "preview", _preview_caption(main_entry),
                               top=True, units=program.units.get(main_entry)))

    parts.append('<section id="entries">\n<h2>Entries</h2>')
    parts.append(_table(["Entry", "Signature"],
                        ([f'<a href="#graph-{slug(fn.name)}"><code>{escape(fn.name)}</code></a>',
                          f"<code>{escape(format_signature(fn, decl.order))}</code>"] for fn in decl.entries),
                        "entries"))
    parts.append("</section>")

    parts.append('<section id="generics">\n<h2>Generics</h2>\n'
                 "<p>The root block's generics as this checkpoint binds them.</p>")
    parts.append(_table(["Name", "Kind", "Value"],
                        ([f"<code>{escape(g.name)}</code>", escape(_generic_kind(g)),
                          f"<code>{escape(str(bound.get(g.name, '?')))}</code>"] for g in decl.generics),
                        "generics"))
    parts.append("</section>")

    parts.append('<section id="blocks">\n<h2>Blocks</h2>\n<p>Every block of the program with its members and '
                 "functions, as <code>kestrel inspect</code> prints them.</p>")
    for b in blocks:
        parts.append(f'<section class="block" id="{anchors[b.qualname]}">\n'
                     f'<h3><a class="anchor" href="#{anchors[b.qualname]}">{escape(b.name)}</a></h3>\n'
                     f'<pre class="block-text">{_block_html(b, anchors)}</pre>\n</section>')
    parts.append("</section>")

    parts.append(_card_section(card, root))
    parts.append(_parameters_section(card, root))

    parts.append('<section id="graphs">\n<h2>Entry graphs</h2>')
    for fn in decl.entries:
        fid = f"graph-{slug(fn.name)}"
        if fn.name == main_entry:
            parts.append(f'<p id="{fid}">The <code>{escape(fn.name)}</code> graph is the '
                         f'<a href="#preview">preview above</a>.</p>')
            continue
        parts.append(_graph_figure(card, fn.name, program.svgs[fn.name], fid, _preview_caption(fn.name),
                                   units=program.units.get(fn.name)))
    parts.append("</section>")

    if edge:
        parts.append(edge_section(card, root, export))
    parts.append('<section id="benchmarks">\n<h2>Benchmarks</h2>')
    charts = bench_charts(bench, card.family.name) if bench else ""
    parts.append(charts or "<p>No benchmark results for this model: <code>bench/run.py</code> does not measure "
                 "it yet (results are read from <code>bench/results/</code>, or from "
                 "<code>kestrel site --bench results.json</code>).</p>")
    parts.append("</section>")
    return _page(f"{card.title} · Kestrel", "\n".join(parts), depth=1)


def _card_section(card: Card, root: type[Block]) -> str:
    decl = root.decl()
    entry = decl.entries[0]
    args = ", ".join(n for n, _ in entry.params)
    rows = [
        ["Model", escape(card.title)],
        ["Family", f"<code>{escape(card.family.name)}</code>: {escape(card.family.description)}"],
        ["Checkpoint", f"<code>{escape(card.repo)}</code>"],
        ["Revision", f"<code>{escape(card.revision)}</code>"],
        ["License", escape(card.family.license or "as stated by the upstream checkpoint")],
        ["Program", f'<a href="#{block_anchor(decl.qualname)}"><code>{escape(decl.qualname)}</code></a>'],
    ]
    tasks = served_tasks(card)
    task_html = "".join(f"<li><code>kestrel {escape(c)}</code>: {escape(w)}</li>" for c, w in tasks)
    cli = [f"kestrel inspect {card.name}", f"kestrel inspect {card.name} --parameters",
           f"kestrel diagram {card.name} --entry {entry.name} -o {entry.name}.svg"]
    cli += [f"kestrel {c} ... --model {card.name}   # kestrel {c} --help: its arguments" for c, _ in tasks]
    python = (f'import kestrel\nmodel = kestrel.load("{card.name}")   # {card.repo} @ {card.revision[:12]}, '
              f'or weights="dir/"\nout = model.{entry.name}({args})')
    return ('<section id="card">\n<h2>Card</h2>\n'
            + _table(["", ""], rows, "card").replace("<thead><tr><th></th><th></th></tr></thead>\n", "")
            + "\n<h3>Load it</h3>\n<p>From Python:</p>\n"
            f'<pre class="code">{escape(python)}</pre>\n<p>From the command line:</p>\n'
            f'<pre class="code">{escape(chr(10).join(cli))}</pre>\n'
            f'<h3>Tasks</h3>\n<ul class="tasks">{task_html or "<li>No task command runs this model yet.</li>"}</ul>'
            "\n</section>")


def _parameters_section(card: Card, root: type[Block]) -> str:
    rows = parameter_rows(root, card.generics())
    total = 0
    body = []
    for r in rows:
        count = 1
        for s in r["shape"]:
            count *= s
        total += count
        shape = "[" + ", ".join(map(str, r["shape"])) + "]" + ("?" if r["optional"] else "")
        body.append([f"<code>{escape(r['path'])}</code>", f"<code>{shape}</code>", escape(r["dtype"]),
                     f"{count:,}"])
    summary = f"{len(rows):,} parameter tensors, {total:,} values ({total / 1e6:.1f} M)"
    return (f'<section id="parameters">\n<h2>Parameters</h2>\n<p class="totals">{summary}</p>\n'
            f"<details><summary>The parameter manifest: every path with its bound shape</summary>\n"
            + _table(["Path", "Shape", "Dtype", "Values"], body, "parameters") + "\n</details>\n</section>")


def index_page(cards: list[Card], programs: dict[str, Program]) -> tuple[str, list[dict[str, str]]]:
    rows = []
    search: list[dict[str, str]] = []
    for card in cards:
        root = programs[card.name].root
        decl = root.decl()
        url = f"models/{card.name}.html"
        entries = ", ".join(f'<a href="{url}#graph-{slug(fn.name)}"><code>{escape(fn.name)}</code></a>'
                            for fn in decl.entries)
        rows.append([f'<a href="{url}"><strong>{escape(card.name)}</strong></a>', escape(card.title),
                     f"<code>{escape(card.repo)}</code>", entries, str(len(listed_blocks(root)))])
        search.append({"kind": "model", "name": card.name, "text": card.title, "url": url})
        for fn in decl.entries:
            search.append({"kind": "entry", "name": f"{fn.name}", "text": format_signature(fn, decl.order),
                           "url": f"{url}#graph-{slug(fn.name)}", "model": card.name})
        for b in listed_blocks(root):
            search.append({"kind": "block", "name": b.qualname, "text": format_block(b).split("\n", 1)[0],
                           "url": f"{url}#{block_anchor(b.qualname)}", "model": card.name})
    body = ("<h1>Kestrel model registry</h1>\n<p>Vision foundation models as typed, shape-checked programs. "
            "Each page shows a model as <code>kestrel inspect</code> does, with its typed entry graphs.</p>\n"
            '<section id="search">\n<h2>Search</h2>\n'
            '<input id="q" type="search" placeholder="a model, an entry or a block (e.g. MaskAttention)" '
            'autocomplete="off" aria-label="search models, entries and blocks">\n'
            '<ol id="results" aria-live="polite"></ol>\n</section>\n'
            '<section id="models">\n<h2>Models</h2>\n'
            + _table(["Card", "Model", "Checkpoint", "Entries", "Blocks"], rows, "models") + "\n</section>\n"
            '<script type="application/json" id="search-index">'
            + json.dumps(search).replace("</", "<\\/") + "</script>")
    return _page("Kestrel model registry", body, depth=0), search


# --------------------------------------------------------------------------------------- build

def _programs(cards: list[Card], progress: bool) -> dict[str, Program]:
    """Check each distinct root once and render each of its entries once (in parallel: Graphviz runs)."""
    by_root: dict[type[Block], list[Card]] = {}
    for card in cards:
        by_root.setdefault(card.family.root(card.config), []).append(card)
    reports: dict[type[Block], Report] = {}
    units: dict[type[Block], dict[str, list[Unit]]] = {}
    jobs: list[tuple[type[Block], str, int]] = []  # (root, entry, mask): one Graphviz layout each
    for root in by_root:
        reports[root] = check_program(root)
        units[root] = {}
        for fn in root.decl().entries:
            units[root][fn.name] = collapsible_units(entry_diagram(root, fn.name, 1, report=reports[root]))
            jobs += [(root, fn.name, mask) for mask in unit_masks(units[root][fn.name])]

    listed = {root: {b.qualname for b in listed_blocks(root)} for root in by_root}

    def draw(job: tuple[type[Block], str, int]) -> str:
        root, entry, mask = job
        these = units[root][entry]

        def link(qualname: str) -> str | None:  # a block call opens the block's listing on the page
            return f"#{block_anchor(qualname)}" if qualname in listed[root] else None

        collapse = frozenset(u.key for i, u in enumerate(these) if mask >> i & 1)
        d = entry_diagram(root, entry, 1, report=reports[root], collapse=collapse)
        return render(d, "svg", link=link, toggles={u.key: i for i, u in enumerate(these)}).decode()

    from tqdm import tqdm

    with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
        svgs = list(tqdm(pool.map(draw, jobs), total=len(jobs), desc="graphs", unit="graph",
                         disable=not progress))
    out: dict[str, Program] = {}
    for root, group in by_root.items():
        variants: dict[str, dict[int, str]] = {}
        for (r, entry, mask), svg in zip(jobs, svgs):
            if r is root:
                variants.setdefault(entry, {})[mask] = svg
        entries = {entry: v[0] for entry, v in variants.items()}
        for card in group:
            out[card.name] = Program(root, reports[root], entries, units[root], variants)
    return out


def read_bench(path: Path | None) -> list[dict[str, Any]] | None:
    """The benchmark runs to chart: a ``bench/run.py --out`` file, or every ``*.json`` of a folder.

    With no path, the checkout's committed ``bench/results/`` (when the site is built from a checkout).
    """
    if path is None:
        if not BENCH_RESULTS.is_dir():
            return None
        path = BENCH_RESULTS
    path = Path(path)
    files = sorted(path.glob("*.json")) if path.is_dir() else [path]
    runs = []
    for f in files:
        try:
            data = json.loads(f.read_text())
        except (OSError, ValueError) as e:
            raise SiteError(f"cannot read the benchmark results {f}: {e}") from None
        accuracy = isinstance(data, dict) and data.get("kind") == "accuracy" and isinstance(data.get("rows"), list)
        if not isinstance(data, dict) or not (isinstance(data.get("cases"), list) or accuracy):
            raise SiteError(f"{f} is neither a bench/run.py nor a bench/accuracy.py --out results file "
                            "(no 'cases' or accuracy 'rows' list)")
        runs.append(data)
    return runs


def build_site(out: Path, models: list[str] | None = None, bench: Path | None = None,
               progress: bool = False, edge: Path | None = None) -> list[Path]:
    """Write the site under ``out`` (replacing what an earlier build wrote there); return the pages.

    ``edge``: a ``kestrel export`` folder of a SAM 2.1 card's 512 split, copied in and linked from its page.
    """
    names = models or list(CARDS)
    unknown = [n for n in names if n not in CARDS]
    if unknown:
        raise SiteError(f"unknown model {', '.join(unknown)}; known models: {', '.join(CARDS)}")
    cards = [CARDS[n] for n in names]
    export, exported = None, None
    if edge is not None:
        try:
            export = read_edge_export(Path(edge))
        except EdgeExportError as e:
            raise SiteError(str(e)) from None
        exported = next((c for c in cards if c.repo == export.repo and has_edge_split(c)), None)
        if exported is None:
            raise SiteError(f"{edge} is an export of {export.repo or 'an unnamed model'}, which no SAM 2.1 card "
                            f"of this build is; build its card (--models) or give its export")
    results = read_bench(bench)
    programs = _programs(cards, progress)

    out = Path(out)
    tmp = out.with_name(out.name + ".tmp-build")
    if tmp.exists():
        shutil.rmtree(tmp)
    (tmp / "models").mkdir(parents=True)
    (tmp / "graphs").mkdir()
    (tmp / "assets").mkdir()
    assets = resources.files("kestrel.site") / "assets"
    for name in ASSETS:
        (tmp / "assets" / name).write_text((assets / name).read_text())
    pan_zoom = pan_zoom_js()
    if pan_zoom is not None:
        shutil.copyfile(pan_zoom, tmp / "assets" / PAN_ZOOM)
    else:  # the graphs still open fitted; pan and zoom need the npm package
        (tmp / "assets" / PAN_ZOOM).write_text("/* svg-pan-zoom is not installed: `make web` (npm ci in web/) */\n")
        import sys

        print("warning: svg-pan-zoom is not installed (`make web`): the site's graphs are fitted but cannot "
              "be zoomed", file=sys.stderr)
    (tmp / "assets" / "site.css").write_text((tmp / "assets" / "site.css").read_text() + "\n/* graphs, dark */\n"
                                             + theme_css("dark", ':root[data-theme="dark"] .kg'))
    (tmp / "assets" / "theme.js").write_text(THEME_JS)
    pages = []
    index, search = index_page(cards, programs)
    (tmp / "index.html").write_text(index)
    (tmp / "search.json").write_text(json.dumps(search, indent=1))
    pages.append(out / "index.html")
    for card in cards:
        program = programs[card.name]
        linked = export if card is exported else None
        (tmp / "models" / f"{card.name}.html").write_text(model_page(card, program, results, linked))
        if linked is not None:
            linked.copy_to(tmp / "edge" / card.name)
        for entry, variants in program.variants.items():
            for mask, svg in variants.items():  # block links point at the model page from here
                svg = svg.replace('xlink:href="#b-', f'xlink:href="../models/{card.name}.html#b-')
                (tmp / "graphs" / f"{card.name}.{entry}{f'.m{mask}' if mask else ''}.svg").write_text(svg)
        pages.append(out / "models" / f"{card.name}.html")
    if out.exists():
        if not (out / "index.html").exists() and any(out.iterdir()):
            shutil.rmtree(tmp)
            raise SiteError(f"{out} exists and is not a site this command built; choose another --out")
        shutil.rmtree(out)
    tmp.replace(out)
    return pages


# set before the page paints: the stored choice, else the system's preference
THEME_JS = """(function () {
  var t = null;
  try { t = localStorage.getItem('kestrel-theme'); } catch (e) {}
  if (t !== 'light' && t !== 'dark') {
    t = window.matchMedia && window.matchMedia('(prefers-color-scheme: dark)').matches ? 'dark' : 'light';
  }
  document.documentElement.setAttribute('data-theme', t);
})();
"""

__all__ = ["SiteError", "block_anchor", "build_site", "served_tasks"]
