"""The one base class of every error that describes a user's mistake.

Anything Kestrel raises because of bad input (a model name, a file, a flag, a shape, a checkpoint, an
image, an output path) is a :class:`KestrelError`. The ``kestrel`` command prints such an error as one
``kestrel COMMAND: error: ...`` message and exits with its :attr:`~KestrelError.exit_code` (2: usage or
input error), never with a traceback; any other exception is a bug in Kestrel. Each subclass also keeps
the builtin base it had before (``ValueError``, ``TypeError``...), so ``except ValueError`` still works.

Exit codes of the command (also in ``kestrel --help``):

=====  =====================================================================
0      success
1      a check failed (``kestrel check`` found type errors)
2      usage or input error: a bad flag, model, file, image, checkpoint, path
3      internal error: a bug in Kestrel (rerun with ``--debug`` for the traceback)
130    interrupted (Ctrl-C)
=====  =====================================================================
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType

EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERNAL = 3
EXIT_INTERRUPTED = 130


class KestrelError(Exception):
    """A user's mistake, described in one message that names the thing, what was expected and what was found.

    Raise a subclass (or this class) for anything the user can fix; the command line prints the message
    without a traceback and exits with :attr:`exit_code`.
    """

    exit_code: int = EXIT_USAGE


class UsageError(KestrelError, ValueError):
    """A command-line argument or a combination of them that cannot work (beyond what argparse checks)."""


class OutputError(KestrelError, OSError):
    """An output path that cannot be written: a symlink or device in the way, no permission, no space."""

    def __init__(self, message: str) -> None:
        # OSError's (errno, strerror) constructor would reformat the message: keep it as given.
        Exception.__init__(self, message)

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class KestrelWarning(UserWarning):
    """Advice the user should see but that does not stop the work (a slow path chosen, say). The
    command line prints it as one ``kestrel COMMAND: warning: ...`` line."""


def import_extra(*modules: str, error: Callable[[str], Exception], message: str) -> ModuleType:
    """Import an optional dependency (a ``pip install 'kestrel[...]'`` extra): ``modules`` in order,
    returning the first; when one is missing raise ``error(message)``, a message naming the extra,
    without the ImportError's traceback."""
    try:
        imported = [importlib.import_module(m) for m in modules]
    except ImportError:
        raise error(message) from None
    return imported[0]


__all__ = ["EXIT_CHECK_FAILED", "EXIT_INTERNAL", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_USAGE", "KestrelError",
           "KestrelWarning", "OutputError", "UsageError", "import_extra"]
