"""Entry diagrams: the checker's graph laid out by Graphviz, every edge labelled with its type."""

from __future__ import annotations

import shutil

import pytest

from kestrel.blocks import Array, Block, Dim, Float, Param, entry, f32
from kestrel.checker.check import check_program
from kestrel.cli.main import main
from kestrel.inspect.diagram import DiagramError, entry_diagram, render, to_dot
from kestrel.models import dinov2, sam, siglip, vit
from kestrel.std.nn import Linear
from svgcheck import edges, overlapping, text_boxes

needs_dot = pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz `dot` is not installed (make setup)")


def _labels(d):
    return [n.label for n in d.nodes]


def test_vit_forward_expands_one_level_with_model_level_types():
    d = entry_diagram(vit.Model, "forward")
    assert d.node(d.edges[0][0]).kind in ("input", "param")
    assert [n.label for n in d.nodes if n.kind == "input"] == ["image"]
    # the result is named (after the entry, its return being a call) and carries its declared type
    assert [(n.label, n.detail) for n in d.nodes if n.kind == "output"] == [
        (fn.name, fn.result.format(vit.Model.decl().order)) for fn in vit.Model.decl().entries if fn.name == "forward"]
    # the layer loop is one group, marked with its count in the model's generics
    loops = [c for c in d.clusters.values() if c.kind == "loop"]
    assert [c.caption for c in loops] == ["layers[i]: EncoderLayer<D, Heads, Inner, T>.forward   x Layers"]
    inside = [n for n in d.nodes if n.cluster == loops[0].id]
    # one level expanded: the layer's subs are single nodes, their bodies are not drawn
    assert {n.label for n in inside if n.kind == "call"} == {"norm_before", "attention", "norm_after", "up", "down"}
    types = {t for _, _, t in d.edges}
    # the layer's own N is shown as the model's token count, its Inner as the model's Inner
    assert "Tensor[B, 1 + (Height / Patch) * (Width / Patch), Inner; T]" in types
    assert "Tensor[B, D, Height / Patch, Width / Patch; T]" in types  # inside self.embed
    # every edge joins drawn nodes
    ids = {n.id for n in d.nodes}
    assert all(a in ids and b in ids for a, b, _ in d.edges)


def test_expand_zero_collapses_every_block_call():
    d = entry_diagram(vit.Model, "forward", expand=0)
    assert not [c for c in d.clusters.values() if c.kind in ("call", "loop")] or all(
        c.caption.startswith("self.") for c in d.clusters.values())
    assert any(n.kind == "loop" and n.label == "layers[i]  x Layers" for n in d.nodes)
    deeper = entry_diagram(vit.Model, "forward", expand=2)
    assert len(deeper.nodes) > len(entry_diagram(vit.Model, "forward").nodes) > len(d.nodes)


def test_sam_decode_points_groups_helpers_and_stays_small():
    report = check_program(sam.Model)
    d = entry_diagram(sam.Model, "decode_points", report=report)
    graph = report.graphs[("sam::Model", "decode_points")]
    captions = {c.caption for c in d.clusters.values()}
    # calls into untyped helpers are grouped under the helper's name, not spilled as ops: the entry's own
    # helpers as groups, the helpers they call as one node each
    outer = {n.scope[0][0] for n in graph.nodes if n.scope}
    inner = {n.scope[1][0] for n in graph.nodes if len(n.scope) > 1}
    assert outer and inner
    assert {f"{h}  (helper)" for h in outer} <= captions
    assert inner <= {n.label for n in d.nodes if n.kind == "helper"}
    # the mask decoder is expanded one level: its transformer is one node, whose layers are not drawn
    call = next(n for n in graph.nodes if n.op == "mask_decoder")
    assert f"mask_decoder: {call.detail}" in captions
    assert "transformer" in _labels(d) and not any(label.startswith("layer_") for label in _labels(d))
    assert {n.label for n in d.nodes if n.kind == "param"} >= {"point_embed_0", "point_embed_1"}
    # far fewer boxes than the ops the checker recorded for the program
    recorded = sum(len(g.nodes) for g in report.graphs.values())
    assert len(d.nodes) < 70 < recorded
    types = {t for _, _, t in d.edges}
    assert {"Tensor[B, Pts, 4, 256, 256; T]", "Tensor[B, Pts, 4; T]", "Tensor[B, Hd, 64, 64; T]"} <= types


class Helpers(Block, module="test.diagram"):
    """A block whose entry calls untyped helpers: a method that calls another, and a local function twice."""

    D: Dim
    Layers: Dim
    T: Float = f32

    scale: Param["D; T"]
    layers: Array[Linear["D, D, T"], "Layers"]
    proj: Linear["D, D, T"]

    @entry
    def forward(self, x: "Tensor[B, N, D; T]") -> "Tensor[B, N, D; T]":
        def twice(t):
            return t + t

        y = twice(self._prepare(x))
        y = twice(y)
        for layer in self.layers:
            y = layer(y)
        return self.proj(y)

    def _prepare(self, x):
        return self._scaled(x) * 2.0

    def _scaled(self, x):
        return x * self.scale


def test_checker_records_the_untyped_helper_of_every_node():
    report = check_program(Helpers)
    assert report.ok, [str(x) for x in report.diagnostics]
    graph = report.graphs[("test.diagram::Helpers", "forward")]
    rows = [(n.kind, n.op, tuple(name for name, _ in n.scope)) for n in graph.nodes
            if n.kind not in ("input", "output")]
    assert rows == [("param", "scale", ("_prepare", "_scaled")), ("op", "mul", ("_prepare", "_scaled")),
                    ("op", "mul", ("_prepare",)), ("op", "add", ("twice",)), ("op", "add", ("twice",)),
                    ("sub", "layers[i]", ()), ("sub", "proj", ())]
    first, second = (n.scope for n in graph.nodes if n.op == "add")
    assert first != second  # two calls of one helper: two scopes, told apart by their call sites


def test_helpers_loops_and_levels_in_a_small_block():
    d = entry_diagram(Helpers, "forward")
    by_caption = {c.caption: c for c in d.clusters.values()}
    assert set(by_caption) == {"_prepare  (helper)", "layers[i]: Linear<D, D, T>.forward   x Layers",
                               "proj: Linear<D, D, T>.forward", "twice  (helper)"}
    assert [c.caption for c in d.clusters.values()].count("twice  (helper)") == 2
    assert by_caption["layers[i]: Linear<D, D, T>.forward   x Layers"].kind == "loop"
    scaled = next(n for n in d.nodes if n.label == "_scaled")  # a helper's helper: one node, in its group
    assert scaled.kind == "helper" and scaled.cluster == by_caption["_prepare  (helper)"].id
    assert {t for _, _, t in d.edges} == {"Tensor[B, N, D; T]", "Tensor[D; T]", "Tensor[D, D; T]"}
    flat = entry_diagram(Helpers, "forward", expand=0)
    assert {n.label for n in flat.nodes if n.kind in ("loop", "call", "helper")} == {
        "layers[i]  x Layers", "proj", "_prepare", "twice"}
    assert not flat.clusters


@needs_dot
@pytest.mark.parametrize(("model", "entry"), [(sam.Model, "decode_points"), (vit.Model, "forward"),
                                             (siglip.Model, "image_features")])
def test_svg_labels_never_overlap_and_every_edge_has_its_type(model, entry):
    d = entry_diagram(model, entry)
    svg = render(d, "svg").decode()
    boxes = text_boxes(svg)
    assert len(boxes) > len(d.nodes)
    clash = overlapping(boxes)
    assert not clash, "overlapping labels: " + "; ".join(f"{a.text!r} / {b.text!r}" for a, b in clash[:5])
    drawn = edges(svg)
    assert len(drawn) == len(d.edges)
    assert all(len(texts) == 1 and texts[0].startswith("Tensor[") for _, texts in drawn)
    # the labels are the checker's types of those values, edge by edge
    ids = {n.id: n for n in d.nodes}
    assert sorted(t[0] for _, t in drawn) == sorted(t for _, _, t in d.edges)
    assert all(a in ids for a, _, _ in d.edges)


@needs_dot
def test_svg_png_dot_and_theme_from_the_cli(tmp_path):
    svg, png, dot = tmp_path / "a" / "dino.svg", tmp_path / "dino.png", tmp_path / "dino.dot"
    assert main(["diagram", "dinov2-base", "-o", str(svg)]) == 0
    text = svg.read_text()
    assert "<svg" in text and "Tensor[B, 1 + (Height / Patch) * (Width / Patch), D; T]" in text
    assert main(["diagram", "dinov2-base", "--theme", "dark", "-o", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["diagram", "dinov2-base", "--expand", "0", "-o", str(dot)]) == 0
    assert dot.read_text().startswith("digraph") and "#14181f" not in dot.read_text()
    assert "#14181f" in to_dot(entry_diagram(dinov2.Model, "forward"), "dark")


def test_unknown_entry_or_format_is_a_clear_error(tmp_path):
    with pytest.raises(DiagramError, match="no entry or function 'decode'"):
        entry_diagram(vit.Model, "decode")
    assert main(["diagram", "vit-base-patch16-224", "--entry", "decode", "-o", str(tmp_path / "x.svg")]) == 2
    assert main(["diagram", "vit-base-patch16-224", "-o", str(tmp_path / "x.pdf")]) == 2
    assert not (tmp_path / "x.pdf").exists()



def test_results_are_named_after_what_the_entry_returns():
    from kestrel.inspect.diagram import result_names

    decl = sam.Model.decl()
    fn = next(f for f in decl.entries if f.name == "decode_points")
    # decode_points returns self._decode(...), which returns the mask decoder's (masks, iou_prediction_head(...))
    assert result_names(fn, decl) == [("masks", "Tensor[B, Pts, 4, 256, 256; T]"),
                                      ("iou_prediction", "Tensor[B, Pts, 4; T]")]
    d = entry_diagram(sam.Model, "decode_points")
    outputs = [n for n in d.nodes if n.kind == "output"]
    assert [n.label for n in outputs] == ["masks", "iou_prediction"]
    assert not any(n.label.startswith("result") for n in outputs)


def test_each_group_collapses_alone_by_its_key():
    from kestrel.inspect.diagram import unit_nesting

    d = entry_diagram(Helpers, "forward")
    captions = dict(d.units)
    assert sorted(captions.values()) == sorted(c.caption for c in d.clusters.values())
    proj = next(k for k, c in captions.items() if c.startswith("proj:"))
    one = entry_diagram(Helpers, "forward", collapse=frozenset([proj]))
    folded = [n for n in one.nodes if n.key == proj]
    assert [(n.label, n.kind, n.block) for n in folded] == [("proj", "call", "std.nn.linear::Linear")]
    assert len(one.clusters) == len(d.clusters) - 1  # the other groups stay open
    # the keys name the same calls whatever else is collapsed; all of them collapsed is --expand 0
    assert dict(one.units).keys() <= captions.keys()
    every = entry_diagram(Helpers, "forward", collapse=frozenset(captions))
    flat = entry_diagram(Helpers, "forward", expand=0)
    assert sorted(n.label for n in every.nodes) == sorted(n.label for n in flat.nodes) and not every.clusters
    assert all(parent is None and size >= 1 for parent, size in unit_nesting(d).values())
