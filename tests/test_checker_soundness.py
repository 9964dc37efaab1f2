"""The checker proves what it claims (issue 7): dtypes, layer stacks, variadic results, sizes, hints.

Each wrong program below was once accepted; each right one was once refused. Every offending line
carries a ``# planted: NAME`` comment and the tests look its number up from this file's text, so a
test checks the line the checker reports. Every hint the checker gives is added to the block's
``where`` clause and the block re-checked: the diagnostic must go away.
"""

from __future__ import annotations

import os

import pytest
import torch

from kestrel.blocks import Array, Block, Dim, EntryError, Float, Param, entry, f32, i32
from kestrel.blocks.spec import Shape
from kestrel.checker.check import Diagnostic, check_block_class
from kestrel.std import ops
from kestrel.std.nn import Conv2d, Embedding, Linear, RmsNorm
from kestrel.std.nn.conv import Conv1d, Conv2dRect

HERE = os.path.abspath(__file__)
with open(HERE) as _f:
    SOURCE = _f.read().splitlines()


def line_of(name: str) -> int:
    hits = [i + 1 for i, text in enumerate(SOURCE) if text.rstrip().endswith(f"# planted: {name}")]
    assert len(hits) == 1, name
    return hits[0]


def diagnose(cls: type[Block]) -> Diagnostic:
    report = check_block_class(cls)
    assert len(report.diagnostics) == 1, [str(d) for d in report.diagnostics]
    return report.diagnostics[0]


def assert_at(d: Diagnostic, name: str, *texts: str) -> None:
    """At the planted line of this file, and the message names every one of ``texts``."""
    assert d.file is not None and os.path.abspath(d.file) == HERE, str(d)
    assert d.line == line_of(name), (d.line, line_of(name), str(d))
    for t in texts:
        assert t in d.message, (t, d.message)


def assert_ok(cls: type[Block]) -> None:
    report = check_block_class(cls)
    assert report.ok, [str(d) for d in report.diagnostics]


def with_fact(cls: type[Block], fact: str) -> type[Block]:
    """The same block with one more ``where`` fact (a fresh class: declarations are read once)."""
    ns = {k: v for k, v in cls.__dict__.items() if k not in ("__dict__", "__weakref__", "_kestrel_decl")}
    old = cls.__dict__.get("where", "")
    ns["where"] = f"{old}, {fact}" if old else fact
    return type(cls.__name__, (Block,), ns, module="test.hinted")


def assert_hint_fixes(cls: type[Block], d: Diagnostic) -> None:
    """The hint is not implied already and, added to the where clause, removes that diagnostic."""
    assert d.hint is not None, str(d)
    assert d.hint not in str(cls.__dict__.get("where", "")), d.hint
    fixed = check_block_class(with_fact(cls, d.hint))
    same = [x for x in fixed.diagnostics if (x.function, x.message) == (d.function, d.message)]
    assert not same, [str(x) for x in fixed.diagnostics]


# ------------------------------------------------------------------------------------- 1. dtypes


class ReturnsInt(Block, module="test.sound"):
    T: Float = f32

    def forward(self, x: "Tensor[B, D; T]") -> "Tensor[B, D; T]":
        return ops.cast(x, i32)  # planted: ret-i32


class ReturnsF32(Block, module="test.sound"):
    T: Float = f32

    def forward(self, x: "Tensor[B, D; T]") -> "Tensor[B, D; T]":
        return ops.cast(x, f32)  # planted: ret-f32


class ReturnsCastToT(Block, module="test.sound"):
    T: Float = f32

    def forward(self, x: "Tensor[B, D; f32]") -> "Tensor[B, D; T]":
        return ops.cast(x, self.T)


class IdsIntoLinear(Block, module="test.sound"):
    D: Dim
    T: Float = f32

    proj: Linear["D, D, T"]

    def forward(self, ids: "Tensor[B, D; i32]") -> "Tensor[B, D; T]":
        return self.proj(ids)  # planted: ids-linear


class IntDivision(Block, module="test.sound"):
    def forward(self, a: "Tensor[B; i32]", b: "Tensor[B; i32]") -> "Tensor[B; i32]":
        return a / b  # planted: int-div


class FloatScalarOnInt(Block, module="test.sound"):
    def forward(self, a: "Tensor[B; i32]") -> "Tensor[B; i32]":
        return a * 0.5  # planted: float-scalar


class IntSum(Block, module="test.sound"):
    def forward(self, a: "Tensor[B, N; i32]") -> "Tensor[B; i64]":
        return ops.sum_(a, -1)  # torch sums integers in int64: declared so, accepted


class AnyKindIntoLinear(Block, module="test.sound"):
    from kestrel.types.dtypes import AnyDType as _Any

    D: Dim
    T: _Any

    proj: Linear["D, D, T"]  # planted: any-kind


def test_a_dtype_generic_is_not_rebound_to_i32():
    d = diagnose(ReturnsInt)
    assert_at(d, "ret-i32", "Tensor[B, D; i32]", "Tensor[B, D; T]", "dtype i32, declared T")


def test_f32_is_not_T_which_may_be_bf16():
    assert_at(diagnose(ReturnsF32), "ret-f32", "Tensor[B, D; f32]", "Tensor[B, D; T]")
    assert_ok(ReturnsCastToT)  # a cast produces exactly the named dtype


def test_integer_ids_are_refused_by_a_float_linear():
    d = diagnose(IdsIntoLinear)
    assert_at(d, "ids-linear", "Linear<D, D, T>", "Tensor[B, D; i32]", "Tensor[*S, D; T]")


def test_promotions_are_refused_unless_explicit():
    assert_at(diagnose(IntDivision), "int-div", "div", "Tensor[B; i32]")
    assert_at(diagnose(FloatScalarOnInt), "float-scalar", "Tensor[B; i32]", "promote")
    assert_ok(IntSum)


def test_a_dtype_kind_is_enforced_at_sub_arguments():
    d = diagnose(AnyKindIntoLinear)
    assert d.line == line_of("any-kind"), str(d)
    assert "Float" in d.message and "DType" in d.message


def test_every_op_keeps_or_names_its_dtype_at_run_time():
    """The rules above are torch's behaviour: integers divide to floats, sum to int64."""
    a = torch.tensor([3, 4], dtype=torch.int32)
    assert (a / a).dtype == torch.float32
    assert (a * 0.5).dtype == torch.float32
    assert a.sum(-1).dtype == torch.int64


# ----------------------------------------------------------------------------------- 2. sub arrays


class ChainedStack(Block, module="test.sound"):
    D: Dim
    E: Dim
    Layers: Dim
    T: Float = f32

    layers: Array[Linear["D, E, T"], "Layers"]

    def forward(self, x: "Tensor[B, D; T]") -> "Tensor[B, E; T]":
        for layer in self.layers:  # planted: chain
            x = layer(x)
        return x


class PreservingStack(Block, module="test.sound"):
    D: Dim
    Layers: Dim
    T: Float = f32

    layers: Array[Linear["D, D, T"], "Layers"]

    def forward(self, x: "Tensor[B, N, D; T]") -> "Tensor[B, N, D; T]":
        for _, layer in enumerate(self.layers):
            x = ops.gelu(layer(x)) + x
        return x


class GrowingList(Block, module="test.sound"):
    D: Dim
    Layers: Dim
    T: Float = f32

    layers: Array[Linear["D, D, T"], "Layers"]

    def forward(self, x: "Tensor[B, D; T]") -> "Tensor[B, 1, D; T]":
        outs = []
        for layer in self.layers:  # planted: grow
            outs.append(layer(x))
        return ops.stack(outs, dim=1)


class LastOutput(Block, module="test.sound"):
    D: Dim
    Layers: Dim
    T: Float = f32

    layers: Array[Linear["D, D, T"], "Layers"]

    def forward(self, x: "Tensor[B, D; T]") -> "Tensor[B, D; T]":
        for layer in self.layers:  # planted: last-output
            y = layer(x)
        return y


def test_a_value_bound_only_inside_a_possibly_empty_stack_is_refused():
    d = diagnose(LastOutput)
    assert_at(d, "last-output", "y", "Layers")
    assert d.hint == "Layers > 0"
    assert_hint_fixes(LastOutput, d)
    with pytest.raises(UnboundLocalError):  # what it would do at run time
        LastOutput(D=2, Layers=0)(torch.randn(1, 2))


def test_a_stack_that_changes_the_type_is_refused_with_both_types():
    d = diagnose(ChainedStack)
    assert_at(d, "chain", "Tensor[B, D; T]", "Tensor[B, E; T]", "layers")
    assert_hint_fixes(ChainedStack, d)  # E == D: then the stack maps D to D


def test_a_type_preserving_stack_is_accepted_and_runs_at_every_depth():
    assert_ok(PreservingStack)
    for n in (0, 1, 3):
        m = PreservingStack(D=4, Layers=n)
        assert m(torch.randn(2, 5, 4)).shape == (2, 5, 4)


def test_a_list_grown_over_a_stack_is_refused():
    assert_at(diagnose(GrowingList), "grow", "outs")


# -------------------------------------------------------------------------------- 3. variadic axes


class ReturnsOtherArgument(Block, module="test.sound"):
    D: Dim
    T: Float = f32

    def forward(self, x: "Tensor[*S, D; T]", y: "Tensor[B, D; T]") -> "Tensor[*S, D; T]":  # planted: other-arg
        return y  # an input has no line of its own: the diagnostic points at the def


class ReturnsParam(Block, module="test.sound"):
    D: Dim
    T: Float = f32

    table: Param["2, 3, D; T"]

    def forward(self, x: "Tensor[*S, D; T]") -> "Tensor[*S, D; T]":
        return self.table  # planted: param-run


class KeepsRun(Block, module="test.sound"):
    D: Dim
    T: Float = f32

    scale: Param["D; T"]

    def forward(self, x: "Tensor[*S, D; T]") -> "Tensor[*S, D; T]":
        return x * self.scale


def test_a_variadic_result_is_the_arguments_run():
    assert_at(diagnose(ReturnsOtherArgument), "other-arg", "Tensor[B, D; T]", "Tensor[*S, D; T]", "*S")
    assert_at(diagnose(ReturnsParam), "param-run", "Tensor[2, 3, D; T]", "Tensor[*S, D; T]")
    assert_ok(KeepsRun)


@pytest.mark.parametrize("block", [Linear, RmsNorm, Embedding, Conv1d, Conv2d, Conv2dRect])
def test_every_std_block_signature_is_proved_by_its_body(block):
    assert Shape is not None
    assert_ok(block)


# ------------------------------------------------------------------------------------------ 4. sizes


class BigKernel(Block, module="test.sound"):
    T: Float = f32

    weight: Param["8, 3, 7, 7; T"]

    def forward(self, x: "Tensor[B, 3, 4, 4; T]") -> "Tensor[B, 8, 0 - 2, 0 - 2; T]":
        return ops.conv2d(x, self.weight)  # planted: conv7


class ShortParam(Block, module="test.sound"):
    N: Dim
    T: Float = f32

    table: Param["N - 5, 4; T"]  # planted: param-n5


class TransposedBias(Block, module="test.sound"):
    T: Float = f32

    weight: Param["8, 4, 2, 2; T"]
    bias: Param["5; T"]

    def forward(self, x: "Tensor[B, 8, H, W; T]") -> "Tensor[B, 4, 2 * H, 2 * W; T]":
        return ops.conv_transpose2x2(x, self.weight, self.bias)  # planted: convt-bias


class TransposedBiasDtype(Block, module="test.sound"):
    T: Float = f32

    weight: Param["8, 4, 2, 2; T"]
    bias: Param["4; f32"]

    def forward(self, x: "Tensor[B, 8, H, W; T]") -> "Tensor[B, 4, 2 * H, 2 * W; T]":
        return ops.conv_transpose2x2(x, self.weight, self.bias)  # planted: convt-dtype


class SmallMap(Block, module="test.sound"):
    K: Dim
    T: Float = f32
    where = "K > 0"

    conv: Conv2d["3, 8, K, 1, 0, T"]

    def forward(self, x: "Tensor[B, 3, 4, 4; T]") -> "Tensor[B, 8, 5 - K, 5 - K; T]":
        return self.conv(x)  # planted: conv-pre


class HeadsByMinusOne(Block, module="test.sound"):
    D: Dim
    Heads: Dim
    T: Float = f32
    where = "Heads > 0, D % Heads == 0"

    def forward(self, x: "Tensor[B, N, D; T]") -> "Tensor[B, N, Heads, D / Heads; T]":
        B, N, _ = x.shape
        return x.reshape(B, N, self.Heads, -1)


class HeadsByEquality(Block, module="test.sound"):
    D: Dim
    Heads: Dim
    Dh: Dim
    T: Float = f32
    where = "D == Heads * Dh, Heads > 0"

    def forward(self, x: "Tensor[B, N, D; T]") -> "Tensor[B, N, Heads, Dh; T]":
        B, N, _ = x.shape
        return x.reshape(B, N, self.Heads, -1)


class FirstK(Block, module="test.sound"):
    H: Dim
    K: Dim
    T: Float = f32
    where = "H >= K"

    def forward(self, x: "Tensor[B, H; T]") -> "Tensor[B, K; T]":
        return x[:, : self.K]


class FirstKUnproved(Block, module="test.sound"):
    H: Dim
    K: Dim
    T: Float = f32

    def forward(self, x: "Tensor[B, H; T]") -> "Tensor[B, K; T]":
        return x[:, : self.K]  # planted: first-k


class WindowPartition(Block, module="test.sound"):
    """SAM's padding up to a multiple of a generic window, then the windows."""

    Win: Dim
    C: Dim
    T: Float = f32
    where = "Win > 0, C > 0"

    def forward(self, x: "Tensor[B, H, W, C; T]") -> (
            "Tensor[B * ((H + (Win - H % Win) % Win) / Win) * ((W + (Win - W % Win) % Win) / Win), Win, Win, C; T]"):
        B, H, W, C = x.shape
        win = self.Win
        ph, pw = (win - H % win) % win, (win - W % win) % win
        x = ops.pad(x, (0, 0, 0, pw, 0, ph))
        x = x.reshape(B, (H + ph) // win, win, (W + pw) // win, win, C)
        return x.permute(0, 1, 3, 2, 4, 5).reshape(-1, win, win, C)


def test_a_kernel_larger_than_its_input_is_refused():
    d = diagnose(BigKernel)
    assert_at(d, "conv7", "Tensor[B, 3, 4, 4; T]", "kernel 7")
    assert d.hint is None  # nothing to add: no binding makes 4 >= 7


def test_a_param_size_must_be_proved_nonnegative():
    d = diagnose(ShortParam)
    assert d.line == line_of("param-n5") and "-5 + N" in d.message
    assert d.hint == "N >= 5"
    assert_hint_fixes(ShortParam, d)


def test_transposed_conv_checks_its_bias():
    assert_at(diagnose(TransposedBias), "convt-bias", "5 vs 4", "Tensor[5; T]", "Tensor[8, 4, 2, 2; T]")
    assert_at(diagnose(TransposedBiasDtype), "convt-dtype", "Tensor[4; f32]", "Tensor[8, 4, 2, 2; T]")


def test_a_callee_precondition_is_proved_by_the_caller():
    d = diagnose(SmallMap)
    assert_at(d, "conv-pre", "H + 2 * Pad >= K", "4 >= K")
    assert_hint_fixes(SmallMap, d)


def test_relational_and_divisibility_facts_are_used():
    for cls in (HeadsByMinusOne, HeadsByEquality, FirstK, WindowPartition):
        assert_ok(cls)
    d = diagnose(FirstKUnproved)
    assert_at(d, "first-k", "Tensor[B, H; T]")
    assert d.hint == "H >= K"
    assert_hint_fixes(FirstKUnproved, d)


def test_the_accepted_size_programs_run_with_their_declared_shapes():
    m = WindowPartition(Win=3, C=2)
    for h, w in ((3, 3), (4, 7), (1, 5)):
        y = m(torch.randn(2, h, w, 2))
        hp, wp = -(-h // 3), -(-w // 3)
        assert y.shape == (2 * hp * wp, 3, 3, 2)
    assert HeadsByMinusOne(D=6, Heads=3)(torch.randn(2, 5, 6)).shape == (2, 5, 3, 2)


class Entry(Block, module="test.sound"):
    K: Dim
    T: Float = f32
    where = "H >= K"

    @entry
    def forward(self, x: "Tensor[B, H; T]") -> "Tensor[B, K; T]":
        return x[:, : self.K]


def test_entries_check_the_preconditions_the_checker_assumed():
    assert_ok(Entry)
    m = Entry(K=3)
    assert m(torch.randn(2, 5)).shape == (2, 3)
    with pytest.raises(EntryError, match="H >= K"):
        m(torch.randn(2, 2))
    with pytest.raises(EntryError, match="B is 0"):
        m(torch.randn(0, 5))


# ------------------------------------------------------------------------------------------- 5. hints


class NoConstantHint(Block, module="test.sound"):
    T: Float = f32

    def forward(self, x: "Tensor[B, 16; T]") -> "Tensor[B, 3, 5; T]":
        B, _ = x.shape
        return x.reshape(B, 3, -1)  # planted: const-hint


class MissingPositivity(Block, module="test.sound"):
    D: Dim
    Heads: Dim
    T: Float = f32
    where = "D % Heads == 0"

    def forward(self, x: "Tensor[B, N, D; T]") -> "Tensor[B, N, Heads, D / Heads; T]":
        B, N, _ = x.shape
        return x.reshape(B, N, self.Heads, -1)  # planted: missing-positive


class MissingDivisibility(Block, module="test.sound"):
    D: Dim
    Heads: Dim
    T: Float = f32
    where = "Heads > 0"

    def forward(self, x: "Tensor[B, N, D; T]") -> "Tensor[B, N, Heads, D / Heads; T]":
        B, N, _ = x.shape
        return x.reshape(B, N, self.Heads, -1)  # planted: missing-divides


def test_no_hint_names_an_impossible_fact():
    d = diagnose(NoConstantHint)
    assert_at(d, "const-hint", "Tensor[B, 16; T]")
    assert d.hint is None


def test_the_hint_is_the_missing_fact_not_one_already_given():
    report = check_block_class(MissingPositivity)  # the declared D / Heads is refused too, at the class
    d = next(x for x in report.diagnostics if x.function == "forward")
    assert_at(d, "missing-positive")
    assert d.hint == "Heads > 0"
    assert_hint_fixes(MissingPositivity, d)
    d = diagnose(MissingDivisibility)
    assert_at(d, "missing-divides", "Heads")
    assert d.hint == "D % Heads == 0"
    assert_hint_fixes(MissingDivisibility, d)


def test_every_hint_in_this_file_clears_its_diagnostic():
    blocks = [c for c in list(globals().values())
              if isinstance(c, type) and issubclass(c, Block) and c.__module__ == __name__]
    hinted = 0
    for cls in blocks:
        for d in check_block_class(cls).diagnostics:
            if d.hint is not None:
                assert_hint_fixes(cls, d)
                hinted += 1
    assert hinted >= 6
