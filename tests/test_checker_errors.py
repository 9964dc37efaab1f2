"""The checker's diagnostics: planted errors in small blocks, each named with its file, line and shapes.

Every offending statement below carries a ``# planted: NAME`` comment; the tests look the line up
from this file's text, so they check the line the checker reports rather than a stored number.
"""

import os

import pytest
import torch

from kestrel.blocks import Array, BindError, Block, Dim, EntryError, Float, Param, entry, f32, optional
from kestrel.checker.check import Diagnostic, check_block_class, check_program
from kestrel.models import dinov2, vit
from kestrel.std import ops
from kestrel.std.nn import Linear

HERE = os.path.abspath(__file__)
with open(HERE) as _f:
    SOURCE = _f.read().splitlines()


def line_of(name: str) -> int:
    """The 1-based line of the statement marked ``# planted: name``."""
    hits = [i + 1 for i, text in enumerate(SOURCE) if text.rstrip().endswith(f"# planted: {name}")]
    assert len(hits) == 1, name
    return hits[0]


def only(diags: list[Diagnostic]) -> Diagnostic:
    assert len(diags) == 1, [str(d) for d in diags]
    return diags[0]


def diagnose(cls: type[Block]) -> Diagnostic:
    report = check_block_class(cls)
    assert not report.ok
    return only(report.diagnostics)


def assert_at(d: Diagnostic, name: str) -> None:
    assert d.file is not None and os.path.abspath(d.file) == HERE, d
    assert d.line == line_of(name), (d.line, line_of(name), str(d))
    text = d.format()
    assert text.startswith(f"{os.path.relpath(HERE)}:{line_of(name)}: error: in ") or text.startswith(
        f"{HERE}:{line_of(name)}: error: in ")


# ------------------------------------------------------------------------------- planted errors


class Contraction(Block, module="test.errors"):
    D: Dim
    In: Dim
    Out: Dim
    T: Float = f32

    weight: Param["Out, In; T"]

    def forward(self, x: "Tensor[B, N, D; T]") -> "Tensor[B, N, Out; T]":
        return ops.linear(x, self.weight)  # planted: contraction


class MatmulContraction(Block, module="test.errors"):
    T: Float = f32

    def forward(self, a: "Tensor[B, M, K; T]", b: "Tensor[B, J, N; T]") -> "Tensor[B, M, N; T]":
        return a @ b  # planted: matmul


class ReshapeCount(Block, module="test.errors"):
    T: Float = f32

    def forward(self, x: "Tensor[B, N, D; T]") -> "Tensor[B, 2 * N, D; T]":
        B, N, D = x.shape
        return x.reshape(B, 2 * N, D)  # planted: reshape


class HeadSplit(Block, module="test.errors"):
    D: Dim
    Heads: Dim
    T: Float = f32
    where = "Heads > 0"

    def forward(self, x: "Tensor[B, N, D; T]") -> "Tensor[B, Heads, N, D / Heads; T]":
        B, N, _ = x.shape
        return x.reshape(B, N, self.Heads, self.D // self.Heads).transpose(1, 2)  # planted: heads


class HeadSplitProved(Block, module="test.errors"):
    D: Dim
    Heads: Dim
    T: Float = f32
    where = "Heads > 0, D % Heads == 0"

    def forward(self, x: "Tensor[B, N, D; T]") -> "Tensor[B, Heads, N, D / Heads; T]":
        B, N, _ = x.shape
        return x.reshape(B, N, self.Heads, self.D // self.Heads).transpose(1, 2)


class Broadcast(Block, module="test.errors"):
    T: Float = f32

    def forward(self, x: "Tensor[B, N, D; T]", y: "Tensor[B, M, D; T]") -> "Tensor[B, N, D; T]":
        return x + y  # planted: broadcast


class DtypeMix(Block, module="test.errors"):
    def forward(self, ids: "Tensor[B, N; i32]", x: "Tensor[B, N; f32]") -> "Tensor[B, N; f32]":
        return ids + x  # planted: dtype


class SliceRange(Block, module="test.errors"):
    T: Float = f32

    def forward(self, x: "Tensor[B, N, D; T]") -> "Tensor[B, N - 5, D; T]":
        return x[:, 5:]  # planted: slice


class SliceParam(Block, module="test.errors"):
    N: Dim
    T: Float = f32

    table: Param["N, 3; T"]

    def forward(self, x: "Tensor[B; T]") -> "Tensor[N - 5, 3; T]":
        return self.table[5:]  # planted: slice-param


class WrongResult(Block, module="test.errors"):
    T: Float = f32

    def forward(self, x: "Tensor[B, N, D; T]") -> "Tensor[B, D, N; T]":
        return ops.gelu(x)  # planted: result


class Unbound(Block, module="test.errors"):
    D: Dim
    T: Float = f32

    weight: Param["D, E; T"]  # planted: unbound


class Parts(Block, module="test.errors"):
    """A callee with a where clause its callers must meet."""

    D: Dim
    Count: Dim
    T: Float = f32
    where = "Count > 0, D % Count == 0"

    def forward(self, x: "Tensor[B, D; T]") -> "Tensor[B, Count, D / Count; T]":
        B, _ = x.shape
        return x.reshape(B, self.Count, self.D // self.Count)


class SubWhere(Block, module="test.errors"):
    D: Dim
    Heads: Dim
    T: Float = f32
    where = "Heads > 0"

    parts: Parts["D, Heads, T"]  # planted: subwhere

    def forward(self, x: "Tensor[B, D; T]") -> "Tensor[B, Heads, D / Heads; T]":
        return self.parts(x)


class SubCall(Block, module="test.errors"):
    D: Dim
    E: Dim
    T: Float = f32

    proj: Linear["E, D, T"]

    def forward(self, x: "Tensor[B, N, D; T]") -> "Tensor[B, N, D; T]":
        return self.proj(x)  # planted: subcall


class Branch(Block, module="test.errors"):
    T: Float = f32

    def forward(self, x: "Tensor[B, N, D; T]") -> "Tensor[B, N, D; T]":
        _, N, _ = x.shape
        if N > 4:  # planted: branch
            return x * 2.0
        return x


class BranchOnGeneric(Block, module="test.errors"):
    D: Dim
    T: Float = f32

    def forward(self, x: "Tensor[B, D; T]") -> "Tensor[B, D; T]":
        if self.D > 4:  # planted: branch-generic
            return x * 2.0
        return x


class Clean(Block, module="test.errors"):
    """Decidable branches, loops over a sub array, provable head splits: no diagnostics."""

    D: Dim
    Heads: Dim
    Layers: Dim
    T: Float = f32
    where = "Heads > 0, D % Heads == 0, D > 1"

    norm_weight: Param["D; T"]
    norm_bias: Param["D; T", optional]
    layers: Array[Linear["D, D, T"], "Layers"]
    parts: Parts["D, Heads, T"]

    def forward(self, x: "Tensor[B, N, D; T]") -> "Tensor[B, N, D; T]":
        B, N, _ = x.shape
        if self.D > 1:  # provable from the where clause
            x = ops.layer_norm(x, self.norm_weight, self.norm_bias)
        for layer in self.layers:
            x = ops.gelu(layer(x))
        h = x.reshape(B, N, self.Heads, self.D // self.Heads).transpose(1, 2)
        y = ops.attention(h, h, h)
        split = self.parts(x.mean(1))
        x = x + split.reshape(B, 1, self.D)
        first = self.norm_weight[0:1]  # in range: D > 1
        return y.transpose(1, 2).reshape(B, N, self.D) + x * first


class _Layers(Block, abstract=True):
    """A stack of same-typed layers, for the blocks below that iterate or index a slice of it."""

    D: Dim
    Layers: Dim
    T: Float = f32

    layers: Array[Linear["D, D, T"], "Layers"]


class LastApart(_Layers, module="test.errors"):
    """Every layer but the last in a loop, the last on its own: a slice of a sub array iterates."""

    where = "Layers > 0"

    @entry
    def forward(self, x: "Tensor[B, D; T]") -> "Tensor[B, D; T]":
        for layer in self.layers[:-1]:
            x = ops.gelu(layer(x))
        return self.layers[-1](x)


class LastUnproven(_Layers, module="test.errors"):
    def forward(self, x: "Tensor[B, D; T]") -> "Tensor[B, D; T]":
        for layer in self.layers[:-1]:
            x = layer(x)
        return self.layers[-1](x)  # planted: last-unproven


class SliceCounted(_Layers, module="test.errors"):
    where = "Layers > 1"

    def forward(self, x: "Tensor[B, D; T]") -> "Tensor[B, D; T]":
        return self.layers[1:][-1](x)  # planted: slice-indexed


class EveryOtherLayer(_Layers, module="test.errors"):
    def forward(self, x: "Tensor[B, D; T]") -> "Tensor[B, D; T]":
        for layer in self.layers[::2]:  # planted: stepped
            x = layer(x)
        return x


# --------------------------------------------------------------------------------------- tests


def test_contraction_dimension():
    d = diagnose(Contraction)
    assert_at(d, "contraction")
    assert d.message.startswith("linear: the contraction dimension differs: D vs In "
                                "(Tensor[B, N, D; T] and Tensor[Out, In; T]) (at D = ")  # z3's counterexample
    assert d.hint == "D == In"
    assert "hint: add `where D == In` to test.errors::Contraction" in d.format()


def test_matmul_contraction_dimension():
    d = diagnose(MatmulContraction)
    assert_at(d, "matmul")
    assert "matmul: the contraction dimension differs: K vs J" in d.message
    assert "Tensor[B, M, K; T]" in d.message and "Tensor[B, J, N; T]" in d.message
    assert d.hint is None


def test_reshape_element_count():
    d = diagnose(ReshapeCount)
    assert_at(d, "reshape")
    assert d.message.startswith("reshape of Tensor[B, N, D; T] to [B, 2 * N, D]: element counts")
    assert "cannot be proved equal" in d.message


def test_head_divisibility_needs_its_where():
    d = diagnose(HeadSplit)
    assert_at(d, "heads")
    assert "reshape of Tensor[B, N, D; T] to [B, N, Heads, D / Heads]" in d.message
    assert d.hint == "D % Heads == 0"
    assert "hint: add `where D % Heads == 0` to test.errors::HeadSplit" in d.format()
    # with the fact the same body is proved
    assert check_block_class(HeadSplitProved).ok


def test_broadcast_mismatch():
    d = diagnose(Broadcast)
    assert_at(d, "broadcast")
    assert d.message == "add: cannot broadcast Tensor[B, N, D; T] with Tensor[B, M, D; T]: N against M"
    assert d.hint is None  # N and M are the function's own: no where clause can relate them
    assert "hint" not in d.format()


def test_dtype_mismatch():
    d = diagnose(DtypeMix)
    assert_at(d, "dtype")
    assert d.message == "add: dtype i32 vs f32 (Tensor[B, N; i32] and Tensor[B, N; f32])"


def test_slice_out_of_range():
    d = diagnose(SliceRange)
    assert_at(d, "slice")
    assert d.message == "slice start 5 may be outside an axis of length N in Tensor[B, N, D; T]"
    assert d.hint is None
    # on a block generic's axis the missing bound is a where fact
    d = diagnose(SliceParam)
    assert_at(d, "slice-param")
    assert d.message == "slice start 5 may be outside an axis of length N in Tensor[N, 3; T]"
    assert d.hint == "N >= 5"
    assert "hint: add `where N >= 5` to test.errors::SliceParam" in d.format()


def test_wrong_declared_result():
    d = diagnose(WrongResult)
    assert_at(d, "result")
    assert d.message.startswith("the result is Tensor[B, N, D; T], declared Tensor[B, D, N; T]")
    assert "axis 1 is N, declared D" in d.message and "axis 2 is D, declared N" in d.message
    assert d.hint is None


def test_unbound_generic_is_a_declaration_error():
    report = check_program(Unbound)
    d = only(report.diagnostics)
    assert_at(d, "unbound")
    assert "unbound generic 'E'" in d.message
    assert "D, E; T" in d.message  # the notation, with a caret under E
    assert "\n       ^" in d.message


def test_sub_generics_against_the_callee_where():
    d = only(check_program(SubWhere).diagnostics)
    assert_at(d, "subwhere")
    assert d.function is None
    assert "sub parts: test.errors::Parts requires `D % Count == 0`" in d.message
    assert "which here reads `D % Heads == 0`" in d.message
    assert d.hint == "D % Heads == 0"
    assert "hint: add `where D % Heads == 0` to test.errors::SubWhere" in d.format()


def test_sub_called_with_the_wrong_shape():
    d = diagnose(SubCall)
    assert_at(d, "subcall")
    assert d.message.startswith("proj: Linear<E, D, T>.forward expects x: Tensor[*S, E; T], got Tensor[B, N, D; T]: "
                                "axis 2 is D, declared E (at D = ")
    assert d.hint == "D == E"


def test_branch_on_an_unprovable_condition():
    d = diagnose(Branch)
    assert_at(d, "branch")
    assert "branch on the symbolic condition `N > 4`" in d.message
    assert d.hint is None
    d = diagnose(BranchOnGeneric)
    assert_at(d, "branch-generic")
    assert "branch on the symbolic condition `D > 4`" in d.message
    assert d.hint == "D > 4"


def test_clean_block_checks_clean():
    report = check_program(Clean)
    assert report.ok, [str(d) for d in report.diagnostics]
    assert report.checked >= 3  # Clean.forward, Linear.forward, Parts.forward
    graph = report.graphs[("test.errors::Clean", "forward")]
    result = next(n for n in graph.nodes if n.kind == "output")
    assert graph.type_of(result.inputs[0]) == "Tensor[B, N, D; T]"
    ops_used = {n.op for n in graph.nodes if n.kind == "op"}
    assert {"layer_norm", "gelu", "attention", "reshape", "add", "mean", "getitem"} <= ops_used
    assert {n.op for n in graph.nodes if n.kind == "sub"} == {"layers[i]", "parts"}


@pytest.mark.parametrize("model", [vit.Model, dinov2.Model])
def test_the_example_models_check_clean(model):
    report = check_program(model)
    assert report.ok, "\n".join(map(str, report.diagnostics))
    names = {d.name for d in report.blocks}
    assert {"Model", "Attention", "EncoderLayer", "Linear"} <= names
    assert report.checked >= len(report.blocks)


# ------------------------------------------------------------------------------------ run time


class Pairwise(Block, module="test.errors"):
    D: Dim
    T: Float = f32

    weight: Param["D, D; T"]

    @entry
    def score(self, a: "Tensor[B, D; T]", b: "Tensor[B, D; T]") -> "Tensor[B, D; T]":
        return ops.linear(a, self.weight) * b


def test_entry_checks_its_inputs():
    m = Pairwise(D=3)
    torch.nn.init.eye_(m.weight)
    a, b = torch.randn(2, 3), torch.randn(2, 3)
    torch.testing.assert_close(m.score(a, b), a * b)
    torch.testing.assert_close(m.score(a=a, b=b), a * b)

    with pytest.raises(EntryError) as e:
        m.score(a, torch.randn(2, 4))
    msg = str(e.value)
    assert msg.startswith("test.errors::Pairwise.score: input b has shape (2, 4) and dtype f32")
    assert "declared Tensor[B, D; T] = [2, 3; f32]" in msg  # B = 2 from a, D = 3 from the binding
    assert "axis 1 is 4, declared 3" in msg

    with pytest.raises(EntryError) as e:
        m.score(a, torch.randn(5, 3))
    assert "input b has shape (5, 3)" in str(e.value)
    assert "axis 0 is 5, declared 2 (B = 2 from an earlier argument)" in str(e.value)

    with pytest.raises(EntryError) as e:
        m.score(a.double(), b)
    assert "input a has shape (2, 3) and dtype f64" in str(e.value) and "dtype f64, declared f32" in str(e.value)

    with pytest.raises(EntryError, match="rank 3 where 2 axes are declared"):
        m.score(a[None], b)
    with pytest.raises(EntryError, match="score: missing input 'b'"):
        m.score(a)
    with pytest.raises(EntryError, match="has no input 'c'"):
        m.score(a, b, c=b)
    with pytest.raises(EntryError, match=r"input b must be a torch\.Tensor"):
        m.score(a, [1.0, 2.0, 3.0])


def test_model_entry_names_the_entry_and_argument():
    m = vit.Model(Height=32, Width=32, Channels=3, Patch=16, D=8, Heads=2, Inner=16, Layers=1, Classes=5)
    with pytest.raises(EntryError) as e:
        m.forward(torch.zeros(1, 4, 32, 32))
    msg = str(e.value)
    assert "vit::Model.forward: input image has shape (1, 4, 32, 32)" in msg
    assert "Tensor[B, Channels, Height, Width; T] = [1, 3, 32, 32; f32]" in msg
    assert "axis 1 is 4, declared 3" in msg


def test_bind_error_for_generics_against_where():
    with pytest.raises(BindError) as e:
        Parts(D=10, Count=3)
    assert str(e.value) == "test.errors::Parts: `where D % Count == 0` does not hold for D = 10, Count = 3"
    with pytest.raises(BindError, match="D % Heads == 0` does not hold for D = 10, Heads = 3"):
        vit.Attention(D=10, Heads=3, T=f32)
    with pytest.raises(BindError, match="Count > 0"):
        Parts(D=10, Count=0)
    assert Parts(D=12, Count=3).generics["Count"] == 3


def _with_where(cls: type[Block], where: str) -> type[Block]:
    """The same block with a different where clause (a fresh class, read afresh)."""
    skip = {"__dict__", "__weakref__", "__qualname__", "_kestrel_decl", "_kestrel_module"}
    ns = {k: v for k, v in cls.__dict__.items() if k not in skip}
    ns["where"] = where
    return type(f"{cls.__name__}Fixed", (Block,), ns, module="test.errors.fixed")


@pytest.mark.parametrize("cls", [Contraction, HeadSplit, SliceParam, SubWhere, SubCall, BranchOnGeneric])
def test_the_suggested_where_fact_fixes_the_error(cls):
    report = check_program(cls)
    d = only(report.diagnostics)
    assert d.hint is not None
    before = cls.__dict__.get("where", "")
    fixed = _with_where(cls, f"{before}, {d.hint}" if before else d.hint)
    after = check_program(fixed)
    assert after.ok, "\n".join(map(str, after.diagnostics))


def test_a_slice_of_a_sub_array_is_iterated_like_the_array():
    report = check_program(LastApart)
    assert report.ok, [str(d) for d in report.diagnostics]
    m = LastApart(D=4, Layers=3).eval()
    with torch.no_grad():
        for p in m.parameters():  # bound blocks start with unset memory
            p.normal_()
    x = torch.randn(2, 4)
    want = x
    for i, layer in enumerate(m.layers):
        want = layer(want) if i == 2 else torch.nn.functional.gelu(layer(want))
    torch.testing.assert_close(m.forward(x), want)
    with pytest.raises(BindError, match="Layers > 0"):
        LastApart(D=4, Layers=0)


def test_the_last_layer_needs_a_where_that_proves_there_is_one():
    d = diagnose(LastUnproven)
    assert_at(d, "last-unproven")
    assert "layers[-1] may be out of range for Layers layers" in d.message


def test_a_stepped_slice_of_a_sub_array_is_refused():
    d = diagnose(EveryOtherLayer)
    assert_at(d, "stepped")
    assert "layers[::2]: a sub array is sliced by constant bounds without a step" in d.message


def test_a_slice_of_a_sub_array_is_not_indexed_again():
    # layers[1:][-1] is layers[-1] at run time; the checker would have to model the slice to know it
    d = diagnose(SliceCounted)
    assert_at(d, "slice-indexed")
    assert "layers[1:][-1]: the checker iterates a slice of a sub array but does not index it again" in d.message
