"""The public description of the ``kestrel`` commands: every command, declared through :mod:`.options`.

``kestrel --help``, each ``kestrel CMD --help``, the registry site and the CLI fuzzer all read the same
declarations: :func:`all_commands` returns them in the order ``kestrel --help`` lists them. A new command
module registers its :class:`~kestrel.cli.options.Command` when imported; add its name to :data:`MODULES`.
"""

from __future__ import annotations

import importlib
from typing import Any

from .options import REGISTRY, Command

MODULES = ("models", "tasks", "site", "segment", "track", "serve", "doctor")

__all__ = ["MODULES", "all_commands", "command_names", "describe", "load_all"]


def load_all() -> None:
    """Import every command module (each registers its commands)."""
    for name in MODULES:
        importlib.import_module(f"{__package__}.{name}")


def all_commands() -> list[Command]:
    """Every command, in registration order."""
    load_all()
    return list(REGISTRY.values())


def command_names() -> set[str]:
    """The names of every ``kestrel`` command (what the site links to)."""
    return {c.name for c in all_commands()}


def describe() -> list[dict[str, Any]]:
    """Every command and its options as plain data (what a page or a fuzzer reads), sorted by name."""
    load_all()
    return [REGISTRY[name].describe() for name in sorted(REGISTRY)]
