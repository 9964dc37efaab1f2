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


@dataclass(frozen=True)
class LayoutSpec:
    """Layers whose kinds are data: the block's ``layout[name]`` picks one of ``kinds`` per layer.

    ``runs=False`` (``Layers``): a kind name gives one sub named as the member; a tuple of kind names
    gives one sub per layer, ``name_0``, ``name_1``, ... ``runs=True`` (``Runs``): consecutive layers
    of one kind form a sub array, ``name_0``, ``name_1``, ... one per run.
    """

    kinds: tuple[tuple[str, SubSpec], ...]
    runs: bool

    def kind(self, name: str) -> SubSpec | None:
        return dict(self.kinds).get(name)


def _layout_spec(item: Any, runs: bool) -> LayoutSpec:
    if not isinstance(item, dict) or not item or not all(isinstance(v, SubSpec) for v in item.values()):
        raise TypeError("Layers[...] / Runs[...] take a dict of kind name -> sub-block, e.g. "
                        "{'windowed': Layer['D, T'], 'global': Layer['D, T']}")
    return LayoutSpec(tuple(item.items()), runs)


class Layers:
    """``Layers[{"windowed": A["D, T"], "global": B["D, T"]}]``: one sub per layer, kinds from ``layout``."""

    def __class_getitem__(cls, item: Any) -> LayoutSpec:
        return _layout_spec(item, runs=False)


class Runs:
    """``Runs[{"windowed": A["D, T"], "global": B["D, T"]}]``: a sub array per run of one kind."""

    def __class_getitem__(cls, item: Any) -> LayoutSpec:
        return _layout_spec(item, runs=True)


def group_runs(kinds: tuple[str, ...]) -> list[tuple[str, int]]:
    """``("w", "w", "g", "w")`` -> ``[("w", 2), ("g", 1), ("w", 1)]``."""
    out: list[tuple[str, int]] = []
    for k in kinds:
        if out and out[-1][0] == k:
            out[-1] = (k, out[-1][1] + 1)
        else:
            out.append((k, 1))
    return out


def each(block: Any, name: str) -> list[Any]:
    """The layers a ``Layers`` member expands to, in order (in a block's function: ``for layer in
    each(self, "layer")``; the checker runs the loop unrolled, one typed call per layer)."""
    return [getattr(block, f"{name}_{i}") for i in range(len(block.layout[name]))]


def runs(block: Any, name: str) -> list[Any]:
    """The sub arrays a ``Runs`` member expands to, in order (``for run in runs(self, "stage_0"):
    for layer in run: ...``; the checker proves each run's loop for every layer count)."""
    return [getattr(block, f"{name}_{k}") for k in range(len(group_runs(tuple(block.layout[name]))))]
