"""Parsing dimension expressions and ``where`` facts, with column-accurate errors.

``/`` is floor division and ``%`` is modulo, as the seeds print them. The lexer is shared with the
tensor-type notation (:mod:`kestrel.types.notation`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import KestrelError
from .facts import Fact
from .poly import AtomOrder, Poly, floordiv, maximum, minimum, mod

__all__ = ["DimParseError", "parse_dim", "parse_facts"]


class DimParseError(KestrelError, ValueError):
    """A notation error, with the text and the column it points at."""

    def __init__(self, message: str, text: str, column: int) -> None:
        self.message, self.text, self.column = message, text, column
        caret = " " * column + "^"
        super().__init__(f"{message} at column {column + 1}\n    {text}\n    {caret}")


@dataclass(frozen=True)
class Token:
    kind: str  # "int", "name", "op", "end"
    text: str
    col: int


_TOKEN = re.compile(r"\s*(?:(?P<int>\d+)|(?P<name>[A-Za-z_][A-Za-z_0-9]*)|(?P<op>>=|<=|==|\*|[-+/%(),;\[\]<>?:]))")


def tokenize(text: str) -> list[Token]:
    out: list[Token] = []
    pos = 0
    while pos < len(text):
        if text[pos:].strip() == "":
            break
        m = _TOKEN.match(text, pos)
        if not m:
            col = pos + len(text[pos:]) - len(text[pos:].lstrip())
            raise DimParseError(f"unexpected character {text[col]!r}", text, col)
        kind = m.lastgroup or "op"
        out.append(Token(kind, m.group(kind), m.start(kind)))
        pos = m.end()
    out.append(Token("end", "", len(text)))
    return out


Resolver = Callable[[str, int], Poly]


class Parser:
    """Recursive descent over tokens; subclassed by the tensor-type parser."""

    def __init__(self, text: str, resolve: Resolver, order: AtomOrder | None = None) -> None:
        self.text = text
        self.tokens = tokenize(text)
        self.i = 0
        self.resolve = resolve
        self.order = order

    # token helpers
    @property
    def tok(self) -> Token:
        return self.tokens[self.i]

    def error(self, message: str, tok: Token | None = None) -> DimParseError:
        return DimParseError(message, self.text, (tok or self.tok).col)

    def accept(self, text: str) -> bool:
        if self.tok.kind in ("op", "name") and self.tok.text == text:
            self.i += 1
            return True
        return False

    def expect(self, text: str) -> None:
        if not self.accept(text):
            found = self.tok.text or "end of text"
            raise self.error(f"expected {text!r}, found {found!r}")

    def finish(self) -> None:
        if self.tok.kind != "end":
            raise self.error(f"unexpected {self.tok.text!r}")

    def _note(self, p: Poly) -> Poly:
        if self.order is not None:
            self.order.register(p)
        return p

    # grammar
    def expr(self) -> Poly:
        left = self.term()
        while self.tok.text in ("+", "-") and self.tok.kind == "op":
            op = self.tok.text
            self.i += 1
            right = self.term()
            left = left + right if op == "+" else left - right
        return left

    def term(self) -> Poly:
        left = self.unary()
        while self.tok.text in ("*", "/", "%") and self.tok.kind == "op":
            op_tok = self.tok
            self.i += 1
            right = self.unary()
            if op_tok.text == "*":
                left = left * right
            else:
                if right.is_const and right.value == 0:
                    raise self.error("division by zero", op_tok)
                left = self._note(floordiv(left, right) if op_tok.text == "/" else mod(left, right))
        return left

    def unary(self) -> Poly:
        if self.accept("-"):
            return -self.unary()
        return self.primary()

    def primary(self) -> Poly:
        tok = self.tok
        if tok.kind == "int":
            self.i += 1
            return Poly.const(int(tok.text))
        if tok.kind == "name" and tok.text in ("min", "max") and self.tokens[self.i + 1].text == "(":
            self.i += 2
            a = self.expr()
            self.expect(",")
            b = self.expr()
            self.expect(")")
            return self._note(minimum(a, b) if tok.text == "min" else maximum(a, b))
        if tok.kind == "name":
            self.i += 1
            return self._note(self.resolve(tok.text, tok.col))
        if self.accept("("):
            inner = self.expr()
            self.expect(")")
            return inner
        found = tok.text or "end of text"
        raise self.error(f"expected a dimension, found {found!r}")


def _free(name: str, col: int) -> Poly:
    return Poly.sym(name)


def parse_dim(text: str, resolve: Resolver = _free, order: AtomOrder | None = None) -> Poly:
    """Parse one dimension expression such as ``(H + 2 * Pad - K) / Stride + 1``."""
    p = Parser(text, resolve, order)
    out = p.expr()
    p.finish()
    return out


_COMPARE = (">=", "<=", "==", ">", "<")


def parse_facts(text: str, resolve: Resolver = _free) -> list[Fact]:
    """Parse a ``where`` clause: comma-separated comparisons, e.g. ``Stride > 0, D % Heads == 0``."""
    p = Parser(text, resolve)
    facts: list[Fact] = []
    if p.tok.kind == "end":
        return facts
    while True:
        start = p.tok.col
        lhs = p.expr()
        op = p.tok
        if op.text not in _COMPARE:
            raise p.error("expected a comparison (>, >=, <, <=, ==)")
        p.i += 1
        rhs = p.expr()
        src = text[start : p.tok.col].strip()
        if op.text == "==":
            facts.append(Fact("eq", lhs, rhs, src))
        elif op.text in (">", ">="):
            facts.append(Fact("ge", lhs - rhs, Poly.const(1 if op.text == ">" else 0), src))
        else:
            facts.append(Fact("ge", rhs - lhs, Poly.const(1 if op.text == "<" else 0), src))
        if not p.accept(","):
            break
    p.finish()
    return facts
