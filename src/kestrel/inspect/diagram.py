"""Diagrams of an entry: its typed graph with sub-block calls expanded one level.

Every edge carries the type the checker inferred for that value, written in the model's own generics
(callee types are translated through the substitution recorded at each call). Rendered as SVG with a
simple top-to-bottom layout (no Graphviz needed), or as Graphviz DOT.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from html import escape
from pathlib import Path

from ..blocks import Block
from ..checker.check import check_program
from ..checker.graph import Graph, Node
from ..errors import KestrelError
from ..types.tensor import TensorType
from ..types.unify import Binding


@dataclass
class DNode:
    id: int
    label: str
    kind: str
    group: str | None = None  # the expanded call this node belongs to


@dataclass
class Diagram:
    title: str
    nodes: list[DNode] = field(default_factory=list)
    edges: list[tuple[int, int, str]] = field(default_factory=list)  # (from, to, type text)
    groups: dict[str, str] = field(default_factory=dict)  # group id -> caption


class DiagramError(KestrelError, ValueError):
    pass


def entry_diagram(root: type[Block], entry: str) -> Diagram:
    """The entry's graph, one level of sub-block (and own-function) calls expanded."""
    report = check_program(root)
    if report.diagnostics:
        raise DiagramError(f"{root.decl().qualname} does not type-check:\n" +
                           "\n".join(d.format() for d in report.diagnostics))
    decl = root.decl()
    names = [fn.name for fn in decl.functions]
    if entry not in names:
        raise DiagramError(f"{decl.qualname} has no entry or function {entry!r}; it has {', '.join(names)}")
    graph = report.graphs[(decl.qualname, entry)]
    fn_title = next(fn for fn in decl.functions if fn.name == entry)
    from .printer import format_signature

    d = Diagram(f"{decl.qualname}.{format_signature(fn_title, decl.order)}")
    producer: dict[int, int] = {}  # value id (in the entry graph) -> diagram node
    types: dict[int, str] = {vid: graph.type_of(vid) for vid in graph.values}

    def add(label: str, kind: str, group: str | None = None) -> int:
        d.nodes.append(DNode(len(d.nodes), label, kind, group))
        return len(d.nodes) - 1

    def connect(vid: int, to: int) -> None:
        if vid in producer:
            d.edges.append((producer[vid], to, types[vid]))

    for node in graph.nodes:
        if node.kind in ("sub", "fn") and node.callee in report.graphs:
            _expand(d, node, report.graphs[node.callee], graph, producer, types, add, connect)
            continue
        label = _label(node)
        nid = add(label, node.kind)
        for vid in node.inputs:
            connect(vid, nid)
        for vid in node.outputs:
            producer[vid] = nid
    return d


def _label(node: Node) -> str:
    where = f"  :{node.line}" if node.line and node.kind == "op" else ""
    if node.kind == "input":
        return f"input {node.op}"
    if node.kind == "param":
        return f"param {node.op}"
    if node.kind == "output":
        return "output" if node.op == "result" else f"output {node.op[6:]}"
    return f"{node.op}{where}"


def _expand(d: Diagram, call: Node, inner: Graph, outer: Graph, producer: dict[int, int],
            types: dict[int, str], add, connect) -> None:
    subst = call.subst or {}
    binding = Binding(dict(subst.get("dims", {})), dict(subst.get("shapes", {})), dict(subst.get("dtypes", {})))
    group = f"g{call.id}"
    caption = call.op if call.kind == "fn" else f"{call.op}: {call.detail}"
    if call.op.endswith("[i]"):
        caption += "  (for each layer)"
    d.groups[group] = caption
    local: dict[int, int] = {}  # inner value id -> diagram node producing it
    inner_types: dict[int, str] = {}
    inputs = [n for n in inner.nodes if n.kind == "input"]
    alias: dict[int, int] = {}  # inner input value -> outer value
    for n, outer_vid in zip(inputs, call.inputs):
        alias[n.outputs[0]] = outer_vid

    def inner_type(vid: int) -> str:
        if vid not in inner_types:
            t = inner.values[vid].type
            inner_types[vid] = binding.apply(t).format(outer.order) if isinstance(t, TensorType) else str(t)
        return inner_types[vid]

    outputs = [n for n in inner.nodes if n.kind == "output"]
    for n in inner.nodes:
        if n.kind in ("input", "output"):
            continue
        nid = add(_label(n), n.kind, group)
        for vid in n.inputs:
            if vid in alias:
                connect(alias[vid], nid)
            elif vid in local:
                d.edges.append((local[vid], nid, inner_type(vid)))
        for vid in n.outputs:
            local[vid] = nid
    for n, outer_vid in zip(outputs, call.outputs):
        vid = n.inputs[0]
        if vid in local:
            producer[outer_vid] = local[vid]
        elif vid in alias and alias[vid] in producer:
            producer[outer_vid] = producer[alias[vid]]


# --------------------------------------------------------------------------------------- render

def to_dot(d: Diagram) -> str:
    lines = ["digraph kestrel {", '  rankdir=TB; node [shape=box, fontname="monospace", fontsize=10];',
             f'  label="{_dot(d.title)}"; labelloc=t; edge [fontname="monospace", fontsize=9];']
    for g, caption in d.groups.items():
        lines.append(f'  subgraph cluster_{g} {{ label="{_dot(caption)}"; style=rounded; color=gray60;')
        lines += [f'    n{n.id} [label="{_dot(n.label)}"];' for n in d.nodes if n.group == g]
        lines.append("  }")
    for n in d.nodes:
        if n.group is None:
            shape = "ellipse" if n.kind in ("input", "output") else "box"
            lines.append(f'  n{n.id} [label="{_dot(n.label)}", shape={shape}];')
    lines += [f'  n{a} -> n{b} [label="{_dot(t)}"];' for a, b, t in d.edges]
    lines.append("}")
    return "\n".join(lines) + "\n"


def _dot(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"')


ROW, BOX_H, CHAR_W = 54, 26, 6.6


def to_svg(d: Diagram) -> str:
    """A top-to-bottom drawing: one row per node, expanded calls framed, skip edges routed on the left."""
    longest = max((len(t) for _, _, t in d.edges), default=10)
    x0 = 60 + 7 * 12 + longest * 6.0  # room on the left for the skip lanes and their labels
    right = max([len(n.label) * CHAR_W + 40 for n in d.nodes] + [longest * 6.2 + 40, 460])
    right = max(right, max((len(c) for c in d.groups.values()), default=0) * 6.2 + 40)
    width = max(x0 + right, len(d.title) * 8.0 + 40)
    height = 70 + ROW * len(d.nodes)
    y = {n.id: 60 + ROW * i for i, n in enumerate(d.nodes)}
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height}" '
           f'font-family="DejaVu Sans Mono, monospace" font-size="11">',
           '<defs><marker id="a" markerWidth="8" markerHeight="8" refX="7" refY="4" orient="auto">'
           '<path d="M0,0 L8,4 L0,8 z" fill="#555"/></marker></defs>',
           '<rect width="100%" height="100%" fill="white"/>',
           f'<text x="12" y="24" font-size="13" font-weight="bold">{escape(d.title)}</text>']
    for g, caption in d.groups.items():
        members = [y[n.id] for n in d.nodes if n.group == g]
        if not members:
            continue
        top, bottom = min(members) - BOX_H / 2 - 16, max(members) + BOX_H / 2 + 6
        out.append(f'<rect x="{x0 - 30:.0f}" y="{top}" width="{right:.0f}" height="{bottom - top}" rx="8" '
                   f'fill="#f4f7fb" stroke="#9aa8bb"/>')
        out.append(f'<text x="{x0 - 24:.0f}" y="{top + 12}" fill="#4a5a70" font-size="10">{escape(caption)}</text>')
    lane = 0
    for a, b, text in d.edges:
        y1, y2 = y[a] + BOX_H / 2, y[b] - BOX_H / 2
        if y[b] - y[a] == ROW:  # neighbours: straight down, the type beside the arrow
            out.append(f'<line x1="{x0:.0f}" y1="{y1}" x2="{x0:.0f}" y2="{y2}" stroke="#555" marker-end="url(#a)"/>')
            out.append(f'<text x="{x0 + 8:.0f}" y="{(y1 + y2) / 2 + 4}" fill="#1f5fa8">{escape(text)}</text>')
        else:  # a skip edge: out to the left, down, back in; the type where it leaves
            lane = lane % 7 + 1
            x = x0 - 20 - 12 * lane
            out.append(f'<path d="M{x0 - 20:.0f},{y[a]} H{x:.0f} V{y[b]} H{x0 - 22:.0f}" fill="none" stroke="#999" '
                       f'stroke-dasharray="4 3" marker-end="url(#a)"/>')
            out.append(f'<text x="{x - 4:.0f}" y="{y[a] + 4}" text-anchor="end" fill="#1f5fa8" font-size="10">'
                       f'{escape(text)}</text>')
    for n in d.nodes:
        w = len(n.label) * CHAR_W + 16
        fill = {"input": "#e3f2e1", "output": "#fbe9d0", "param": "#eeeeee"}.get(n.kind, "#ffffff")
        rx = BOX_H / 2 if n.kind in ("input", "output") else 4
        out.append(f'<rect x="{x0 - 20:.0f}" y="{y[n.id] - BOX_H / 2}" width="{w:.0f}" height="{BOX_H}" rx="{rx}" '
                   f'fill="{fill}" stroke="#333"/>')
        out.append(f'<text x="{x0 - 12:.0f}" y="{y[n.id] + 4}">{escape(n.label)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def write_diagram(d: Diagram, path: Path) -> None:
    """Write the diagram as SVG, or Graphviz DOT for a ``.dot`` path (atomically, parent folders created)."""
    from ..runtime.output import write_text

    write_text(path, to_dot(d) if path.suffix == ".dot" else to_svg(d))
