"""Tensor types, dtypes and the type notation parser.

Each module names its public API in ``__all__``; the package re-exports exactly those names.
"""

from . import dtypes, tensor
from .dtypes import *  # noqa: F403
from .tensor import *  # noqa: F403

__all__ = [*dtypes.__all__, *tensor.__all__]
