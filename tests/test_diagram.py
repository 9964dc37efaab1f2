"""Entry diagrams: the checker's graph laid out by Graphviz, every edge labelled with its type."""

from __future__ import annotations

import shutil

import pytest

from kestrel.checker.check import check_program
from kestrel.cli.main import main
from kestrel.inspect.diagram import DiagramError, entry_diagram, render, to_dot
from kestrel.models import dinov2, sam, siglip, vit
from svgcheck import edges, overlapping, text_boxes

needs_dot = pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz `dot` is not installed (make setup)")


def _labels(d):
    return [n.label for n in d.nodes]


def test_vit_forward_expands_one_level_with_model_level_types():
    d = entry_diagram(vit.Model, "forward")
    assert d.node(d.edges[0][0]).kind in ("input", "param")
    assert [n.label for n in d.nodes if n.kind == "input"] == ["image"]
    assert [n.label for n in d.nodes if n.kind == "output"] == ["result"]
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
    captions = {c.caption for c in d.clusters.values()}
    # calls into untyped helpers are grouped under the helper's name, not spilled as ops
    assert {"_fourier  (helper)", "_decode  (helper)"} <= captions
    assert "mask_decoder: MaskDecoder<Hd, MaskHeads, MaskInner, T>.forward" in captions
    nested = [n.label for n in d.nodes if n.kind == "helper"]
    assert "_image_pe" in nested and "per_prompt" in nested  # helpers a level down are one node each
    # the transformer is one node, its two-way layers are not drawn
    assert "transformer" in _labels(d) and "layer_0.forward_first" not in _labels(d)
    # params are side inputs
    assert {"not_a_point_embed", "point_embed_0", "point_embed_1", "positional_embedding"} <= {
        n.label for n in d.nodes if n.kind == "param"}
    # the ops recorded for the entry are far more than the boxes drawn
    recorded = sum(len(g.nodes) for g in report.graphs.values())
    assert len(d.nodes) < 70 < recorded
    types = {t for _, _, t in d.edges}
    assert "Tensor[B, Pts, 4, 256, 256; T]" in types and "Tensor[B, Pts, 1 + N, Hd; T]" in types


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


def test_checker_records_the_untyped_helper_of_every_node():
    report = check_program(sam.Model)
    dp = report.graphs[("sam::Model", "decode_points")]
    scopes = {tuple(name for name, _ in n.scope) for n in dp.nodes}
    assert {(), ("_fourier",), ("_decode",), ("_decode", "_image_pe"), ("_decode", "_image_pe", "_fourier")} <= scopes
    assert next(n for n in dp.nodes if n.kind == "sub").scope[0][0] == "_decode"  # the mask decoder call
    # three calls of one local helper are three scopes (told apart by their call sites), in order
    attn = report.graphs[("sam::MaskAttention", "forward")]
    calls = list(dict.fromkeys(n.scope for n in attn.nodes if n.scope))
    assert [c[0][0] for c in calls] == ["heads", "heads", "heads"] and len(set(calls)) == 3
    assert all(not n.scope for n in attn.nodes if n.kind == "sub")  # q_proj(...) is called outside heads()
