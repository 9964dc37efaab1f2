"""Argument types of the ``kestrel`` command, kept for code that imported them: each is a kind of
:mod:`kestrel.cli.options` (declare new options there, through :class:`~kestrel.cli.options.Option`)."""

from __future__ import annotations

from collections.abc import Callable

from .options import Device, ExistingDir, Int, Template

__all__ = ["device", "existing_dir", "int_at_least", "non_negative_int", "positive_int", "template"]


def int_at_least(low: int, what: str = "an integer") -> Callable[[str], int]:
    """A parser of integers ``>= low`` (``positive_int`` is ``int_at_least(1)``)."""
    return Int(low, None, what)


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)
device = Device()
existing_dir = ExistingDir(hint="give a folder with config.json and *.safetensors")
template = Template()
