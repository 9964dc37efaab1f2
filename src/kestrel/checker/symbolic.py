"""Symbolic dimensions and tensors: what a function body sees while the checker runs it.

A function body is ordinary Python over ``self.X`` generics, params, subs and std ops. Under the
checker, generics are :class:`SymDim` (canonical polynomials) and tensors are :class:`SymTensor`
(a tensor type); each std op dispatches to its shape rule instead of its torch kernel, and every
value is recorded in the function's :class:`~kestrel.checker.graph.Graph` with its source line.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ..errors import KestrelError
from ..shapes.facts import Facts
from ..shapes.poly import AtomOrder, Poly, format_poly, ge_text
from ..types.dtypes import DType, DTypeVar
from ..types.tensor import TensorType, Variadic
from .graph import Graph


class ShapeError(KestrelError):
    """Raised by a shape rule; the checker adds the source location and the function."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        self.message, self.hint = message, hint
        self.file, self.line = user_frame()  # the user's line that asked for the impossible
        super().__init__(message)


@dataclass
class Context:
    facts: Facts
    order: AtomOrder
    graph: Graph
    code: Any = None  # the checked function's code object: frames below it are its untyped helpers


_stack: list[Context] = []


def current() -> Context:
    if not _stack:
        raise RuntimeError("no function is being checked")
    return _stack[-1]


@contextmanager
def checking(ctx: Context) -> Iterator[Context]:
    _stack.append(ctx)
    try:
        yield ctx
    finally:
        _stack.pop()


# -------------------------------------------------------------------------------- source lines

_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_INTERNAL = tuple(os.path.join(_PKG, d) for d in ("checker", "shapes", "types", os.path.join("std", "ops")))


def user_frame() -> tuple[str, int]:
    """The file and line of the innermost frame outside the checker machinery: the user's source."""
    f = sys._getframe(1)
    while f is not None:
        name = os.path.abspath(f.f_code.co_filename)
        if not name.startswith(_INTERNAL) and "functools" not in name and "contextlib" not in name:
            return f.f_code.co_filename, f.f_lineno
        f = f.f_back  # type: ignore[assignment]
    return "<unknown>", 0


# ---------------------------------------------------------------------------------- dimensions


def fmt(p: Poly) -> str:
    return format_poly(p, current().order if _stack else None)


def as_poly(x: Any) -> Poly:
    if isinstance(x, SymDim):
        return x.poly
    if isinstance(x, Poly):
        return x
    if isinstance(x, int) and not isinstance(x, bool):
        return Poly.const(x)
    raise ShapeError(f"expected a dimension (int or generic), got {type(x).__name__}")


def require_positive(d: Poly) -> None:
    if not current().facts.positive(d):
        raise ShapeError(f"cannot prove the divisor {fmt(d)} is positive", hint=positive_hint(d))


def positive_hint(d: Poly) -> str:
    """The fact that makes ``d > 0``: for a product, its factors not yet known positive (``Heads > 0``)."""
    facts, order = current().facts, current().order
    if len(d.terms) == 1 and d.terms[0][1] > 0 and d.terms[0][0]:
        missing = [a for a in dict.fromkeys(d.terms[0][0]) if not facts.positive(Poly.atom(a))]
        if missing:
            return ", ".join(ge_text(Poly.atom(a), order, True).replace(" > 0", "") + " > 0" for a in missing)
    return ge_text(d, order, True)


class SymDim:
    """A dimension under the checker: arithmetic builds polynomials; comparisons must be provable."""

    __slots__ = ("poly",)

    def __init__(self, poly: Poly) -> None:
        self.poly = poly

    def __repr__(self) -> str:
        return fmt(self.poly)

    __str__ = __repr__

    def __add__(self, o: Any) -> SymDim:
        return SymDim(self.poly + as_poly(o))

    __radd__ = __add__

    def __sub__(self, o: Any) -> SymDim:
        return SymDim(self.poly - as_poly(o))

    def __rsub__(self, o: Any) -> SymDim:
        return SymDim(as_poly(o) - self.poly)

    def __mul__(self, o: Any) -> SymDim:
        if isinstance(o, float):
            raise ShapeError(f"a dimension times a float ({self} * {o}) is not a dimension")
        return SymDim(self.poly * as_poly(o))

    __rmul__ = __mul__

    def __neg__(self) -> SymDim:
        return SymDim(-self.poly)

    def __floordiv__(self, o: Any) -> SymDim:
        d = as_poly(o)
        require_positive(d)
        return SymDim(self.poly // d)

    def __rfloordiv__(self, o: Any) -> SymDim:
        require_positive(self.poly)
        return SymDim(as_poly(o) // self.poly)

    def __mod__(self, o: Any) -> SymDim:
        d = as_poly(o)
        require_positive(d)
        return SymDim(self.poly % d)

    def __truediv__(self, o: Any) -> Any:
        raise ShapeError(f"true division of the dimension {self}: use // for dimensions")

    def __pow__(self, k: int) -> SymDim:
        out = Poly.const(1)
        for _ in range(k):
            out = out * self.poly
        return SymDim(out)

    # comparisons decide branches: they must be provable one way or the other
    def _decide(self, op: str, o: Any) -> bool:
        facts = current().facts
        a, b = self.poly, as_poly(o)
        tests = {
            "==": (lambda: facts.equal(a, b), lambda: facts.positive(a - b) or facts.positive(b - a)),
            "!=": (lambda: facts.positive(a - b) or facts.positive(b - a), lambda: facts.equal(a, b)),
            ">=": (lambda: facts.nonneg(a - b), lambda: facts.positive(b - a)),
            ">": (lambda: facts.positive(a - b), lambda: facts.nonneg(b - a)),
            "<=": (lambda: facts.nonneg(b - a), lambda: facts.positive(a - b)),
            "<": (lambda: facts.positive(b - a), lambda: facts.nonneg(a - b)),
        }
        yes, no = tests[op]
        if yes():
            return True
        if no():
            return False
        cond = f"{fmt(a)} {op} {fmt(b)}"
        negation = {"==": ("eq", a, b), ">=": ("ge", a, b), ">": ("ge", a, b + 1), "<=": ("ge", b, a),
                    "<": ("ge", b, a + 1)}.get(op)
        found = facts.counterexample(*negation) if negation is not None else None
        names = sorted({s.name for p in (a, b) for s in p.symbols()})
        false_at = (f" (it is false at {', '.join(f'{n} = {found[n]}' for n in names)})"
                    if found and names and all(n in found for n in names) else "")
        raise ShapeError(f"branch on the symbolic condition `{cond}`, which cannot be decided for every "
                         f"binding of the generics{false_at}", hint=cond)

    def __eq__(self, o: object) -> bool:  # type: ignore[override]
        return self._decide("==", o)

    def __ne__(self, o: object) -> bool:  # type: ignore[override]
        return self._decide("!=", o)

    def __ge__(self, o: Any) -> bool:
        return self._decide(">=", o)

    def __gt__(self, o: Any) -> bool:
        return self._decide(">", o)

    def __le__(self, o: Any) -> bool:
        return self._decide("<=", o)

    def __lt__(self, o: Any) -> bool:
        return self._decide("<", o)

    def __bool__(self) -> bool:
        return self._decide("!=", 0)

    def __hash__(self) -> int:
        return hash(self.poly)

    def __index__(self) -> int:
        if self.poly.is_const:
            return self.poly.value
        raise ShapeError(f"the dimension {self} is symbolic; an int is needed here")

    __int__ = __index__


def dim_of(x: Any) -> SymDim | int:
    """Give a rule's result dimension back to user code: an int when constant."""
    p = as_poly(x)
    return p.value if p.is_const else SymDim(p)


# ------------------------------------------------------------------------------------- tensors

# std registers the tensor methods (``x.reshape``, ``x + y``...) here: the checker stays below std.
METHODS: dict[str, Callable[..., Any]] = {}


def _operator(method: str, reflected: bool = False) -> Callable[[Any, Any], Any]:
    """A tensor operator that calls the registered ``method`` op: ``x op o`` as ``method(x, o)``, or
    when ``reflected`` (``__radd__``...: ``o`` stood on the left) as ``method(o, x)``."""

    def operator(self: Any, o: Any) -> Any:
        return METHODS[method](o, self) if reflected else METHODS[method](self, o)

    return operator


class SymTensor:
    """A tensor under the checker: its type, and its id in the function's graph."""

    __slots__ = ("row_major", "type", "vid")

    def __init__(self, type: TensorType, vid: int | None = None, row_major: bool = False) -> None:
        self.type = type
        self.vid = vid if vid is not None else current().graph.add_value(type)
        self.row_major = row_major  # proved row-major (``view`` needs it); unknown layouts are not

    def __repr__(self) -> str:
        return f"SymTensor({self.type.format(current().order if _stack else None)})"

    @property
    def dims(self) -> tuple[Poly | Variadic, ...]:
        return self.type.dims

    @property
    def dtype(self) -> DType | DTypeVar:
        return self.type.dtype

    def fixed_dims(self, what: str = "this op") -> list[Poly]:
        if any(isinstance(d, Variadic) for d in self.dims):
            raise ShapeError(f"{what} needs every axis of {self.show()}, but *{self._var()} hides some")
        return list(self.dims)  # type: ignore[arg-type]

    def _var(self) -> str:
        return next(d.name for d in self.dims if isinstance(d, Variadic))

    def show(self) -> str:
        return self.type.format(current().order)

    @property
    def shape(self) -> tuple[SymDim | int, ...]:
        return tuple(dim_of(d) for d in self.fixed_dims("taking .shape"))

    @property
    def ndim(self) -> int:
        return len(self.fixed_dims("taking .ndim"))

    def dim(self) -> int:
        return self.ndim

    def size(self, i: int | None = None) -> Any:
        if i is None:
            return self.shape
        if i < 0 and self.type.rank is None:  # counting from the end through a variadic run is fine
            tail = self.dims[i]
            if not isinstance(tail, Variadic):
                return dim_of(tail)
        return self.shape[i]

    def __getattr__(self, name: str) -> Any:
        method = METHODS.get(name)
        if method is None:
            raise AttributeError(f"tensors under the checker have no method {name!r}; use a kestrel.std op")
        return functools.partial(method, self)

    # operators dispatch through the same registry
    __add__ = _operator("add")
    __radd__ = _operator("add", reflected=True)
    __sub__ = _operator("sub")
    __rsub__ = _operator("sub", reflected=True)
    __mul__ = _operator("mul")
    __rmul__ = _operator("mul", reflected=True)
    __truediv__ = _operator("div")
    __rtruediv__ = _operator("div", reflected=True)
    __matmul__ = _operator("matmul")
    __getitem__ = _operator("getitem")

    def __neg__(self) -> Any:
        return METHODS["mul"](self, -1)

    def __bool__(self) -> bool:
        raise ShapeError("the truth value of a tensor depends on its data, not its type")


def is_symbolic(args: tuple, kwargs: dict) -> bool:
    for a in (*args, *kwargs.values()):
        if isinstance(a, SymTensor | SymDim):
            return True
        if isinstance(a, list | tuple) and any(isinstance(x, SymTensor | SymDim) for x in a):
            return True
    return False


def _tensors_in(x: Any) -> list[SymTensor]:
    if isinstance(x, SymTensor):
        return [x]
    if isinstance(x, list | tuple):
        return [t for item in x for t in _tensors_in(item)]
    if isinstance(x, dict):
        return [t for item in x.values() for t in _tensors_in(item)]
    return []


def op(name: str, layout: str = "unknown", recorded: bool = True) -> Callable[[Callable[..., Any]], Any]:
    """Make a std op from its torch kernel; attach its shape rule with ``@the_op.rule``.

    Called with torch tensors it runs the kernel; called with symbolic tensors it runs the rule and
    records a node in the graph of the function being checked. ``layout`` says what the checker may
    assume of the results' memory layout: ``"preserve"`` (row-major when every tensor argument is),
    ``"fresh"`` (always row-major) or ``"unknown"``. An op that is not ``recorded`` (a layout change the
    graph does not draw, like the method ``x.contiguous()``) adds no node: its rule returns the value itself.
    """

    def wrap(kernel: Callable[..., Any]) -> Any:
        rule_box: list[Callable[..., Any]] = []

        @functools.wraps(kernel)
        def dispatch(*args: Any, **kwargs: Any) -> Any:
            if not (_stack and is_symbolic(args, kwargs)):
                return kernel(*args, **kwargs)
            out = rule_box[0](*args, **kwargs)
            inputs = _tensors_in((args, kwargs))
            outs = _tensors_in(out)
            row_major = layout == "fresh" or (layout == "preserve" and all(t.row_major for t in inputs))
            for t in outs:
                t.row_major = row_major
            if recorded:
                record(name, inputs, outs)
            return out

        def rule(fn: Callable[..., Any]) -> Callable[..., Any]:
            rule_box.append(fn)
            return fn

        dispatch.rule = rule  # type: ignore[attr-defined]
        dispatch.kernel = kernel  # type: ignore[attr-defined]
        dispatch.op_name = name  # type: ignore[attr-defined]
        return dispatch

    return wrap


def helper_scope(code: Any) -> tuple[tuple[str, int], ...]:
    """The untyped helpers (methods or local functions) the checked function ``code`` is inside, outermost first.

    Each is ``(name, call site)``: the call site (the caller's bytecode offset) tells two calls of one helper
    apart. Comprehensions and lambdas are not helpers; frames of the checker machinery are skipped.
    """
    if code is None:
        return ()
    found: list[tuple[str, int]] = []
    f = sys._getframe(1)
    while f is not None and f.f_code is not code:
        name = os.path.abspath(f.f_code.co_filename)
        if not name.startswith(_SCOPELESS) and not f.f_code.co_name.startswith("<"):
            caller = f.f_back
            found.append((f.f_code.co_name, caller.f_lasti if caller is not None else 0))
        f = f.f_back  # type: ignore[assignment]
    return tuple(reversed(found)) if f is not None else ()


_SCOPELESS = (*_INTERNAL, os.path.join(_PKG, "blocks"), os.path.dirname(functools.__file__))


def record(name: str, inputs: list[SymTensor], outputs: list[SymTensor], kind: str = "op", detail: str = "") -> Any:
    file, line = user_frame()
    ctx = current()
    node = ctx.graph.add_node(kind, name, [t.vid for t in inputs], [t.vid for t in outputs], file, line, detail)
    node.scope = helper_scope(ctx.code)
    return node
