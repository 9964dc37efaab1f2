"""Tensor types and their notation: ``Tensor[B, N, D; T]``, ``Tensor[*S, In; T]?``, tuples."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

from ..shapes.parse import Parser
from ..shapes.poly import AtomOrder, Poly, format_poly, substitute
from .dtypes import DTYPES, DType, DTypeVar

__all__ = ["Scope", "TensorType", "TupleType", "Type", "Variadic", "parse_param", "parse_type"]


@dataclass(frozen=True)
class Variadic:
    """A variadic run of dimensions, ``*S``: any number of leading axes."""

    name: str

    def __str__(self) -> str:
        return f"*{self.name}"


DimItem = Union[Poly, Variadic]


@dataclass(frozen=True)
class TensorType:
    dims: tuple[DimItem, ...]
    dtype: DType | DTypeVar
    optional: bool = False

    @property
    def rank(self) -> int | None:
        """The number of axes, or None when a variadic run makes it open."""
        return None if any(isinstance(d, Variadic) for d in self.dims) else len(self.dims)

    def format(self, order: AtomOrder | None = None) -> str:
        dims = ", ".join(str(d) if isinstance(d, Variadic) else format_poly(d, order) for d in self.dims)
        return f"Tensor[{dims}; {self.dtype}]" + ("?" if self.optional else "")

    def __str__(self) -> str:
        return self.format()

    def substitute(self, dims: dict[str, Poly | int], dtypes: dict[str, DType | DTypeVar]) -> TensorType:
        new_dims = tuple(d if isinstance(d, Variadic) else substitute(d, dims) for d in self.dims)
        dtype = dtypes.get(self.dtype.name, self.dtype) if isinstance(self.dtype, DTypeVar) else self.dtype
        return TensorType(new_dims, dtype, self.optional)


@dataclass(frozen=True)
class TupleType:
    items: tuple[TensorType, ...]

    def format(self, order: AtomOrder | None = None) -> str:
        return "(" + ", ".join(t.format(order) for t in self.items) + ")"

    def __str__(self) -> str:
        return self.format()


Type = Union[TensorType, TupleType]


@dataclass
class Scope:
    """Which names a piece of notation may use.

    ``dims``/``shapes``/``dtypes`` are the block's generics. When ``free`` is set, any other name
    becomes a new function generic (recorded in first-appearance order); otherwise it is an error.
    """

    dims: set[str] = field(default_factory=set)
    shapes: set[str] = field(default_factory=set)
    dtypes: dict[str, DTypeVar] = field(default_factory=dict)
    free: bool = False
    new_dims: list[str] = field(default_factory=list)
    new_shapes: list[str] = field(default_factory=list)
    new_order: list[tuple[str, str]] = field(default_factory=list)  # (name, "Dim" | "Shape")


class TypeParser(Parser):
    """The tensor-type grammar on top of the dimension-expression grammar."""

    def __init__(self, text: str, scope: Scope, order: AtomOrder | None = None) -> None:
        self.scope = scope
        super().__init__(text, self._resolve_dim, order)

    def _resolve_dim(self, name: str, col: int) -> Poly:
        s = self.scope
        if name in s.dims or name in s.new_dims:
            return Poly.sym(name)
        if name in s.dtypes or name in DTYPES:
            raise self.error(f"{name!r} is a dtype, not a dimension", self.tokens[self.i - 1])
        if name in s.shapes or name in s.new_shapes:
            raise self.error(f"{name!r} is a variadic shape: write *{name}", self.tokens[self.i - 1])
        if s.free:
            s.new_dims.append(name)
            s.new_order.append((name, "Dim"))
            return Poly.sym(name)
        raise self.error(f"unbound generic {name!r}: declare it on the block", self.tokens[self.i - 1])

    def type(self) -> Type:
        if self.accept("("):
            items = [self.tensor()]
            while self.accept(","):
                items.append(self.tensor())
            self.expect(")")
            return TupleType(tuple(items)) if len(items) > 1 else items[0]
        return self.tensor()

    def tensor(self) -> TensorType:
        if not (self.tok.kind == "name" and self.tok.text == "Tensor"):
            raise self.error(f"expected 'Tensor[...]', found {self.tok.text or 'end of text'!r}")
        self.i += 1
        self.expect("[")
        out = self.body()
        self.expect("]")
        return TensorType(out.dims, out.dtype, self.accept("?"))

    def body(self) -> TensorType:
        """``dims; dtype`` — the inside of ``Tensor[...]``, also a param's short form."""
        dims: list[DimItem] = []
        if self.tok.text != ";":
            while True:
                start = self.tok
                dims.append(self.dim_item())
                if sum(isinstance(d, Variadic) for d in dims) > 1:  # point at the second run
                    raise self.error("at most one variadic run (*S) per tensor type", start)
                if not self.accept(","):
                    break
        self.expect(";")
        return TensorType(tuple(dims), self.dtype())

    def dim_item(self) -> DimItem:
        if self.accept("*"):
            tok = self.tok
            if tok.kind != "name":
                raise self.error("expected a shape name after '*'")
            self.i += 1
            s = self.scope
            if tok.text not in s.shapes and tok.text not in s.new_shapes:
                if not s.free:
                    raise self.error(f"unbound variadic shape {tok.text!r}", tok)
                s.new_shapes.append(tok.text)
                s.new_order.append((tok.text, "Shape"))
            return Variadic(tok.text)
        return self.expr()

    def dtype(self) -> DType | DTypeVar:
        tok = self.tok
        if tok.kind != "name":
            raise self.error("expected a dtype (f32, i32, ...) or a dtype generic")
        self.i += 1
        if tok.text in DTYPES:
            return DTYPES[tok.text]
        if tok.text in self.scope.dtypes:
            return self.scope.dtypes[tok.text]
        raise self.error(f"unknown dtype or dtype generic {tok.text!r}", tok)


def parse_type(text: str, scope: Scope | None = None, order: AtomOrder | None = None) -> Type:
    """Parse ``Tensor[...]`` or a tuple of them. Errors point at the column."""
    p = TypeParser(text, scope or Scope(free=True), order)
    out = p.type()
    p.finish()
    return out


def parse_param(text: str, scope: Scope, order: AtomOrder | None = None) -> TensorType:
    """Parse a param's type: ``Out, In; T`` or the full ``Tensor[Out, In; T]``."""
    p = TypeParser(text, scope, order)
    out = p.tensor() if p.tok.text == "Tensor" else p.body()
    p.finish()
    return out
