"""Argument types for the ``kestrel`` command: every flag is range-checked while parsing.

Each function takes the flag's text and returns the value, or raises ``argparse.ArgumentTypeError`` with
a message that says what was expected; argparse turns that into ``kestrel CMD: error: argument --flag:
...`` and exit status 2, before any model is loaded.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable

__all__ = ["device", "existing_dir", "int_at_least", "non_negative_int", "positive_int", "template"]


def int_at_least(low: int, what: str = "an integer") -> Callable[[str], int]:
    """A parser of integers ``>= low`` (``positive_int`` is ``int_at_least(1)``)."""

    def parse(text: str) -> int:
        try:
            value = int(text, 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what} >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected {what} >= {low}, got {value}")
        return value

    parse.__name__ = f"int>={low}"  # argparse names the type in some messages
    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)

_DEVICE = re.compile(r"^(cpu|cuda|mps)(:\d+)?$")


def device(text: str) -> str:
    """``cpu``, ``cuda``, ``cuda:N`` or ``mps``, available in this torch build."""
    name = text.strip().lower()
    m = _DEVICE.match(name)
    if m is None:
        raise argparse.ArgumentTypeError(f"expected cpu, cuda, cuda:N or mps, got {text!r}")
    import torch

    kind, index = m.group(1), m.group(2)
    if kind == "cuda":
        if not torch.cuda.is_available():
            build = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA device is visible"
            raise argparse.ArgumentTypeError(f"{text!r} is not available: {build} (torch {torch.__version__}); "
                                             "use --device cpu")
        count = torch.cuda.device_count()
        if index is not None and int(index[1:]) >= count:
            raise argparse.ArgumentTypeError(f"{text!r} is not available: {count} CUDA device(s), numbered from 0")
    elif kind == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise argparse.ArgumentTypeError(f"{text!r} is not available on this machine; use --device cpu")
    elif kind == "cpu" and index not in (None, ":0"):
        raise argparse.ArgumentTypeError(f"expected cpu, got {text!r}")
    return name


def existing_dir(text: str) -> str:
    """A folder that exists (``--weights DIR``)."""
    import os

    if not os.path.isdir(text):
        what = "is a file, not a folder" if os.path.exists(text) else "does not exist"
        raise argparse.ArgumentTypeError(f"{text!r} {what}; give a folder with config.json and *.safetensors")
    return text


def template(text: str) -> str:
    """A prompt template with exactly one ``{}`` where the text goes (``"a photo of {}."``)."""
    if "{}" not in text:
        raise argparse.ArgumentTypeError(f"the template {text!r} has no '{{}}' where the text goes, "
                                         "e.g. 'a photo of {}.'")
    try:
        text.format("x")
    except (IndexError, KeyError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"the template {text!r} is not a valid format string with one {{}}: "
                                         f"{e}; write literal braces as {{{{ and }}}}") from None
    return text
