"""Issue 21's examples, each as a planted error (refused at its file and line) and a correct program (accepted).

Every refused statement carries a ``# planted: NAME`` comment; the tests look its line up in this file.
"""

from __future__ import annotations

import os

import pytest
import torch

from kestrel.blocks import Array, Block, Dim, Float, Int, Param, Shape, bf16, f32, optional
from kestrel.checker.check import Diagnostic, check_block_class, check_program
from kestrel.std import ops
from kestrel.std.nn import Linear

HERE = os.path.abspath(__file__)
with open(HERE) as _f:
    SOURCE = _f.read().splitlines()


def line_of(name: str) -> int:
    hits = [i + 1 for i, text in enumerate(SOURCE) if text.rstrip().endswith(f"# planted: {name}")]
    assert len(hits) == 1, name
    return hits[0]


def refused(cls: type[Block], name: str, *words: str) -> Diagnostic:
    """The block is refused with one diagnostic at the planted line, saying each of ``words``."""
    report = check_block_class(cls)
    assert len(report.diagnostics) == 1, [str(d) for d in report.diagnostics]
    d = report.diagnostics[0]
    assert d.file is not None and os.path.abspath(d.file) == HERE, str(d)
    assert d.line == line_of(name), (d.line, line_of(name), str(d))
    for w in words:
        assert w in d.message, (w, d.message)
    return d


def accepted(cls: type[Block]) -> None:
    report = check_block_class(cls)
    assert report.ok, "\n".join(map(str, report.diagnostics))


# --------------------------------------------------------------------------------------- the prover


class PoolUp(Block, module="t.lang"):
    """where K > 1, H >= K: a 2x2 max-pool and a 2x upsampling do not give H rows back for odd H."""

    H: Dim
    K: Dim
    T: Float = f32
    where = "K > 1, H >= K"

    def forward(self, x: "Tensor[B, C, H, H; T]") -> "Tensor[B, C, H, H; T]":
        return ops.interpolate(ops.max_pool2d(x, 2), scale_factor=2, mode="nearest")  # planted: pool_up


class PoolUpEven(Block, module="t.lang"):
    H: Dim
    T: Float = f32
    where = "H > 0, H % 2 == 0"

    def forward(self, x: "Tensor[B, C, H, H; T]") -> "Tensor[B, C, H, H; T]":
        return ops.interpolate(ops.max_pool2d(x, 2), scale_factor=2, mode="nearest")


class CropToH(Block, module="t.lang"):
    H: Dim
    K: Dim
    T: Float = f32
    where = "K > 1, H >= K"

    def forward(self, x: "Tensor[B, C, H, H; T]") -> "Tensor[B, C, H, H; T]":
        y = ops.interpolate(ops.max_pool2d(x, 2), scale_factor=2, mode="nearest")
        return y[:, :, :self.H, :self.H]  # planted: crop


def test_a_false_inequality_is_not_proved_and_the_counterexample_is_shown():
    d = refused(PoolUp, "pool_up", "2 * (H / 2)", "declared H", "at H = ")
    h = int(d.message.split("at H = ")[1].split(":")[0].split(",")[0])
    assert h % 2 == 1  # an odd H: the counterexample is real
    y = torch.nn.functional.interpolate(torch.nn.functional.max_pool2d(torch.zeros(1, 1, h, h), 2), scale_factor=2)
    assert y.shape[-1] == h - 1  # and torch agrees: one row short
    refused(CropToH, "crop", "slice stop H")
    accepted(PoolUpEven)


class CeilPad(Block, module="t.lang"):
    """Pad W up to a multiple of Win (SAM's windows), then fold the windows."""

    Win: Dim
    T: Float = f32
    where = "Win > 0"

    def forward(self, x: "Tensor[B, W, C; T]") -> "Tensor[B, (W + Win - 1) / Win, Win, C; T]":
        B, W, C = x.shape
        n = (W + self.Win - 1) // self.Win
        x = ops.pad(x, [0, 0, 0, self.Win * n - W])
        return x.reshape(B, n, self.Win, C)


class FloorPad(Block, module="t.lang"):
    Win: Dim
    T: Float = f32
    where = "Win > 0"

    def forward(self, x: "Tensor[B, W, C; T]") -> "Tensor[B, W / Win, Win, C; T]":
        B, W, C = x.shape
        x = ops.pad(x, [0, 0, 0, self.Win * (W // self.Win) - W])  # planted: floor_pad
        return x.reshape(B, W // self.Win, self.Win, C)


def test_ceiling_division_padding_is_proved_and_floor_padding_refused():
    accepted(CeilPad)
    refused(FloorPad, "floor_pad", "padding", "nonnegative")


# -------------------------------------------------------------------------------- the closed language


class Stack(Block, module="t.lang"):
    D: Dim
    N: Dim
    T: Float = f32
    where = "N > 0"

    layers: Array[Linear["D, D, T"], "N"]

    def forward(self, x: "Tensor[B, D; T]") -> "Tensor[N, B, D; T]":
        return ops.stack([layer(x) for layer in self.layers])  # planted: comprehension


class Chain(Block, module="t.lang"):
    D: Dim
    N: Dim
    T: Float = f32

    layers: Array[Linear["D, D, T"], "N"]

    def forward(self, x: "Tensor[B, D; T]") -> "Tensor[B, D; T]":
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_comprehension_over_a_sub_array_is_refused():
    refused(Stack, "comprehension", "comprehension", "write a for loop")
    accepted(Chain)


class DropFirst(Block, module="t.lang"):
    D: Dim
    N: Dim
    T: Float = f32

    layers: Array[Linear["D, D, T"], "N"]

    def forward(self, x: "Tensor[B, S, D; T]") -> "Tensor[B, S, D; T]":
        for i, layer in enumerate(self.layers):  # planted: index
            if i > 0:
                x = x[:, 1:]
            x = layer(x)
        return x


class Carried(Block, module="t.lang"):
    D: Dim
    N: Dim
    T: Float = f32

    layers: Array[Linear["D, D, T"], "N"]

    def forward(self, x: "Tensor[B, D; T]") -> "Tensor[B, D; T]":
        scale = 1
        for layer in self.layers:  # planted: carried
            x = layer(x) * scale
            scale *= 2
        return x


class CarriedCell(Block, module="t.lang"):
    D: Dim
    N: Dim
    T: Float = f32

    layers: Array[Linear["D, D, T"], "N"]

    def forward(self, x: "Tensor[B, S, D; T]") -> "Tensor[B, S, D; T]":
        cut = [0]
        for layer in self.layers:  # planted: cell
            x = layer(x)[:, cut[0]:]
            cut[0] = 1
        return x


class Breaks(Block, module="t.lang"):
    D: Dim
    N: Dim
    T: Float = f32

    layers: Array[Linear["D, D, T"], "N"]

    def forward(self, x: "Tensor[B, D; T]") -> "Tensor[B, D; T]":
        for layer in self.layers:  # planted: break
            x = layer(x)
            break
        return x


class ScaledChain(Block, module="t.lang"):
    D: Dim
    N: Dim
    T: Float = f32

    layers: Array[Linear["D, D, T"], "N"]

    def forward(self, x: "Tensor[B, D; T]") -> "Tensor[B, D; T]":
        scale = 2
        for layer in self.layers:
            x = layer(x) * scale
        return x


def test_layer_loops_refuse_what_one_iteration_cannot_stand_for():
    refused(DropFirst, "index", "index i")
    refused(Carried, "carried", "carries the Python value scale")
    refused(CarriedCell, "cell", "changes an item of cut")
    refused(Breaks, "break", "break inside the loop over layers")
    accepted(ScaledChain)


class Swallow(Block, module="t.lang"):
    D: Dim
    T: Float = f32

    def forward(self, x: "Tensor[B, D; T]") -> "Tensor[B, D; T]":
        try:  # planted: try
            x = x[:, 1:]
        except Exception:
            pass
        return x


class Loops(Block, module="t.lang"):
    D: Dim
    T: Float = f32

    def forward(self, x: "Tensor[B, D; T]") -> "Tensor[B, D; T]":
        k = 0
        while k < 2:  # planted: while
            k += 1
        return x


class DtypeBranch(Block, module="t.lang"):
    D: Dim
    T: Float = f32

    def forward(self, x: "Tensor[B, D; T]") -> "Tensor[B, D; T]":
        if self.T == bf16:  # planted: dtype
            return ops.cast(x, f32)
        return x


class Unguarded(Block, module="t.lang"):
    D: Dim
    T: Float = f32

    bias: Param["D; T", optional]

    def forward(self, x: "Tensor[B, D; T]") -> "Tensor[B, D; T]":
        return x + self.bias  # planted: optional


class Guarded(Block, module="t.lang"):
    D: Dim
    T: Float = f32

    bias: Param["D; T", optional]

    def forward(self, x: "Tensor[B, D; T]") -> "Tensor[B, D; T]":
        if self.bias is not None:
            x = x + self.bias
        return x


class OneTuple(Block, module="t.lang"):
    D: Dim
    T: Float = f32

    def forward(self, x: "Tensor[B, D; T]") -> "Tensor[B, D; T]":  # planted: one_tuple
        return (x,)


class Plain(Block, module="t.lang"):
    D: Dim
    T: Float = f32

    def forward(self, x: "Tensor[B, D; T]") -> "Tensor[B, D; T]":
        return ops.relu(x)


def test_python_outside_the_language_is_refused_by_name():
    refused(Swallow, "try", "try statement")
    refused(Loops, "while", "while loop")
    refused(DtypeBranch, "dtype", "dtype generic T")
    refused(Unguarded, "optional", "optional param bias absent")
    refused(OneTuple, "one_tuple", "1-tuple", "Tensor[B, D; T]")
    accepted(Guarded)
    accepted(Plain)


# -------------------------------------------------------------------------------------------- op rules


class AttnBatch(Block, module="t.lang"):
    T: Float = f32

    def forward(self, q: "Tensor[B, N, E; T]", k: "Tensor[B, M, E; T]",
                v: "Tensor[C, M, E; T]") -> "Tensor[B, N, E; T]":
        return ops.attention(q, k, v)  # planted: attn_v


class AttnBias(Block, module="t.lang"):
    T: Float = f32

    def forward(self, q: "Tensor[B, N, E; T]", k: "Tensor[B, M, E; T]", v: "Tensor[B, M, E; T]",
                bias: "Tensor[G, B, N, M; T]") -> "Tensor[B, N, E; T]":
        return ops.attention(q, k, v, bias=bias)  # planted: attn_bias


class AttnOk(Block, module="t.lang"):
    T: Float = f32

    def forward(self, q: "Tensor[B, N, E; T]", k: "Tensor[B, M, E; T]", v: "Tensor[B, M, F; T]",
                bias: "Tensor[N, M; T]") -> "Tensor[B, N, F; T]":
        return ops.attention(q, k, v, bias=bias)


class NormWeight(Block, module="t.lang"):
    D: Dim
    T: Float = f32

    weight: Param["D, 2; T"]

    def forward(self, x: "Tensor[B, D; T]") -> "Tensor[B, D; T]":
        return ops.rms_norm(x, self.weight)  # planted: rms_weight


class LayerNormWeight(Block, module="t.lang"):
    D: Dim
    T: Float = f32

    weight: Param["D, 2; T"]

    def forward(self, x: "Tensor[B, D; T]") -> "Tensor[B, D; T]":
        return ops.layer_norm(x, self.weight, None)  # planted: ln_weight


class VariadicAdd(Block, module="t.lang"):
    S: Shape
    T: Float = f32

    def forward(self, x: "Tensor[*S, D; T]", y: "Tensor[B, *S, D; T]") -> "Tensor[*S, D; T]":
        return x + y  # planted: variadic


class VariadicAddOk(Block, module="t.lang"):
    S: Shape
    T: Float = f32

    def forward(self, x: "Tensor[*S, D; T]", y: "Tensor[B, *S, D; T]") -> "Tensor[B, *S, D; T]":
        return x + y


def test_every_operand_is_checked():
    refused(AttnBatch, "attn_v", "batch axes of key and value differ", "Tensor[C, M, E; T]")
    refused(AttnBias, "attn_bias", "bias", "more axes than the scores")
    accepted(AttnOk)
    refused(NormWeight, "rms_weight", "rms_norm", "Tensor[D, 2; T]")
    refused(LayerNormWeight, "ln_weight", "layer_norm", "Tensor[D, 2; T]")
    refused(VariadicAdd, "variadic", "the result is Tensor[B, *S, D; T]")
    accepted(VariadicAddOk)
    x, y = torch.zeros(3, 4), torch.zeros(2, 3, 4)
    assert (x + y).shape == (2, 3, 4)  # torch widens it, as the checker now says


class FlattenOrder(Block, module="t.lang"):
    T: Float = f32

    def forward(self, x: "Tensor[A, B, C; T]") -> "Tensor[A, B, C; T]":
        return ops.flatten(x, 2, 1)  # planted: flatten


class BothSizes(Block, module="t.lang"):
    T: Float = f32

    def forward(self, x: "Tensor[B, C, H, W; T]") -> "Tensor[B, C, 8, 8; T]":
        return ops.interpolate(x, size=(8, 8), scale_factor=2)  # planted: both_sizes


class MaybeEmpty(Block, module="t.lang"):
    S: Dim
    T: Float = f32

    def forward(self, x: "Tensor[B, C, S, S; T]") -> "Tensor[B, C, 2 * S, 2 * S; T]":
        return ops.interpolate(x, scale_factor=2, mode="nearest")  # planted: maybe_empty


class DupAxes(Block, module="t.lang"):
    T: Float = f32

    def forward(self, x: "Tensor[A, B; T]") -> "Tensor[B; T]":
        return ops.sum_(x, (0, 0))  # planted: dup_axes


class ViewAfterTranspose(Block, module="t.lang"):
    T: Float = f32

    def forward(self, x: "Tensor[A, B; T]") -> "Tensor[A * B; T]":
        y = x.contiguous().transpose(0, 1)
        return y.view(y.shape[0] * y.shape[1])  # planted: view


class ViewAfterContiguous(Block, module="t.lang"):
    T: Float = f32

    def forward(self, x: "Tensor[A, B; T]") -> "Tensor[B * A; T]":
        y = x.transpose(0, 1).contiguous()
        return y.view(y.shape[0] * y.shape[1])


class PermuteRange(Block, module="t.lang"):
    T: Float = f32

    def forward(self, x: "Tensor[A, B, C; T]") -> "Tensor[A, C, B; T]":
        return x.permute(0, 5, 1)  # planted: permute


def test_argument_rules_torch_enforces():
    refused(FlattenOrder, "flatten", "start axis comes after the end axis")
    refused(BothSizes, "both_sizes", "exactly one of size and scale_factor")
    d = refused(MaybeEmpty, "maybe_empty", "input axis", "positive", "at S = 0")
    assert check_program(_with_where(MaybeEmpty, d.hint)).ok
    with pytest.raises(RuntimeError):  # torch agrees: an empty input is refused
        torch.nn.functional.interpolate(torch.zeros(1, 1, 0, 0), scale_factor=2)
    refused(DupAxes, "dup_axes", "appears twice")
    refused(ViewAfterTranspose, "view", "use reshape")
    accepted(ViewAfterContiguous)
    refused(PermuteRange, "permute", "out of range")


def test_a_dtype_default_outside_its_kind_is_a_declaration_error():
    class BadDefault(Block, module="t.lang.bad"):
        I: Int = f32

        def forward(self, x: "Tensor[B; I]") -> "Tensor[B; I]":
            return x

    report = check_block_class(BadDefault)
    assert len(report.diagnostics) == 1 and "Int does not admit" in report.diagnostics[0].message


def test_a_crash_in_one_file_does_not_stop_the_others(capsys, tmp_path):
    from kestrel.cli.main import main

    first = tmp_path / "first.py"
    first.write_text("from kestrel.blocks import Block, Float, f32\n\n\nclass P(Block, module='t.crash'):\n"
                     "    T: Float = f32\n\n    def forward(self, x: 'Tensor[A, B, C; T]') -> 'Tensor[A, B, C; T]':\n"
                     "        return x.permute(0, 5, 1)\n")
    second = tmp_path / "second.py"
    second.write_text("from kestrel.blocks import Block, Float, f32\n\n\nclass Q(Block, module='t.fine'):\n"
                      "    T: Float = f32\n\n    def forward(self, x: 'Tensor[A; T]') -> 'Tensor[A; T]':\n"
                      "        return x\n")
    code = main(["check", str(first), str(second)])
    out = capsys.readouterr().out
    assert code == 1
    assert "first.py:8: error" in out and "out of range" in out
    assert "t.fine::Q: 1 block, 1 function checked: ok" in out


# ------------------------------------------------------------------------------------ correct programs


class IndexByGeneric(Block, module="t.lang"):
    K: Dim
    S: Dim
    T: Float = f32
    where = "S > K"

    def forward(self, x: "Tensor[B, S, D; T]") -> "Tensor[B, D; T]":
        return x[:, self.K]


def test_indexing_by_a_generic_is_accepted():
    accepted(IndexByGeneric)


# ----------------------------------------------------------------------------------------------- hints


PLANTED_WITH_HINTS = [PoolUp, CropToH, FloorPad, NormWeight, MaybeEmpty, IndexByGeneric]


def _with_where(cls: type[Block], where: str) -> type[Block]:
    skip = {"__dict__", "__weakref__", "__qualname__", "_kestrel_decl", "_kestrel_module"}
    ns = {k: v for k, v in cls.__dict__.items() if k not in skip}
    ns["where"] = where
    return type(f"{cls.__name__}Fixed", (Block,), ns, module="t.lang.fixed")


class NeedsFact(Block, module="t.lang"):
    K: Dim
    S: Dim
    T: Float = f32

    def forward(self, x: "Tensor[B, S, D; T]") -> "Tensor[B, D; T]":
        return x[:, self.K]  # planted: needs_fact


class Impossible(Block, module="t.lang"):
    K: Dim
    T: Float = f32
    where = "K > 3"

    def forward(self, x: "Tensor[B, 2; T]") -> "Tensor[B; T]":
        return x[:, self.K]  # planted: impossible


def test_hints_are_facts_that_fix_the_diagnostic():
    d = refused(NeedsFact, "needs_fact", "index K")
    assert d.hint == "S > K"
    assert check_program(_with_where(NeedsFact, d.hint)).ok
    d = refused(Impossible, "impossible", "index K")
    assert d.hint is None  # K < 2 contradicts K > 3: no hint rather than an impossible one
    for cls in PLANTED_WITH_HINTS:
        for diag in check_program(cls).diagnostics:
            if diag.hint is None:
                continue
            assert any(c.isalpha() for c in diag.hint), diag.hint  # never a constant fact
            before = cls.__dict__.get("where", "")
            fixed = _with_where(cls, f"{before}, {diag.hint}" if before else diag.hint)
            assert all(x.message != diag.message for x in check_program(fixed).diagnostics), diag


@pytest.mark.parametrize("cls", [Chain, ScaledChain])
def test_layer_loops_hold_for_every_layer_count_including_zero(cls):
    accepted(cls)
    for n in (0, 1, 3):
        block = cls(D=4, N=n, T=f32)
        assert block(torch.zeros(2, 4)).shape == (2, 4)


def _helper_with_try(x):
    try:  # planted: helper_try
        return x[:, 1:]
    except Exception:
        return x


class HelperTry(Block, module="t.lang"):
    D: Dim
    T: Float = f32

    def forward(self, x: "Tensor[B, D; T]") -> "Tensor[B, D; T]":
        return self._trim(x)

    def _trim(self, x):
        return _helper_with_try(x)


def test_helpers_are_held_to_the_same_language():
    refused(HelperTry, "helper_try", "try statement")


class ZipShort(Block, module="t.lang"):
    D: Dim
    N: Dim
    T: Float = f32

    layers: Array[Linear["D, D, T"], "N"]

    def forward(self, x: "Tensor[B, S, D; T]") -> "Tensor[B, S, D; T]":
        for _, layer in zip((0,), self.layers):  # planted: zip_short
            x = layer(x)[:, 1:]
        return x


def test_a_loop_that_stops_before_its_check_is_refused():
    refused(ZipShort, "zip_short", "stopped before its first iteration was checked")


class UndecidedBranch(Block, module="t.lang"):
    K: Dim
    T: Float = f32

    def forward(self, x: "Tensor[B, D; T]") -> "Tensor[B, D; T]":
        if self.K > 2:  # planted: undecided
            return ops.relu(x)
        return x


def test_an_undecided_branch_names_a_binding_where_it_is_false():
    d = refused(UndecidedBranch, "undecided", "cannot be decided", "false at K = ")
    k = int(d.message.split("false at K = ")[1].rstrip(")"))
    assert not k > 2
    assert d.hint == "K > 2"
