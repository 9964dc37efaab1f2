"""Diagrams of an entry: the checker's typed graph, laid out by Graphviz.

What is drawn is derived from the checked program: the entry's recorded graph, with calls into sub
blocks (and the block's own typed functions) expanded as labelled groups down to ``expand`` levels and
collapsed to one node below that; calls into untyped helpers (``self._fourier``, a local ``def heads``)
grouped under the helper's name; a loop over a sub array drawn once, marked ``x Layers``; params as
small side inputs; chains of one-input ops (``flatten · transpose``) merged into one node. A group
can also be collapsed alone, named by its key in ``Diagram.units`` (the registry site lays out each
combination of a graph's largest groups, so that a reader collapses and opens them one by one). Every
edge carries the type the checker inferred for that value, written in the model's own generics (callee
types are translated through the substitution recorded at each call).

The layout is Graphviz's ``dot`` (layered graph drawing with clusters); this module only writes the
DOT text and runs ``dot`` on it.
"""

from __future__ import annotations

import ast
import functools
import inspect
import re
import shutil
import subprocess
import textwrap
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from html import escape, unescape
from pathlib import Path

from ..blocks import Block
from ..blocks.decl import BlockDecl, FnDecl
from ..checker.check import Report, check_program
from ..checker.graph import Graph, Node
from ..errors import KestrelError
from ..shapes.poly import AtomOrder, format_poly, substitute
from ..types.tensor import TensorType, TupleType
from ..types.unify import Binding


@dataclass
class DNode:
    id: str
    label: str
    kind: str  # input, output, op, param, call, loop, helper
    cluster: str | None = None  # the group it is drawn in
    detail: str = ""  # a second, smaller line (a call's block type)
    where: str = ""  # file:line of the source
    block: str = ""  # a call's block (qualname), for a link to its listing
    key: str = ""  # a collapsed block or helper call: the call's key (see ``Cluster.key``)


@dataclass
class Cluster:
    id: str
    caption: str
    kind: str  # call, loop, helper
    parent: str | None = None
    # a sub block's or helper's call: a key that names this call in every diagram of the entry, whatever
    # else is collapsed (the path of graph positions from the entry), so that it can be collapsed alone
    key: str = ""
    block: str = ""  # the called block (qualname), for a link to its listing


@dataclass
class Diagram:
    title: str
    nodes: list[DNode] = field(default_factory=list)
    edges: list[tuple[str, str, str]] = field(default_factory=list)  # (from, to, type text)
    clusters: dict[str, Cluster] = field(default_factory=dict)
    # the calls drawn as groups that could be drawn as one node each, in drawing order: (key, caption)
    units: list[tuple[str, str]] = field(default_factory=list)

    def node(self, nid: str) -> DNode:
        return next(n for n in self.nodes if n.id == nid)


class DiagramError(KestrelError, ValueError):
    pass


# ------------------------------------------------------------------------------------ building

ValueKey = tuple[int, int]  # (frame, value id in that frame's graph)


class _Builder:
    def __init__(self, report: Report, root: BlockDecl, expand: int, results: list[tuple[str, str]],
                 collapse: frozenset[str] = frozenset()) -> None:
        self.report, self.expand, self.collapse = report, expand, collapse
        self.results = results  # the entry's (name, declared type) per result
        self.decls = {b.qualname: b for b in report.blocks}
        self.order: AtomOrder = root.order
        self.d = Diagram("")
        self.producer: dict[ValueKey, str] = {}  # a value -> the drawn node that makes it
        self.alias: dict[ValueKey, ValueKey] = {}  # a callee's input -> the caller's value
        self.types: dict[ValueKey, str] = {}
        self.frames = 0

    # -- values
    def resolve(self, key: ValueKey) -> ValueKey:
        while key in self.alias:
            key = self.alias[key]
        return key

    def connect(self, key: ValueKey, to: str) -> None:
        key = self.resolve(key)
        src = self.producer.get(key)
        if src is not None:
            self.d.edges.append((src, to, self.types[key]))

    def add(self, nid: str, label: str, kind: str, cluster: str | None, detail: str = "", where: str = "") -> str:
        self.d.nodes.append(DNode(nid, label, kind, cluster, detail, where))
        return nid

    # -- one graph (the entry's, or an expanded callee's)
    def walk(self, graph: Graph, depth: int, cluster: str | None, bindings: list[Binding],
             inputs: list[ValueKey] | None, path: str = "") -> list[ValueKey]:
        frame = self.frames
        self.frames += 1

        def type_text(vid: int) -> str:
            t = graph.values[vid].type
            for b in bindings:  # innermost first: callee terms -> caller terms -> ... -> the model's
                t = b.apply(t) if isinstance(t, TensorType) else t
            return t.format(self.order) if isinstance(t, TensorType) else str(t)

        for vid in graph.values:
            self.types[(frame, vid)] = type_text(vid)
        helpers: dict[tuple, str] = {}  # helper scope prefix -> its cluster, or its collapsed node
        results: list[ValueKey] = []
        given = iter(inputs or [])
        for index, node in enumerate(graph.nodes):
            keys_in = [(frame, v) for v in node.inputs]
            if node.kind == "input":
                if inputs is not None:
                    self.alias[(frame, node.outputs[0])] = next(given)
                    continue
            if node.kind == "output":
                if inputs is not None:
                    results.append(self.resolve(keys_in[0]))
                    continue
            where_cluster, collapsed = self.place(node, depth, cluster, helpers, frame, path)
            if collapsed is not None:
                for k in keys_in:
                    self.connect(k, collapsed)
                for v in node.outputs:
                    self.producer[(frame, v)] = collapsed
                continue
            callee = self.report.graphs.get(node.callee) if node.callee else None
            # a block's own typed functions are drawn as groups at the caller's level; sub blocks one level down
            inner = depth + (node.kind == "sub")
            key = f"{path}/{index}"
            # sub block calls can be collapsed one by one; a block's own functions always show their insides
            folded = node.kind == "sub" and key in self.collapse
            if (node.kind in ("sub", "fn") and callee is not None and inner <= self.expand and len(bindings) < 16
                    and not folded):
                self.expand_call(node, callee, graph, inner, where_cluster, bindings, frame, keys_in, key)
                continue
            nid = self.add(f"n{len(self.d.nodes)}", *self.describe(node, graph, bindings), where_cluster,
                           where=_where(node))
            if folded:
                self.d.node(nid).key = key
            if node.kind in ("sub", "fn"):
                self.d.node(nid).detail = node.detail.rsplit(".", 1)[0] if node.kind == "sub" else ""
                if node.callee is not None:
                    self.d.node(nid).block = node.callee[0]
            elif node.kind == "output" and inputs is None:
                index = int(node.op[6:] or 0)
                if index < len(self.results):
                    self.d.node(nid).detail = self.results[index][1]
            for k in keys_in:
                self.connect(k, nid)
            for v in node.outputs:
                self.producer[(frame, v)] = nid
        return results

    def place(self, node: Node, depth: int, cluster: str | None, helpers: dict[tuple, str],
              frame: int, path: str = "") -> tuple[str | None, str | None]:
        """The cluster a node is drawn in, or the collapsed helper node that stands for it."""
        scope = node.scope
        for k in range(1, len(scope) + 1):
            prefix = scope[:k]
            key = f"{path}/h:" + "/".join(f"{name}@{site}" for name, site in prefix)
            if depth + k > self.expand or key in self.collapse:  # collapsed: one node for this helper call
                if prefix not in helpers:
                    helpers[prefix] = self.add(f"h{frame}_{len(helpers)}", prefix[-1][0], "helper", cluster,
                                               "helper", _where(node))
                    if depth + k <= self.expand:  # collapsed by choice: it can be expanded again
                        self.d.node(helpers[prefix]).key = key
                return cluster, helpers[prefix]
            if prefix not in helpers:
                cid = f"cluster_h{frame}_{len(helpers)}"
                caption = f"{prefix[-1][0]}  (helper)"
                self.d.clusters[cid] = Cluster(cid, caption, "helper", cluster, key=key)
                self.d.units.append((key, caption))
                helpers[prefix] = cid
            cluster = helpers[prefix]
        return cluster, None

    def describe(self, node: Node, graph: Graph, bindings: list[Binding]) -> tuple[str, str]:
        if node.kind == "input":
            return f"{node.op}", "input"
        if node.kind == "output":
            index = int(node.op[6:] or 0)
            name = self.results[index][0] if index < len(self.results) else node.op
            return name, "output"
        if node.kind == "param":
            return node.op, "param"
        if node.kind in ("sub", "fn"):
            count = self.loop_count(node, graph, bindings)
            if count is not None:
                return f"{node.op}  x {count}", "loop"
            return node.op, "call"
        return node.op, "op"

    def loop_count(self, node: Node, graph: Graph, bindings: list[Binding]) -> str | None:
        """``Layers`` for a call of ``layers[i]`` (a loop over a sub array), in the model's generics."""
        if not node.op.split(".")[0].endswith("[i]"):
            return None
        decl = self.decls.get(graph.block)
        name = node.op.split("[", 1)[0]
        sub = next((s for s in decl.subs if s.name == name), None) if decl else None
        if sub is None or sub.count is None:
            return "N"
        count = sub.count
        for b in bindings:
            count = substitute(count, b.dims)
        return format_poly(count, self.order)

    def expand_call(self, node: Node, callee: Graph, caller: Graph, depth: int, cluster: str | None,
                    bindings: list[Binding], frame: int, keys_in: list[ValueKey], key: str) -> None:
        subst = node.subst or {}
        binding = Binding(dict(subst.get("dims", {})), dict(subst.get("shapes", {})), dict(subst.get("dtypes", {})))
        count = self.loop_count(node, caller, bindings)
        cid = f"cluster_c{len(self.d.clusters)}"
        caption = f"{node.op}: {node.detail}" if node.kind == "sub" else node.op
        if count is not None:
            caption += f"   x {count}"
        block = node.callee[0] if node.callee else ""
        if node.kind == "sub":
            self.d.clusters[cid] = Cluster(cid, caption, "loop" if count is not None else "call", cluster, key, block)
            self.d.units.append((key, caption))
        else:  # the block's own function: drawn open always, its caption still opens the block's listing
            self.d.clusters[cid] = Cluster(cid, caption, "loop" if count is not None else "call", cluster,
                                           block=block)
        outs = self.walk(callee, depth, cid, [binding, *bindings], keys_in, key)
        for v, inner in zip(node.outputs, outs):
            self.alias[(frame, v)] = inner


def result_names(fn: FnDecl, decl: BlockDecl | None = None) -> list[tuple[str, str]]:
    """The entry's results as (name, declared type): named after what its ``return`` returns.

    A result's name is the variable (or attribute) the function's last ``return`` gives in that place,
    seen through indexing and arithmetic (``masks[:, 1:]`` and ``embedding + bias`` name ``masks`` and
    ``embedding``); a returned call of the block's own function or of a sub block is followed into that
    function. Where no name is found, the entry's own name stands, numbered when it has several.
    """
    items = list(fn.result.items) if isinstance(fn.result, TupleType) else [fn.result]
    order = decl.order if decl is not None else None
    types = [t.format(order) for t in items]
    names = _returned_names(fn, decl, len(items), 4)
    used: set[str] = set()
    out = []
    for i, (name, t) in enumerate(zip(names, types)):
        if name is None or name in used or name in ("self", "x", "out", "y", "output", "result"):
            name = fn.name if len(items) == 1 else f"{fn.name}.{i}"
        used.add(name)
        out.append((name, t))
    return out


def _returned_names(fn: FnDecl, decl: BlockDecl | None, count: int, depth: int) -> list[str | None]:
    return _names_in(getattr(fn.fn, "__wrapped__", fn.fn), decl, count, depth)


# CPython 3.11 (before 3.11.8) can fail ast.parse run in two threads at once ("AST constructor recursion depth
# mismatch", python/cpython#106905), and the site draws its graphs in a thread pool: one parse at a time
_PARSE_LOCK = threading.Lock()


@functools.cache
def _source_tree(func: object) -> ast.Module | None:
    """The parsed source of a function, or None where it has none."""
    try:
        source = textwrap.dedent(inspect.getsource(func))  # type: ignore[arg-type]
        with _PARSE_LOCK:
            return ast.parse(source)
    except (OSError, TypeError, SyntaxError):
        return None


def _names_in(func: object, decl: BlockDecl | None, count: int, depth: int) -> list[str | None]:
    none: list[str | None] = [None] * count
    tree = _source_tree(func)
    if tree is None:
        return none
    if not tree.body or not isinstance(tree.body[0], ast.FunctionDef | ast.AsyncFunctionDef):
        return none
    returns = [n for n in _own_nodes(tree.body[0]) if isinstance(n, ast.Return) and n.value is not None]
    if not returns:
        return none
    value = max(returns, key=lambda r: r.lineno).value  # the last return in the source
    if (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and depth > 0
            and isinstance(value.func.value, ast.Name) and value.func.value.id == "self" and decl is not None):
        callee = _callee(decl, value.func.attr)
        if callee is not None:
            inner = _names_in(callee[0], callee[1], count, depth - 1)
            if any(inner):
                return inner
    if not isinstance(value, ast.Tuple):  # one result: a plain name only (a call names its callee, not it)
        return [_value_name(value)] if count == 1 and isinstance(value, ast.Name | ast.Attribute) else none
    return [_value_name(p) for p in value.elts] if len(value.elts) == count else none


def _own_nodes(func: ast.AST) -> list[ast.AST]:
    """The function's nodes, not those of functions or classes defined inside it."""
    out, todo = [], list(ast.iter_child_nodes(func))
    while todo:
        node = todo.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef):
            continue
        out.append(node)
        todo.extend(ast.iter_child_nodes(node))
    return out


def _callee(decl: BlockDecl, attr: str) -> tuple[object, BlockDecl] | None:
    """The Python function ``self.<attr>(...)`` runs: the block's own method, or a sub block's ``forward``."""
    sub = next((s for s in decl.subs if s.name == attr), None)
    if sub is not None:
        inner = sub.block.decl()
        forward = getattr(inner.cls, "forward", None)
        return (forward, inner) if forward is not None else None
    method = getattr(decl.cls, attr, None)
    return (getattr(method, "__wrapped__", method), decl) if callable(method) else None


def _value_name(node: ast.expr) -> str | None:
    while isinstance(node, ast.Subscript | ast.Starred | ast.BinOp):
        node = node.left if isinstance(node, ast.BinOp) else node.value
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "self"):
        return node.func.attr.lstrip("_").removesuffix("_head")  # a sub block's result: named after the sub
    return None


def _where(node: Node) -> str:
    if not node.file or not node.line:
        return ""
    return f"{Path(node.file).name}:{node.line}"


def entry_diagram(root: type[Block], entry: str, expand: int = 1, report: Report | None = None,
                  collapse: frozenset[str] = frozenset()) -> Diagram:
    """The entry's graph: calls expanded as groups down to ``expand`` levels, collapsed below.

    ``collapse`` names calls (keys of ``Diagram.units``) drawn as one node although within ``expand``.
    """
    if expand < 0:
        raise DiagramError(f"--expand must be 0 or more, got {expand}")
    report = report or check_program(root)
    if report.diagnostics:
        raise DiagramError(f"{root.decl().qualname} does not type-check:\n" +
                           "\n".join(d.format() for d in report.diagnostics))
    decl = root.decl()
    names = [fn.name for fn in decl.functions]
    if entry not in names:
        raise DiagramError(f"{decl.qualname} has no entry or function {entry!r}; it has {', '.join(names)}")
    from .printer import format_signature

    fn = next(fn for fn in decl.functions if fn.name == entry)
    b = _Builder(report, decl, expand, result_names(fn, decl), frozenset(collapse))
    b.d.title = f"{decl.qualname}.{format_signature(fn, decl.order)}"
    b.walk(report.graphs[(decl.qualname, entry)], 0, None, [], None)
    _merge_runs(b.d)
    _dedupe_edges(b.d)
    return b.d


def unit_nesting(d: Diagram) -> dict[str, tuple[str | None, int]]:
    """Each unit's key -> (the key of the unit it is drawn inside, or None; how many nodes it holds)."""
    keyed = {c.id: c.key for c in d.clusters.values() if c.key}

    def enclosing(cid: str | None) -> list[str]:  # the cluster and those around it, innermost first
        out = []
        while cid is not None:
            out.append(cid)
            cid = d.clusters[cid].parent
        return out

    sizes = dict.fromkeys(keyed.values(), 0)
    for n in d.nodes:
        for cid in enclosing(n.cluster):
            if cid in keyed:
                sizes[keyed[cid]] += 1
    out: dict[str, tuple[str | None, int]] = {}
    for c in d.clusters.values():
        if c.key:
            parent = next((keyed[p] for p in enclosing(c.parent) if p in keyed), None)
            out[c.key] = (parent, sizes[c.key])
    return out


def _dedupe_edges(d: Diagram) -> None:
    seen: set[tuple[str, str, str]] = set()
    edges = []
    for e in d.edges:
        if e[0] != e[1] and e not in seen:
            seen.add(e)
            edges.append(e)
    d.edges = edges


def _merge_runs(d: Diagram, longest: int = 4) -> None:
    """A chain of ops, each the only reader of the one before and reading nothing else, becomes one node.

    ``flatten · transpose`` or ``add · pad · div``: the types inside the chain are the ops' business;
    the edges into and out of it keep theirs. Ops that take a param or a second tensor stay apart.
    """
    while True:
        outs: dict[str, int] = {}
        ins: dict[str, int] = {}
        for a, b, _ in d.edges:
            outs[a] = outs.get(a, 0) + 1
            ins[b] = ins.get(b, 0) + 1
        byid = {n.id: n for n in d.nodes}
        for i, (a, b, _) in enumerate(d.edges):
            na, nb = byid[a], byid[b]
            if (na.kind == nb.kind == "op" and na.cluster == nb.cluster and outs[a] == 1 and ins[b] == 1
                    and ins.get(a, 0) <= 1 and len((na.label + " · " + nb.label).split(" · ")) <= longest):
                na.label = f"{na.label} · {nb.label}"
                if nb.where and nb.where != na.where:
                    na.where = f"{na.where}, {nb.where}" if na.where else nb.where
                d.edges = [(a if x == b else x, y, t) for j, (x, y, t) in enumerate(d.edges) if j != i]
                d.nodes.remove(nb)
                break
        else:
            return


# ------------------------------------------------------------------------------------ rendering

@dataclass(frozen=True)
class Theme:
    background: str
    text: str
    muted: str
    edge: str
    edge_text: str
    op: str
    call: str
    io: str
    param: str
    cluster: str
    cluster_border: str
    helper: str


THEMES = {
    "light": Theme(background="#ffffff", text="#1d2430", muted="#5b6678", edge="#6b7687", edge_text="#1f5fa8",
                   op="#ffffff", call="#e6eefb", io="#e3f2e1", param="#f1f1f1", cluster="#f5f7fb",
                   cluster_border="#9aa8bb", helper="#fdf6e3"),
    "dark": Theme(background="#14181f", text="#e2e8f0", muted="#9aa5b5", edge="#8b95a5", edge_text="#7cb7ff",
                  op="#1e2430", call="#1c2b44", io="#1d3323", param="#262b33", cluster="#191f29",
                  cluster_border="#4a5668", helper="#2e2a1c"),
}
FONT = "DejaVu Sans Mono"


def _q(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _title_label(title: str) -> str:
    """The signature, one parameter a line, left-aligned (DOT escapes)."""
    head, _, rest = title.partition("(")
    params, _, result = rest.rpartition(") -> ")
    parts = _split_top(params)
    if not parts:
        return _q(title)[1:-1]
    lines = [head + "(", *(f"    {p}," for p in parts[:-1]), f"    {parts[-1]}", f") -> {result}"]
    return "".join(line.replace("\\", "\\\\").replace('"', '\\"') + "\\l" for line in lines)


def _split_top(text: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += ch in "[(<"
        depth -= ch in "])>"
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return [*out, cur.strip()] if cur.strip() else out


TOGGLES = ("[-]", "[+]")  # the marks a page's script makes into collapse and expand switches


def to_dot(d: Diagram, theme: str = "light", nodesep: float = 0.4,
           link: Callable[[str], str | None] | None = None, toggles: dict[str, int] | None = None) -> str:
    """Graphviz DOT for the diagram: clusters for groups, every edge labelled with its type.

    ``link`` maps a block's qualname to a URL: a collapsed call of that block, and a group's caption,
    then link to it (the registry site links each to the block's listing). ``toggles`` maps a call's key
    (``Diagram.units``) to its number: its group's caption then starts with ``[-]`` and its collapsed
    node with ``[+]``, and both carry ``id="kb<number>"`` for the page's script.
    """
    toggles = toggles or {}
    if theme not in THEMES:
        raise DiagramError(f"unknown theme {theme!r}; choose one of {', '.join(THEMES)}")
    th = THEMES[theme]
    out = [
        "digraph kestrel {",
        f'  graph [rankdir=TB, bgcolor="{th.background}", fontname="{FONT}", fontsize=12, fontcolor="{th.text}",'
        f' labelloc=t, labeljust=l, nodesep={nodesep}, ranksep=0.35, newrank=true, ordering=out, class="k-graph",'
        f' label="{_title_label(d.title)}"];',
        f'  node [shape=box, style="rounded,filled", fontname="{FONT}", fontsize=10, fontcolor="{th.text}",'
        f' color="{th.muted}", fillcolor="{th.op}", height=0.3, margin="0.12,0.04", class="k-op"];',
        f'  edge [fontname="{FONT}", fontsize=9, fontcolor="{th.edge_text}", color="{th.edge}", arrowsize=0.6,'
        f' class="k-edge"];',
    ]
    children: dict[str | None, list[str]] = {}
    for c in d.clusters.values():
        children.setdefault(c.parent, []).append(c.id)
    nodes_in: dict[str | None, list[DNode]] = {}
    for n in d.nodes:
        nodes_in.setdefault(n.cluster, []).append(n)

    def node_line(n: DNode, indent: str) -> str:
        attrs = {"input": f'shape=box, style="rounded,filled,bold", fillcolor="{th.io}", class="k-io"',
                 "output": f'shape=box, style="rounded,filled,bold", fillcolor="{th.io}", class="k-io"',
                 "param": f'shape=note, style=filled, fillcolor="{th.param}", fontsize=9, height=0.2, '
                          f'fontcolor="{th.muted}", margin="0.06,0.02", class="k-param"',
                 "call": f'fillcolor="{th.call}", class="k-call"',
                 "loop": f'fillcolor="{th.call}", peripheries=2, class="k-call k-loop"',
                 "helper": f'fillcolor="{th.helper}", style="rounded,filled,dashed", class="k-helper"',
                 "op": 'class="k-op"'}[n.kind]
        toggle = toggles.get(n.key) if n.key else None
        # the expand mark: its own cell, so it is a text of its own in the SVG
        mark = (f'<TD ROWSPAN="{2 if n.detail else 1}" VALIGN="MIDDLE">{TOGGLES[1]}</TD>'
                if toggle is not None else "")
        spacing = 3 if mark else 0  # room between the mark and the name (Graphviz measures bold text short)
        if n.detail:
            # a table, so each line gets its font's full height (lines of one text block would touch)
            label = (f'<<TABLE BORDER="0" CELLBORDER="0" CELLSPACING="{spacing}" CELLPADDING="1">'
                     f"<TR>{mark}<TD><B>{escape(n.label)}</B></TD></TR>"
                     f'<TR><TD><FONT POINT-SIZE="9" COLOR="{th.muted}">{escape(n.detail)}</FONT></TD></TR></TABLE>>')
        elif mark:
            label = (f'<<TABLE BORDER="0" CELLBORDER="0" CELLSPACING="{spacing}" CELLPADDING="1">'
                     f"<TR>{mark}<TD>{escape(n.label)}</TD></TR></TABLE>>")
        else:
            label = _q(n.label)
        tip = f", tooltip={_q(n.where)}" if n.where else ""
        if toggle is not None:
            tip += f', id="kb{toggle}"'

        url = link(n.block) if link is not None and n.block else None
        if url:
            tip += f", href={_q(url)}, target=\"_top\""
        return f"{indent}{n.id} [label={label}, {attrs}{tip}];"

    def emit(cluster: str | None, indent: str) -> None:
        for cid in children.get(cluster, []):
            c = d.clusters[cid]
            fill = th.helper if c.kind == "helper" else th.cluster
            style = "rounded,filled,dashed" if c.kind == "helper" else "rounded,filled"
            out.append(f"{indent}subgraph {cid} {{")
            toggle = toggles.get(c.key) if c.key else None
            url = link(c.block) if link is not None and c.block else None
            label = _q(c.caption)
            if toggle is not None or url:
                # cells: the collapse mark a text of its own, the caption a link to the block's listing
                cells = f"<TD>{TOGGLES[0]}</TD>" if toggle is not None else ""
                cells += (f'<TD HREF="{escape(url)}" TARGET="_top" TOOLTIP="{escape(c.caption)}: its listing">'
                          if url else "<TD>") + f"{escape(c.caption)}</TD>"
                label = f'<<TABLE BORDER="0" CELLBORDER="0" CELLSPACING="3" CELLPADDING="0"><TR>{cells}</TR></TABLE>>'
                if toggle is not None:
                    out.append(f'{indent}  id="kb{toggle}";')
            out.append(f'{indent}  label={label}; style="{style}"; fillcolor="{fill}"; '
                       f'color="{th.cluster_border}"; fontsize=10; fontcolor="{th.muted}"; labeljust=l; '
                       f'penwidth={2 if c.kind == "loop" else 1}; class="k-cluster k-{c.kind}";')
            emit(cid, indent + "  ")
            out.append(f"{indent}}}")
        for n in nodes_in.get(cluster, []):
            out.append(node_line(n, indent))

    emit(None, "  ")
    # the entry's inputs side by side at the top, its results at the bottom
    for rank, kind in (("min", "input"), ("max", "output")):
        ends = [n.id for n in d.nodes if n.kind == kind and n.cluster is None]
        if ends:
            out.append(f"  {{ rank={rank}; {'; '.join(ends)}; }}")
    for a, b, t in d.edges:
        out.append(f"  {a} -> {b} [label={_q(t)}];")
    out.append("}")
    return "\n".join(out) + "\n"


def theme_css(theme: str, scope: str) -> str:
    """CSS that recolours an SVG rendered in any theme to ``theme`` (for pages that switch themes).

    Graphviz writes colours as attributes; CSS rules outrank them, keyed on the classes the DOT sets (its
    SVG keeps clusters and nodes as sibling groups, so descendant selectors stay within one shape).
    """
    th = THEMES[theme]
    s = scope
    rules = {
        f"{s} .graph > polygon": f"fill: {th.background}",
        f"{s} text": f"fill: {th.text}",
        f"{s} .edge text": f"fill: {th.edge_text}",
        f"{s} .cluster text, {s} .k-param text, {s} .node text[font-size='9.00']": f"fill: {th.muted}",
        f"{s} .edge path": f"stroke: {th.edge}",
        f"{s} .edge polygon": f"fill: {th.edge}; stroke: {th.edge}",
        f"{s} .node path, {s} .node polygon, {s} .node polyline": f"stroke: {th.muted}",
        f"{s} .k-op path": f"fill: {th.op}",
        f"{s} .k-io path": f"fill: {th.io}",
        f"{s} .k-call path": f"fill: {th.call}",
        f"{s} .k-param polygon": f"fill: {th.param}",
        f"{s} .k-helper path": f"fill: {th.helper}",
        f"{s} .k-cluster path, {s} .k-cluster polygon": f"fill: {th.cluster}; stroke: {th.cluster_border}",
        f"{s} .k-cluster.k-helper path, {s} .k-cluster.k-helper polygon": f"fill: {th.helper}",
    }
    return "\n".join(f"{k} {{ {v}; }}" for k, v in rules.items()) + "\n"


def dot_command() -> str:
    """The path of Graphviz's ``dot``, or a clear error saying how to install it."""
    found = shutil.which("dot")
    if found is None:
        raise DiagramError("Graphviz's `dot` is not installed: `make setup` installs it "
                           "(or `apt-get install graphviz`)")
    return found


def _dot(dot: str, fmt: str, title: str) -> bytes:
    proc = subprocess.run([dot_command(), f"-T{fmt}"], input=dot.encode(), capture_output=True, timeout=300)
    if proc.returncode != 0:
        raise DiagramError(f"Graphviz failed on the diagram of {title}: {proc.stderr.decode(errors='replace')}")
    return proc.stdout


_TEXT = re.compile(r'<text text-anchor="(\w+)" x="([-\d.]+)" y="([-\d.]+)"[^>]*font-size="([\d.]+)"[^>]*>'
                   r"([^<]*)</text>")


def label_overlaps(svg: str) -> int:
    """How many pairs of labels in a Graphviz SVG overlap, set in DejaVu Sans Mono (0.602 em a glyph)."""
    boxes = []
    for anchor, x, y, size, text in _TEXT.findall(svg):
        w = len(unescape(text)) * float(size) * 0.602
        x0 = float(x) - (w / 2 if anchor == "middle" else w if anchor == "end" else 0)
        boxes.append((x0, float(y) - 0.78 * float(size), x0 + w, float(y) + 0.22 * float(size)))
    return sum(1 for i, a in enumerate(boxes) for b in boxes[i + 1:]
               if a[0] + 0.5 < b[2] and b[0] + 0.5 < a[2] and a[1] + 0.5 < b[3] and b[1] + 0.5 < a[3])


def render(d: Diagram, fmt: str = "svg", theme: str = "light",
           link: Callable[[str], str | None] | None = None, toggles: dict[str, int] | None = None) -> bytes:
    """Lay the diagram out with Graphviz and return the SVG or PNG bytes.

    Graphviz sizes labels with its own font metrics, and now and then sets two edge labels a few
    points into each other; the layout is then redone with more space between nodes (up to three times).
    """
    if fmt not in ("svg", "png"):
        raise DiagramError(f"unknown diagram format {fmt!r}; write .svg, .png or .dot")
    for nodesep in (0.4, 0.55, 0.75):
        dot = to_dot(d, theme, nodesep, link, toggles)
        svg = _dot(dot, "svg", d.title)
        if not label_overlaps(svg.decode()):
            break
    return svg if fmt == "svg" else _dot(dot, fmt, d.title)


def write_diagram(d: Diagram, path: Path, theme: str = "light") -> None:
    """Write ``.svg``, ``.png`` or ``.dot`` by the file's suffix (atomically)."""
    suffix = path.suffix.lower()
    if suffix == ".dot":
        data = to_dot(d, theme).encode()
    elif suffix in (".svg", ".png"):
        data = render(d, suffix[1:], theme)
    else:
        raise DiagramError(f"{path}: write a .svg, .png or .dot file (got {suffix or 'no suffix'!r})")
    from ..runtime.output import write_bytes

    write_bytes(path, data)


__all__ = ["THEMES", "TOGGLES", "Cluster", "DNode", "Diagram", "DiagramError", "entry_diagram", "render",
           "result_names", "theme_css", "to_dot", "unit_nesting", "write_diagram"]
