"""Inheritable blocks and layouts from data: merging along the bases, printing, checking, state_dict paths."""

from typing import Any, ClassVar

import pytest
import torch

from kestrel.blocks import (
    BindError,
    Block,
    DeclarationError,
    Dim,
    Float,
    Layers,
    Param,
    Runs,
    each,
    entry,
    f32,
    runs,
    variant,
)
from kestrel.blocks.block import REGISTRY
from kestrel.checker.check import check_block_class, check_program
from kestrel.inspect.printer import format_block, listed_blocks
from kestrel.models import dinov2, siglip, vit
from kestrel.std import ops
from kestrel.std.nn import Linear, transformer


class Scale(Block, module="inherit"):
    D: Dim
    T: Float
    gain: float = 2.0
    where = "D > 1"

    weight: Param["D; T"]

    def forward(self, x: "Tensor[B, D; T]") -> "Tensor[B, D; T]":
        return x * self.weight * self.gain

    def double(self, x: "Tensor[B, D; T]") -> "Tensor[B, D; T]":
        return x + x


class Shifted(Scale, module="inherit"):
    """Adds a bias, a generic and a fact; overrides the setting and ``forward``."""

    K: Dim
    gain: float = 3.0
    where = "D % K == 0"

    bias: Param["D; T"]

    def forward(self, x: "Tensor[B, D; T]") -> "Tensor[B, D; T]":
        return x * self.weight * self.gain + self.bias


class _Projector(Block, abstract=True):
    """A base that leaves ``Out`` to its subclasses: never listed, never bound itself."""

    D: Dim
    T: Float

    proj: Linear["D, D, T"]

    def forward(self, x: "Tensor[B, D; T]") -> "Tensor[B, D; T]":
        return self.proj(x)


class GoodProjector(_Projector, module="inherit"):
    pass


class WideProjector(_Projector, module="inherit"):
    proj: Linear["D, 2 * D, T"]  # the inherited forward no longer returns its declared type


def test_members_generics_settings_merge_along_the_bases():
    d = Shifted.decl()
    assert [g.name for g in d.generics] == ["D", "T", "K"]
    assert [m.name for m in d.members] == ["weight", "bias"]
    assert [f.pyname for f in d.functions] == ["forward", "double"]  # the override stays in the base's place
    assert d.function("forward").fn is Shifted.__dict__["forward"]
    assert d.function("double").fn is Scale.__dict__["double"]
    assert d.settings == {"gain": 3.0} and Scale.decl().settings == {"gain": 2.0}
    assert d.qualname == "inherit::Shifted"


def test_where_adds_to_the_bases():
    assert {str(f) for f in Shifted.decl().where} >= {str(f) for f in Scale.decl().where}
    Shifted(D=4, K=2, T=f32)
    with pytest.raises(BindError, match=r"where D % K == 0"):
        Shifted(D=4, K=3, T=f32)
    with pytest.raises(BindError, match="D"):
        Shifted(D=1, K=1, T=f32)  # the base's fact still holds


def test_overridden_forward_and_setting_run():
    m = Shifted(D=4, K=2, T=f32)
    with torch.no_grad():
        m.weight.fill_(1.0)
        m.bias.fill_(0.5)
    x = torch.ones(2, 4)
    assert torch.equal(m(x), torch.full((2, 4), 3.5))
    assert torch.equal(m.double(x), torch.full((2, 4), 2.0))


def test_state_dict_paths_are_the_merged_members():
    assert list(Shifted(D=4, K=2, T=f32).state_dict()) == ["weight", "bias"]
    assert list(vit.Attention(D=8, Heads=2, T=f32).state_dict()) == [
        f"{p}.{w}" for p in ("query", "key", "value", "out") for w in ("weight", "bias")]


def test_inherited_blocks_print_under_their_own_module():
    assert format_block(vit.LayerNorm.decl()).splitlines()[0] == "vit::LayerNorm<D: Dim, T: Float>"
    assert vit.LayerNorm.decl().settings == {"eps": 1e-12} and siglip.LayerNorm.decl().settings == {"eps": 1e-6}
    for module, cls in (("vit", vit.Attention), ("siglip", siglip.Attention), ("dinov2", dinov2.Attention)):
        text = format_block(cls.decl())
        assert text.splitlines()[0] == f"{module}::Attention<D: Dim, Heads: Dim, T: Float>"
        base = format_block(transformer.SelfAttention.decl()).split("\n", 1)[1]
        assert text.split("\n", 1)[1].startswith(base)  # then what a subclass adds (vit: first_query)
    # the shared base lives in its own module, which no seed program lists
    assert "std.nn.transformer::SelfAttention" not in {b.qualname for b in listed_blocks(vit.Model)}


def test_abstract_bases_are_not_listed():
    assert _Projector not in REGISTRY.get("test_block_inheritance", [])
    assert GoodProjector in REGISTRY["inherit"]


def test_checker_proves_inherited_functions_for_the_subclass():
    assert check_block_class(GoodProjector).ok
    report = check_block_class(WideProjector)
    assert not report.ok
    diag = report.diagnostics[0]
    assert diag.file.endswith("test_block_inheritance.py") and "2 * D" in str(diag)


def test_an_untyped_override_of_a_typed_function_is_refused():
    class Bare(Scale, module="inherit.bare"):
        def forward(self, x):
            return x

    with pytest.raises(DeclarationError, match="overrides a typed function without its types"):
        Bare.decl()


# --------------------------------------------------------------------------------------------- layouts


class Step(Block, module="inherit"):
    D: Dim
    K: Dim
    T: Float
    where = "K > 0"

    weight: Param["D, D; T"]

    def forward(self, x: "Tensor[B, D; T]") -> "Tensor[B, D; T]":
        return ops.matmul(x, self.weight)


class Stack(Block, module="inherit"):
    D: Dim
    T: Float = f32
    layout: ClassVar[dict[str, Any]] = {"first": "a", "layer": ("a", "b"), "run": ("a", "a", "b")}

    first: Layers[{"a": Step["D, 1, T"], "b": Step["D, 2, T"]}]
    layer: Layers[{"a": Step["D, 1, T"], "b": Step["D, 2, T"]}]
    run: Runs[{"a": Step["D, 1, T"], "b": Step["D, 2, T"]}]

    @entry
    def forward(self, x: "Tensor[B, D; T]") -> "Tensor[B, D; T]":
        x = self.first(x)
        for layer in each(self, "layer"):
            x = layer(x)
        for group in runs(self, "run"):
            for layer in group:
                x = layer(x)
        return x


def test_a_layout_expands_into_typed_subs():
    text = format_block(Stack.decl())
    assert text.splitlines()[1:6] == [
        "  sub first: Step<D, 1, T>", "  sub layer_0: Step<D, 1, T>", "  sub layer_1: Step<D, 2, T>",
        "  sub run_0: [Step<D, 1, T>; 2]", "  sub run_1: [Step<D, 2, T>; 1]"]
    assert check_program(Stack).ok
    keys = list(Stack(D=3).state_dict())
    assert keys == ["first.weight", "layer_0.weight", "layer_1.weight", "run_0.0.weight", "run_0.1.weight",
                    "run_1.0.weight"]


def test_a_variant_lays_out_otherwise_and_prints_as_its_base():
    assert variant(Stack, layout={"run": ("a", "a", "b")}) is Stack  # nothing differs
    other = variant(Stack, layout={"layer": (), "run": ("b", "a", "a", "a")})
    assert other is variant(Stack, layout={"layer": [], "run": ["b", "a", "a", "a"]})
    assert other.decl().qualname == "inherit::Stack" and issubclass(other, Stack)
    assert other not in REGISTRY["inherit"]
    assert [m.name for m in other.decl().members] == ["first", "run_0", "run_1"]
    assert check_program(other).ok
    m = other(D=3)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.eye(3) * 2)
    assert torch.equal(m(torch.ones(1, 3)), torch.full((1, 3), 2.0 ** 5))
    assert [b.qualname for b in listed_blocks(other)].count("inherit::Stack") == 1


def test_a_layout_kind_must_be_declared():
    bad = variant(Stack, layout={"layer": ("a", "c")})
    with pytest.raises(DeclarationError, match="layout kind 'c' is not one of a, b"):
        bad.decl()
    with pytest.raises(BindError, match="no sub 'nope'"):
        variant(Stack, subs={"nope": Step})
