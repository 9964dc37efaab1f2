"""Dimension algebra: canonical polynomials, facts, the prover, parsing and printing."""

from .facts import Fact, Facts
from .parse import DimParseError, parse_dim, parse_facts
from .poly import (
    ONE,
    ZERO,
    Atom,
    AtomOrder,
    FloorDiv,
    Max,
    Min,
    Mod,
    Poly,
    Sym,
    evaluate,
    floordiv,
    format_poly,
    maximum,
    minimum,
    mod,
    substitute,
)

__all__ = [
    "ONE", "ZERO", "Atom", "AtomOrder", "DimParseError", "Fact", "Facts", "FloorDiv", "Max", "Min",
    "Mod", "Poly", "Sym", "evaluate", "floordiv", "format_poly", "maximum", "minimum", "mod",
    "parse_dim", "parse_facts", "substitute",
]
