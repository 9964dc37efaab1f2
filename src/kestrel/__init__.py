"""Kestrel: vision foundation models as typed, shape-checked programs."""

__version__ = "0.1.0"
