"""The typed graph a checked function leaves behind: every value with its type and source line."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..shapes.poly import AtomOrder
from ..types.tensor import TensorType


@dataclass
class Value:
    id: int
    type: TensorType
    name: str | None = None  # an input's or param's name


@dataclass
class Node:
    id: int
    kind: str  # "input", "param", "op", "sub", "fn", "output"
    op: str  # op name, sub path (``layers[i]``), or input/param name
    inputs: list[int]
    outputs: list[int]
    file: str | None = None
    line: int | None = None
    detail: str = ""  # a sub's block type, an op's attributes
    # for a call into a sub or own function: the callee, and its generics in the caller's terms
    callee: tuple[str, str] | None = None
    subst: dict[str, Any] | None = None
    # the untyped helpers (``self._fourier``, a local ``def heads``) this node was recorded in, outermost
    # first, each as (name, call site)
    scope: tuple[tuple[str, int], ...] = ()


@dataclass
class Graph:
    """Nodes in execution order; edges are the value ids they consume and produce."""

    block: str
    function: str
    order: AtomOrder
    values: dict[int, Value] = field(default_factory=dict)
    nodes: list[Node] = field(default_factory=list)

    def add_value(self, t: TensorType, name: str | None = None) -> int:
        vid = len(self.values)
        self.values[vid] = Value(vid, t, name)
        return vid

    def add_node(self, kind: str, op: str, inputs: list[int], outputs: list[int],
                 file: str | None = None, line: int | None = None, detail: str = "") -> Node:
        node = Node(len(self.nodes), kind, op, inputs, outputs, file, line, detail)
        self.nodes.append(node)
        return node

    def type_of(self, vid: int) -> str:
        return self.values[vid].type.format(self.order)
