"""The vocabulary of block declarations: generic kinds, params, subs, sub arrays, entries.

These are the names a model file writes in its class bodies::

    class Linear(Block, module="std.nn.linear"):
        In: Dim; Out: Dim; T: Float = bf16
        weight: Param["Out, In; T"]
        bias: Param["Out; T", optional]
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar


class Dim:
    """Kind of a dimension generic."""


class Shape:
    """Kind of a variadic shape generic (``*S``)."""


class _Optional:
    def __repr__(self) -> str:
        return "optional"


optional = _Optional()


@dataclass(frozen=True)
class ParamSpec:
    text: str
    optional: bool


class Param:
    """``Param["Out, In; T"]`` declares a parameter; ``Param["Out; T", optional]`` may be absent."""

    def __class_getitem__(cls, item: Any) -> ParamSpec:
        if isinstance(item, tuple):
            text, *flags = item
            unknown = [f for f in flags if f is not optional]
            if unknown:
                raise TypeError(f"Param[...] takes a type and optionally `optional`, not {unknown}")
            return ParamSpec(text, bool(flags))
        return ParamSpec(item, False)


@dataclass(frozen=True)
class SubSpec:
    """``Linear["D, 3 * D, T"]``: a sub-block with its generic arguments."""

    block: type
    args: str


@dataclass(frozen=True)
class ArraySpec:
    """``Array[EncoderLayer["D, Heads, Inner, T"], "Layers"]``: N sub-blocks of one type."""

    sub: SubSpec
    count: str


class Array:
    def __class_getitem__(cls, item: tuple[SubSpec, str | int]) -> ArraySpec:
        sub, count = item
        if not isinstance(sub, SubSpec):
            raise TypeError("Array[...] takes a sub-block such as Layer['D, T'] and a count")
        return ArraySpec(sub, str(count))


F = TypeVar("F", bound=Callable[..., Any])


def entry(fn: F) -> F:
    """Mark a method as a model entry (``pub entry``): callable by users, checked at every call."""
    fn.__kestrel_entry__ = True  # type: ignore[attr-defined]
    return fn
