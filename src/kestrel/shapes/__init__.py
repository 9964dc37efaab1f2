"""Dimension algebra: canonical polynomials, facts, the prover, parsing and printing.

Each module names its public API in ``__all__``; the package re-exports exactly those names.
"""

from . import facts, parse, poly
from .facts import *  # noqa: F403
from .parse import *  # noqa: F403
from .poly import *  # noqa: F403

__all__ = [*poly.__all__, *facts.__all__, *parse.__all__]
