"""Entry diagrams: one level expanded, every edge labelled with its type in the model's own generics."""

from __future__ import annotations

import pytest

from kestrel.cli.main import main
from kestrel.inspect.diagram import DiagramError, entry_diagram, to_dot
from kestrel.models import dinov2, vit


def test_vit_features_edges_carry_model_level_types():
    d = entry_diagram(vit.Model, "features")
    labels = [n.label for n in d.nodes]
    assert labels[0] == "input image" and labels[-1] == "output"
    # the layer body is expanded: its ops appear, framed as one group for every layer
    assert any(c.startswith("layers[i]: EncoderLayer<D, Heads, Inner, T>.forward") for c in d.groups.values())
    types = {t for _, _, t in d.edges}
    # the layer's own N is shown as the model's token count, its Inner as the model's Inner
    assert "Tensor[B, 1 + (Height / Patch) * (Width / Patch), Inner; T]" in types
    assert "Tensor[B, D, Height / Patch, Width / Patch; T]" in types  # inside self.embed
    # every edge connects nodes that exist, going forward
    assert all(0 <= a < b < len(d.nodes) for a, b, _ in d.edges)


def test_dot_and_svg_from_the_cli(tmp_path, capsys):
    out = tmp_path / "dino.svg"
    assert main(["diagram", "dinov2-base", "-o", str(out)]) == 0
    svg = out.read_text()
    assert svg.startswith("<svg") and "Tensor[B, 1 + (Height / Patch) * (Width / Patch), D; T]" in svg
    dot = to_dot(entry_diagram(dinov2.Model, "forward"))
    assert dot.startswith("digraph") and "cluster_" in dot


def test_unknown_entry_is_a_clear_error(capsys):
    with pytest.raises(DiagramError, match="no entry or function 'decode'"):
        entry_diagram(vit.Model, "decode")
    assert main(["diagram", "vit-base-patch16-224", "--entry", "decode", "-o", "/tmp/x.svg"]) == 2
