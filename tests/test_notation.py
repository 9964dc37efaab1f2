"""Types and notation: ``Tensor[B, N, D; T]``, variadic runs, optional ``?``, tuples, dtypes, generics."""

from __future__ import annotations

import pytest
import torch

from kestrel.blocks import (
    Array,
    BindError,
    Block,
    DeclarationError,
    Dim,
    Float,
    Int,
    Param,
    Shape,
    bf16,
    f32,
    i64,
    optional,
)
from kestrel.shapes import DimParseError, Poly, evaluate, parse_dim
from kestrel.types import (
    DTYPES,
    DTypeVar,
    Scope,
    TensorType,
    TupleType,
    Variadic,
    dtype_named,
    from_torch,
    parse_param,
    parse_type,
)
from kestrel.types.dtypes import AnyDType, Bool


def scope(**dtypes: str) -> Scope:
    return Scope(dtypes={n: DTypeVar(n, k) for n, k in (dtypes or {"T": "Float"}).items()}, free=True)


# --------------------------------------------------------------------------------- tensor types


def test_plain_tensor_type():
    sc = scope()
    t = parse_type("Tensor[B, N, D; T]", sc)
    assert isinstance(t, TensorType)
    assert t.dims == (Poly.sym("B"), Poly.sym("N"), Poly.sym("D"))
    assert t.dtype == DTypeVar("T", "Float")
    assert not t.optional and t.rank == 3
    # free names become function generics, in order of first appearance
    assert sc.new_order == [("B", "Dim"), ("N", "Dim"), ("D", "Dim")]
    assert str(t) == "Tensor[B, N, D; T]"


def test_expressions_inside_a_type():
    t = parse_type("Tensor[B, 1 + (H / P) * (W / P), 3 * D; f32]", scope())
    assert isinstance(t, TensorType)
    assert evaluate(t.dims[1], {"H": 224, "W": 160, "P": 16}) == 1 + 14 * 10
    assert t.dims[2] == 3 * Poly.sym("D")
    assert t.dims[1] == parse_dim("(W / P) * (H / P) + 1")


def test_variadic_run():
    sc = scope()
    t = parse_type("Tensor[*S, In; T]", sc)
    assert isinstance(t, TensorType)
    assert t.dims == (Variadic("S"), Poly.sym("In"))
    assert t.rank is None
    assert sc.new_order == [("S", "Shape"), ("In", "Dim")]
    assert str(t) == "Tensor[*S, In; T]"
    # a declared shape generic is used, not re-declared
    sc2 = Scope(shapes={"S"}, free=True)
    parse_type("Tensor[*S, 4; f32]", sc2)
    assert sc2.new_order == []


def test_optional_and_tuples():
    t = parse_type("Tensor[Out; T]?", scope())
    assert isinstance(t, TensorType) and t.optional
    assert str(t) == "Tensor[Out; T]?"
    tup = parse_type("(Tensor[B, N; f32], Tensor[B; i64]?)", scope())
    assert isinstance(tup, TupleType) and len(tup.items) == 2
    assert tup.items[0].dtype == DTYPES["f32"] and not tup.items[0].optional
    assert tup.items[1].dtype == DTYPES["i64"] and tup.items[1].optional
    assert str(tup) == "(Tensor[B, N; f32], Tensor[B; i64]?)"
    # one item in parentheses is that item, not a tuple
    assert isinstance(parse_type("(Tensor[B; f32])", scope()), TensorType)


def test_scalar_type():
    t = parse_type("Tensor[; f32]", scope())
    assert isinstance(t, TensorType) and t.dims == () and t.rank == 0


@pytest.mark.parametrize(
    ("name", "torch_dtype", "kind"),
    [("bool", torch.bool, "Bool"), ("i32", torch.int32, "Int"), ("i64", torch.int64, "Int"),
     ("f16", torch.float16, "Float"), ("bf16", torch.bfloat16, "Float"), ("f32", torch.float32, "Float"),
     ("f64", torch.float64, "Float")],
)
def test_every_dtype(name, torch_dtype, kind):
    t = parse_type(f"Tensor[N; {name}]", scope())
    assert isinstance(t, TensorType)
    d = t.dtype
    assert d is DTYPES[name] and str(d) == name and d.kind == kind
    assert d.torch == torch_dtype
    assert from_torch(torch_dtype) is d
    assert str(t) == f"Tensor[N; {name}]"
    assert dtype_named(name) is d
    assert AnyDType.admits(d)


def test_dtype_names_and_kinds():
    assert dtype_named("float32") is DTYPES["f32"] and dtype_named("bfloat16") is DTYPES["bf16"]
    with pytest.raises(ValueError, match="unknown dtype 'q32'"):
        dtype_named("q32")
    with pytest.raises(TypeError):
        from_torch(torch.complex64)
    assert Float.admits(DTYPES["bf16"]) and not Float.admits(DTYPES["i32"])
    assert Int.admits(DTYPES["i64"]) and not Int.admits(DTYPES["f32"])
    assert Bool.admits(DTYPES["bool"]) and not Bool.admits(DTYPES["i32"])


def test_param_short_form():
    sc = Scope(dims={"Out", "In"}, dtypes={"T": DTypeVar("T", "Float")})
    short, full = parse_param("Out, In; T", sc), parse_param("Tensor[Out, In; T]", sc)
    assert short == full
    assert short.dims == (Poly.sym("Out"), Poly.sym("In"))


# ------------------------------------------------------------------------------- parse errors


def _err(text: str, sc: Scope | None = None) -> DimParseError:
    with pytest.raises(DimParseError) as e:
        parse_type(text, sc or scope())
    return e.value


@pytest.mark.parametrize(
    ("text", "at", "message"),
    [
        ("Tensor[B, N D; T]", "D;", "expected ';', found 'D'"),
        ("Tensor[B, ; T]", "; T", "expected a dimension, found ';'"),
        ("Tensor[B, N; q32]", "q32", "unknown dtype or dtype generic 'q32'"),
        ("Tensor[*S, *R; T]", "*R", "at most one variadic run"),
        ("Tensor[B, N; T", None, "expected ']'"),
        ("Tensor[B, N]", "]", "expected ';', found ']'"),
        ("Tensor[B, T; T]", "T;", "'T' is a dtype, not a dimension"),
        ("Tensor[B, N $ 2; T]", "$", "unexpected character '$'"),
        ("Tensor[B, N; T] x", "x", "unexpected 'x'"),
        ("Tnesor[B; T]", "Tnesor", "expected 'Tensor[...]'"),
    ],
)
def test_parse_error_points_at_the_column(text, at, message):
    e = _err(text)
    col = len(text) if at is None else text.index(at)
    assert e.column == col
    assert message in e.message
    lines = str(e).splitlines()
    assert lines[0] == f"{e.message} at column {col + 1}"
    assert lines[1] == f"    {text}"
    assert lines[2] == "    " + " " * col + "^"


def test_unbound_names_are_errors_where_generics_must_be_declared():
    sc = Scope(dims={"Out"}, dtypes={"T": DTypeVar("T", "Float")})
    with pytest.raises(DimParseError) as e:
        parse_param("Out, In; T", sc)
    assert e.value.column == 5 and "unbound generic 'In'" in e.value.message
    with pytest.raises(DimParseError) as e:
        parse_param("Out; U", sc)
    assert e.value.column == 5 and "'U'" in e.value.message


# ----------------------------------------------------------------------------- block generics


class Tiny(Block, module="test.notation"):
    N: Dim
    S: Shape
    I: Int
    T: Float = bf16
    where = "N > 0"

    table: Param["N, 2 * N; T"]
    ids: Param["N; I", optional]

    def forward(self, x: "Tensor[*S, N; T]", mask: "Tensor[B, M; bool]") -> "(Tensor[*S, 2 * N; T], Tensor[B; I]?)":
        raise NotImplementedError

    def _helper(self, x: "Tensor[B, N; T]") -> "Tensor[B; T]":
        raise NotImplementedError


class Pair(Block, module="test.notation"):
    N: Dim
    I: Int
    T: Float = bf16

    table: Param["N, N; T"]


class Holder(Block, module="test.notation"):
    D: Dim
    Layers: Dim
    T: Float = f32

    one: Pair["D, i64"]
    many: Array[Pair["D + 1, i64, T"], "Layers"]


def test_generic_kinds_and_defaults():
    decl = Tiny.decl()
    kinds = [(g.name, g.kind, g.default) for g in decl.generics]
    assert kinds == [("N", Dim, None), ("S", Shape, None), ("I", Int, None), ("T", Float, bf16)]
    params = {p.name: p for p in decl.params}
    assert params["table"].type.dims == (Poly.sym("N"), 2 * Poly.sym("N"))
    assert params["table"].type.dtype == DTypeVar("T", "Float")
    assert not params["table"].optional
    assert params["ids"].optional and params["ids"].type.optional
    assert str(params["ids"].type) == "Tensor[N; I]?"
    assert [str(f) for f in decl.where] == ["N > 0"]


def test_function_generics_and_visibility():
    decl = Tiny.decl()
    fwd, helper = decl.function("forward"), decl.function("_helper")
    assert fwd is not None and helper is not None
    # S is the block's shape generic; B and M are new, in order of first appearance
    assert fwd.generics == (("B", "Dim"), ("M", "Dim"))
    assert [n for n, _ in fwd.params] == ["x", "mask"]
    assert isinstance(fwd.result, TupleType) and fwd.result.items[1].optional
    assert fwd.params[1][1].dtype == DTYPES["bool"]
    assert fwd.visibility == "pub" and helper.visibility == "private" and helper.name == "helper"


def test_sub_generics_fill_defaults():
    decl = Holder.decl()
    one, many = decl.subs
    assert one.args == (Poly.sym("D"), i64, bf16)  # T defaults to Pair's bf16
    assert one.count is None
    assert many.args == (Poly.sym("D") + 1, i64, DTypeVar("T", "Float"))
    assert many.count == Poly.sym("Layers")


def test_binding_generics():
    class_ = Tiny.decl()
    from kestrel.blocks.block import bind_generics

    bound = bind_generics(class_, {"N": 3, "S": (), "I": "i32"})
    assert bound["T"] is bf16 and bound["I"] is DTYPES["i32"]
    assert bind_generics(class_, {"N": 3, "S": (), "I": torch.int64, "T": "f32"})["T"] is f32
    with pytest.raises(BindError, match="Float does not admit i32"):
        bind_generics(class_, {"N": 3, "S": (), "I": "i32", "T": "i32"})
    with pytest.raises(BindError, match="generic I is not bound"):
        bind_generics(class_, {"N": 3, "S": ()})
    with pytest.raises(BindError, match="has no generic Q"):
        bind_generics(class_, {"N": 3, "S": (), "I": "i32", "Q": 1})
    with pytest.raises(BindError, match="N > 0"):
        bind_generics(class_, {"N": 0, "S": (), "I": "i32"})
    with pytest.raises(BindError, match="natural number"):
        bind_generics(class_, {"N": -2, "S": (), "I": "i32"})


class BadParam(Block, module="test.notation"):
    D: Dim
    T: Float

    weight: Param["D, D D; T"]


class BadDtypeArg(Block, module="test.notation"):
    D: Dim

    sub: Pair["D, f32"]


def test_declaration_errors_name_the_file_line_and_column():
    with pytest.raises(DeclarationError) as e:
        BadParam.decl()
    err = e.value
    assert err.file == __file__
    src = open(__file__).read().splitlines()
    assert src[err.line - 1].strip() == 'weight: Param["D, D D; T"]'
    assert "expected ';', found 'D'" in err.message and "at column 6" in err.message
    assert "    D, D D; T\n         ^" in err.message
    with pytest.raises(DeclarationError) as e:
        BadDtypeArg.decl()
    assert e.value.file == __file__
    assert src[e.value.line - 1].strip() == 'sub: Pair["D, f32"]'
    assert "Int of test.notation::Pair does not admit f32" in e.value.message


def test_bound_blocks_follow_their_declarations():
    # this module postpones annotations (``from __future__ import annotations``): the declarations
    # above are read from their text, and bind as if written without it
    m = Holder(D=2, Layers=3)
    shapes = {k: (tuple(v.shape), v.dtype) for k, v in m.state_dict().items()}
    assert shapes == {
        "one.table": ((2, 2), torch.bfloat16),  # Pair's default T
        "many.0.table": ((3, 3), torch.float32),  # D + 1, and Holder's T = f32 passed on
        "many.1.table": ((3, 3), torch.float32),
        "many.2.table": ((3, 3), torch.float32),
    }
    assert m.one.generics == {"N": 2, "I": DTYPES["i64"], "T": bf16}
