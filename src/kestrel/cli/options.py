"""The declarative option layer of the ``kestrel`` command: every option of every command, declared once.

A command is a :class:`Command`: its name, the function that runs it (whose docstring is the
command's help) and a list of :class:`Option`. An option names its flags (or its positional name) and
its :class:`Kind`: a typed, range-checked parser with one error style. ``argparse`` is built from these declarations
(:func:`add_command`), ``--help`` prints them, :func:`kestrel.cli.commands.describe` gives them as data,
and the CLI fuzzer (``tests/test_cli_fuzz.py``) generates bad values for every option from each kind's
:attr:`Kind.bad` classes. No command re-parses a value by hand.

One error style: a kind raises ``argparse.ArgumentTypeError`` whose text says what was expected and what
was given (``expected an integer >= 1, got '0'``); argparse prefixes it with the option
(``kestrel bench: error: argument --repeat: ...``) and exits 2, before any model is loaded. A path kind
names the path and the reason (``'x.npy': not a NumPy .npy array: ...``); special files (FIFOs, devices,
sockets) are refused before they are opened, so nothing blocks.

Adopting the layer in a new command (e.g. ``cli/track.py``)::

    from .options import Command, Option, PositiveInt, ImageFile, OutDir, register

    def cmd_track(args):
        '''one line for `kestrel --help`

        The paragraphs `kestrel track --help` prints before the options.
        '''

    COMMAND = register(Command(
        "track", run=cmd_track, epilog="...",
        options=[
            Option("video", ImageFile(), help="the video"),           # a positional: no leading '-'
            Option("--every", PositiveInt(), default=1, help="..."),
            Option("--out", OutDir(), required=True, help="..."),
            *MODEL_OPTIONS,                                           # shared groups are plain lists
        ]))

and list the module in :data:`kestrel.cli.commands.MODULES`. ``Option(..., kind=None)`` is a switch
(``store_true``); ``nargs``, ``action="append"``, ``default``, ``required``, ``group`` and ``dest`` mean
what they mean to argparse.
"""

from __future__ import annotations

import argparse
import inspect
import math
import os
import re
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "REGISTRY",
    "Box",
    "Choice",
    "Command",
    "Device",
    "ExistingDir",
    "ExistingFile",
    "ExistingPath",
    "Float",
    "GenericNames",
    "Host",
    "ImageFile",
    "Int",
    "IntList",
    "Kind",
    "ModelRef",
    "NewFile",
    "NpyFile",
    "Option",
    "OutDir",
    "PixelSize",
    "Point",
    "Port",
    "PositiveInt",
    "Probability",
    "Template",
    "Text",
    "Threads",
    "add_command",
    "register",
    "shown",
    "special_file_reason",
]

Bad = ArgumentTypeError = argparse.ArgumentTypeError
PATH_LIMIT = 4096  # a path is shown whole; other values are cut at 80 characters


def shown(text: object, limit: int = 80) -> str:
    """A user's value in quotes, printable whatever it holds: a non-UTF-8 file name shows as ``caf\\xe9.png``,
    control characters escaped; cut to ``limit`` characters (a label pasted where a path goes) in the middle, so
    that both ends show: a path's folder and its file name."""
    raw = os.fspath(text) if isinstance(text, os.PathLike) else str(text)
    try:
        safe = os.fsencode(raw).decode("utf-8", "backslashreplace")
    except (UnicodeError, TypeError, ValueError):
        safe = raw.encode("utf-8", "backslashreplace").decode("utf-8")
    safe = "".join(c if c.isprintable() else repr(c)[1:-1] for c in safe)
    if len(safe) > limit:
        tail = (limit - 5) // 2
        return f"'{safe[: limit - 5 - tail]}...{safe[len(safe) - tail:]}' ({len(safe)} characters)"
    return f"'{safe}'"


# ------------------------------------------------------------------------------------------- kinds

class Kind:
    """A typed option value: :meth:`parse` turns the text into the value or raises ``ArgumentTypeError``.

    :attr:`expect` says in words what is accepted (``--help`` and the site print it); :attr:`metavar` is the
    placeholder; :attr:`bad` lists the classes of wrong value the CLI fuzzer tries on it (``zero``,
    ``negative``, ``empty``, ``nan``, ``inf``, ``huge``, ``word``, ``fraction``, ``missing``, ``folder``,
    ``file``, ``fifo``, ``dangling``, ``non_utf8``, ``corrupt``).
    """

    metavar: str | None = None

    @property
    def expect(self) -> str:
        return "a value"

    def parse(self, text: str) -> Any:
        return text

    def __call__(self, text: str) -> Any:  # argparse calls ``type(text)``
        return self.parse(text)

    @property
    def __name__(self) -> str:  # argparse names the type in some messages
        return type(self).__name__

    @property
    def bad(self) -> tuple[str, ...]:
        return ()

    def describe(self) -> dict[str, Any]:
        return {"kind": type(self).__name__, "expect": self.expect}


def _number(text: str, what: str) -> float:
    try:
        value = float(text.strip())
    except ValueError:
        raise Bad(f"expected {what}, got {shown(text)}") from None
    if not math.isfinite(value):
        raise Bad(f"expected {what}, got {shown(text)} (not a finite number)")
    return value


@dataclass(frozen=True)
class Int(Kind):
    """An integer in ``[low, high]`` (``high`` None: no upper bound)."""

    low: int = 1
    high: int | None = None
    what: str = "an integer"
    metavar: str | None = "N"

    @property
    def expect(self) -> str:
        return f"{self.what} >= {self.low}" if self.high is None else f"{self.what} from {self.low} to {self.high}"

    def parse(self, text: str) -> int:
        try:
            value = int(text.strip(), 10)
        except ValueError:
            raise Bad(f"expected {self.expect}, got {shown(text)}") from None
        if value < self.low or (self.high is not None and value > self.high):
            raise Bad(f"expected {self.expect}, got {value}")
        return value

    @property
    def bad(self) -> tuple[str, ...]:
        classes = ["empty", "word", "fraction", "nan", "inf"]
        classes += ["zero"] if self.low > 0 else []
        classes += ["negative"] if self.low >= 0 else []
        classes += ["huge"] if self.high is not None else []
        return tuple(classes)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "low": self.low, "high": self.high}


def PositiveInt(high: int | None = None, what: str = "an integer", metavar: str = "N") -> Int:
    """An integer >= 1."""
    return Int(1, high, what, metavar)


def Threads() -> Int:
    """A thread count, 1 to 4096 (0 is refused everywhere: torch would fall back to its default silently)."""
    return Int(1, 4096, "a thread count", "N")


def PixelSize() -> Int:
    """An image side in pixels, 1 to 16384 (whether a model takes it is checked against the model)."""
    return Int(1, 16384, "a size in pixels", "PX")


def Port() -> Int:
    """A TCP port, 0 (any free port) to 65535."""
    return Int(0, 65535, "a port", "PORT")


@dataclass(frozen=True)
class IntList(Kind):
    """A comma-separated list of integers in ``[low, high]``: ``1,8``."""

    low: int = 1
    high: int | None = None
    metavar: str | None = "N,N..."

    @property
    def expect(self) -> str:
        return Int(self.low, self.high).expect.replace("an integer", "comma-separated integers")

    def parse(self, text: str) -> list[int]:
        one = Int(self.low, self.high)
        parts = text.split(",")
        if any(not p.strip() for p in parts):
            raise Bad(f"expected {self.expect} such as 1,8, got {shown(text)} (an empty item)")
        try:
            return [one.parse(p) for p in parts]
        except Bad as e:
            raise Bad(f"{e} in {shown(text)}") from None

    @property
    def bad(self) -> tuple[str, ...]:
        return ("empty", "word", "zero", "negative", "nan", "double_comma") + (("huge",) if self.high else ())


@dataclass(frozen=True)
class Float(Kind):
    """A finite number in ``[low, high]``."""

    low: float = 0.0
    high: float | None = None
    what: str = "a number"
    metavar: str | None = "X"

    @property
    def expect(self) -> str:
        return f"{self.what} >= {self.low:g}" if self.high is None else \
            f"{self.what} from {self.low:g} to {self.high:g}"

    def parse(self, text: str) -> float:
        value = _number(text, self.expect)
        if value < self.low or (self.high is not None and value > self.high):
            raise Bad(f"expected {self.expect}, got {value:g}")
        return value

    @property
    def bad(self) -> tuple[str, ...]:
        return ("empty", "word", "nan", "inf", "negative") + (("huge",) if self.high is not None else ())


def Probability() -> Float:
    """A number from 0 to 1 (a threshold, an IoU)."""
    return Float(0.0, 1.0, "a probability", "P")


@dataclass(frozen=True)
class Point(Kind):
    """``X,Y`` or ``X,Y:LABEL`` in pixels of the image: finite, >= 0; label 1, 0, -1 or -10.

    Whether the point lies inside the image is checked once the image is read (see
    :mod:`kestrel.pipelines.input_rules`)."""

    expect: str = "X,Y[:LABEL], two finite numbers >= 0 and a label 1, 0, -1 or -10"
    metavar: str | None = "X,Y[:LABEL]"

    def parse(self, text: str) -> tuple[tuple[float, float], int]:
        xy, _, label = text.partition(":")
        x, y = _coords(text, xy, 2, self.expect)
        if label:
            try:
                lab = int(label)
            except ValueError:
                lab = None
            if lab not in (1, 0, -1, -10):
                raise Bad(f"expected {self.expect}, got {shown(text)} (label {shown(label)})")
        return (x, y), int(label) if label else 1

    @property
    def bad(self) -> tuple[str, ...]:
        return ("empty", "word", "nan", "inf", "negative", "one_number", "bad_label")


@dataclass(frozen=True)
class Box(Kind):
    """``X0,Y0,X1,Y1`` in pixels of the image: finite, >= 0, ``X0 <= X1`` and ``Y0 <= Y1``."""

    expect: str = "X0,Y0,X1,Y1, four finite numbers >= 0 with X0 <= X1 and Y0 <= Y1"
    metavar: str | None = "X0,Y0,X1,Y1"

    def parse(self, text: str) -> tuple[float, float, float, float]:
        x0, y0, x1, y1 = _coords(text, text, 4, self.expect)
        if x0 > x1 or y0 > y1:
            raise Bad(f"expected {self.expect}, got {shown(text)} (corners out of order)")
        return x0, y0, x1, y1

    @property
    def bad(self) -> tuple[str, ...]:
        return ("empty", "word", "nan", "inf", "negative", "one_number")


def _coords(whole: str, text: str, n: int, expect: str) -> list[float]:
    parts = text.split(",")
    if len(parts) != n:
        raise Bad(f"expected {expect}, got {shown(whole)}")
    values = [_number(p, expect) for p in parts]
    if any(v < 0 for v in values):
        raise Bad(f"expected {expect}, got {shown(whole)} (a negative coordinate lies outside the image)")
    return values


@dataclass(frozen=True)
class Choice(Kind):
    """One of a fixed set of words."""

    choices: tuple[str, ...] = ()
    metavar: str | None = None

    @property
    def expect(self) -> str:
        return "one of " + ", ".join(self.choices)

    def parse(self, text: str) -> str:
        if text not in self.choices:
            raise Bad(f"expected {self.expect}, got {shown(text)}")
        return text

    @property
    def bad(self) -> tuple[str, ...]:
        return ("empty", "word", "zero")

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "choices": list(self.choices)}


@dataclass(frozen=True)
class Text(Kind):
    """Free text that must not be empty or only spaces (a label, an entry name, a column)."""

    what: str = "text"
    metavar: str | None = "TEXT"

    @property
    def expect(self) -> str:
        return f"non-empty {self.what}"

    def parse(self, text: str) -> str:
        if not text.strip():
            raise Bad(f"expected {self.expect}, got {shown(text)}")
        if "\x00" in text:
            raise Bad(f"expected {self.expect}, got {shown(text)} (a NUL character)")
        return text

    @property
    def bad(self) -> tuple[str, ...]:
        return ("empty", "spaces", "nul")


@dataclass(frozen=True)
class Template(Kind):
    """A format string with exactly one ``{}`` where the text goes (``"a photo of {}."``)."""

    expect: str = "a template with one {} where the text goes, e.g. 'a photo of {}.'"
    metavar: str | None = "TEMPLATE"

    def parse(self, text: str) -> str:
        if "\x00" in text:
            raise Bad(f"the template {shown(text)} holds a NUL character")
        if "{}" not in text:
            raise Bad(f"the template {shown(text)} has no '{{}}' where the text goes, e.g. 'a photo of {{}}.'")
        try:
            text.format("x")
        except (IndexError, KeyError, ValueError) as e:
            raise Bad(f"the template {shown(text)} is not a valid format string with one {{}}: {e}; "
                      "write literal braces as {{ and }}") from None
        return text

    @property
    def bad(self) -> tuple[str, ...]:
        return ("empty", "word", "braces")


_DEVICE = re.compile(r"^(cpu|cuda|mps)(:\d+)?$")


@dataclass(frozen=True)
class Device(Kind):
    """``cpu``, ``cuda``, ``cuda:N`` or ``mps``, available in this torch build."""

    expect: str = "cpu, cuda, cuda:N or mps"
    metavar: str | None = "DEVICE"

    def parse(self, text: str) -> str:
        name = text.strip().lower()
        m = _DEVICE.match(name)
        if m is None:
            raise Bad(f"expected {self.expect}, got {shown(text)}")
        import torch

        kind, index = m.group(1), m.group(2)
        if kind == "cuda":
            if not torch.cuda.is_available():
                build = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA device is visible"
                raise Bad(f"{text!r} is not available: {build} (torch {torch.__version__}); use --device cpu")
            count = torch.cuda.device_count()
            if index is not None and int(index[1:]) >= count:
                raise Bad(f"{text!r} is not available: {count} CUDA device(s), numbered from 0")
        elif kind == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
            raise Bad(f"{text!r} is not available on this machine; use --device cpu")
        elif kind == "cpu" and index not in (None, ":0"):
            raise Bad(f"expected cpu, got {text!r}")
        return name

    @property
    def bad(self) -> tuple[str, ...]:
        return ("empty", "word", "zero")


@dataclass(frozen=True)
class Host(Kind):
    """A loopback address to bind: 127.0.0.1 (any 127.x), ::1 or localhost."""

    expect: str = "a loopback address (127.0.0.1, ::1 or localhost)"
    metavar: str | None = "HOST"

    def parse(self, text: str) -> str:
        import ipaddress

        if text == "localhost":
            return text
        try:
            if ipaddress.ip_address(text).is_loopback:
                return text
        except ValueError:
            pass
        raise Bad(f"expected {self.expect}, got {shown(text)}; the server binds loopback only")

    @property
    def bad(self) -> tuple[str, ...]:
        return ("empty", "word", "zero")


# ------------------------------------------------------------------------------------- path kinds

def special_file_reason(path: str | os.PathLike[str]) -> str | None:
    """Why ``path`` (followed through links) cannot be read as a file, or None for a regular file or folder.

    A FIFO, a device or a socket is refused before anything opens it (opening a FIFO blocks)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if stat.S_ISFIFO(mode):
        return "a named pipe (FIFO), not a file"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device, not a file"
    if stat.S_ISSOCK(mode):
        return "a socket, not a file"
    return None


def _exists_reason(text: str) -> str | None:
    """Why ``text`` does not name an existing thing, or None."""
    if not text:
        return "an empty path"
    if "\x00" in text:
        return "a path with a NUL character"
    try:
        os.lstat(text)
    except FileNotFoundError:
        return "no such file or folder"
    except NotADirectoryError:
        return "a part of the path is a file, not a folder"
    except OSError as e:
        return e.strerror or str(e)
    if not os.path.exists(text):
        return f"a dangling symbolic link (to {shown(os.readlink(text))})"
    return special_file_reason(text)


@dataclass(frozen=True)
class ExistingPath(Kind):
    """A file or folder that exists (links followed); special files refused."""

    expect: str = "an existing file or folder"
    metavar: str | None = "PATH"
    need: str = "any"  # "any" | "file" | "dir"
    hint: str = ""

    def parse(self, text: str) -> str:
        reason = _exists_reason(text)
        if reason is None and self.need == "file" and os.path.isdir(text):
            reason = "a folder, not a file"
        if reason is None and self.need == "dir" and not os.path.isdir(text):
            reason = "a file, not a folder"
        if reason is not None:
            raise Bad(f"{shown(text, PATH_LIMIT)}: {reason}" + (f"; {self.hint}" if self.hint else ""))
        self.check_content(text)
        return text

    def check_content(self, text: str) -> None:
        """Subclasses read the file here (headers, arrays) and raise ``ArgumentTypeError`` naming it."""

    @property
    def bad(self) -> tuple[str, ...]:
        out = ["empty", "missing", "fifo", "dangling", "non_utf8"]
        out += ["folder"] if self.need == "file" else ["file"] if self.need == "dir" else []
        return tuple(out)


def ExistingFile(expect: str = "an existing file", metavar: str = "FILE", hint: str = "") -> ExistingPath:
    return ExistingPath(expect=expect, metavar=metavar, need="file", hint=hint)


def ExistingDir(expect: str = "an existing folder", metavar: str = "DIR", hint: str = "") -> ExistingPath:
    return ExistingPath(expect=expect, metavar=metavar, need="dir", hint=hint)


@dataclass(frozen=True)
class ImagePath(Kind):
    """An image file or a folder of them, checked by the command as a whole list, before any model loads:
    a missing path, a special file (FIFO, device) or, when none can be read, unreadable images are refused
    naming the path (``kestrel.cli.tasks._images``); in a longer list an unreadable image is skipped and
    reported (``--strict`` refuses it). Parsing only refuses an empty path."""

    expect: str = "an image file or a folder of images"
    metavar: str | None = "IMAGE"

    def parse(self, text: str) -> str:
        if not text.strip():
            raise Bad(f"expected {self.expect}, got {shown(text)}")
        return text

    @property
    def bad(self) -> tuple[str, ...]:
        return ("empty", "missing", "fifo", "dangling", "non_utf8", "corrupt_image", "empty_folder", "nul")


@dataclass(frozen=True)
class ImageFile(ExistingPath):
    """An image file whose header decodes and whose pixel count is within the limit."""

    expect: str = "an image file (PNG, JPEG, WebP, ...)"
    metavar: str | None = "IMAGE"
    need: str = "file"

    def check_content(self, text: str) -> None:
        from ..pipelines.images import ImageError, check_image_header

        try:
            check_image_header(text)
        except ImageError as e:
            raise Bad(f"{shown(text, PATH_LIMIT)}: {e.reason}") from None

    @property
    def bad(self) -> tuple[str, ...]:
        return (*super().bad, "corrupt_image")


@dataclass(frozen=True)
class NpyFile(ExistingPath):
    """A NumPy ``.npy`` array (2-D, numeric), read without pickles; or a mask image."""

    expect: str = "a 2-D numeric .npy array or a mask image"
    metavar: str | None = "FILE"
    need: str = "file"

    def check_content(self, text: str) -> None:
        from ..errors import KestrelError
        from ..pipelines.images import read_mask

        try:
            read_mask(text)
        except KestrelError as e:
            raise Bad(str(e)) from None

    @property
    def bad(self) -> tuple[str, ...]:
        return (*super().bad, "corrupt_npy", "text_npy", "object_npy", "empty_npy")


@dataclass(frozen=True)
class _WritePath(Kind):
    """A path a command writes: refused, with the reason, where :func:`_write_reason` finds that it
    cannot be written as a folder (when :meth:`writes_folder`) or as a file."""

    def writes_folder(self, text: str) -> bool:
        raise NotImplementedError

    def parse(self, text: str) -> str:
        reason = _write_reason(text, folder=self.writes_folder(text))
        if reason:
            raise Bad(f"{shown(text, PATH_LIMIT)}: {reason}")
        return text


@dataclass(frozen=True)
class NewFile(_WritePath):
    """A file to write: absent or a regular file; not a folder, a link, a FIFO or inside a file."""

    expect: str = "a file to write (absent, or a regular file to replace)"
    metavar: str | None = "FILE"

    def writes_folder(self, text: str) -> bool:
        return False

    @property
    def bad(self) -> tuple[str, ...]:
        return ("empty", "folder", "fifo", "dangling", "under_file")


@dataclass(frozen=True)
class OutDir(_WritePath):
    """A folder to write into: absent (created when the work succeeds) or a folder; not a file or a broken link."""

    expect: str = "a folder to write into (absent or a folder)"
    metavar: str | None = "DIR"

    def writes_folder(self, text: str) -> bool:
        return True

    @property
    def bad(self) -> tuple[str, ...]:
        return ("empty", "file", "fifo", "dangling", "under_file")


@dataclass(frozen=True)
class NewFileOrDir(_WritePath):
    """A file to write or a folder to write into, whichever the command decides from it (``embed --out``)."""

    expect: str = "a file to write or a folder to write into"
    metavar: str | None = "FILE|DIR"

    def writes_folder(self, text: str) -> bool:
        return os.path.isdir(text)  # an existing folder is written into; any other path is checked as a file

    @property
    def bad(self) -> tuple[str, ...]:
        return ("empty", "fifo", "dangling", "under_file")


def _write_reason(text: str, folder: bool) -> str | None:
    if not text.strip():
        return "an empty path"
    if "\x00" in text:
        return "a path with a NUL character"
    path = Path(text).expanduser()
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    except NotADirectoryError:
        return "a part of the path is a file, not a folder"
    except OSError as e:
        return e.strerror or str(e)
    if st is not None and stat.S_ISLNK(st.st_mode):
        if not path.exists():
            return f"a dangling symbolic link (to {shown(os.readlink(path))}); remove it or choose another path"
        if not folder:
            return "a symbolic link; refusing to replace it (remove the link or choose another path)"
        st = os.stat(path)
    if st is not None:
        if folder and not stat.S_ISDIR(st.st_mode):
            return ("a file, not a folder" if stat.S_ISREG(st.st_mode)
                    else special_file_reason(path) or "not a folder")
        if not folder and stat.S_ISDIR(st.st_mode):
            return "a folder; give a file name"
        if not folder and not stat.S_ISREG(st.st_mode):
            return special_file_reason(path) or "not a regular file"
        return None
    blocker = next((p for p in path.parents if os.path.lexists(p)), None)
    if blocker is not None and not os.path.isdir(blocker):
        return f"{shown(str(blocker))} is a file, not a folder"
    return None


def _is_export_file(path: str) -> bool:
    from ..inspect.exported import is_export_file  # the rule ``kestrel inspect`` applies

    return is_export_file(path)


@dataclass(frozen=True)
class ModelRef(Kind):
    """A card name, a hub id (``org/name``) or a ``save_pretrained`` folder; with ``exported``, also an
    exported program file (``.onnx``, ``.pte``) or an export's ``manifest.json``."""

    expect: str = "a card name, hub id (org/name) or save_pretrained folder"
    metavar: str | None = "NAME|DIR"
    exported: bool = False

    def parse(self, text: str) -> str:
        if not text.strip() or "\x00" in text:
            raise Bad(f"expected {self.expect}, got {shown(text)}")
        reason = special_file_reason(text) if os.path.lexists(text) else None
        if os.path.islink(text) and not os.path.exists(text):
            reason = f"a dangling symbolic link (to {shown(os.readlink(text))})"
        elif reason is None and os.path.isfile(text) and not (self.exported and _is_export_file(text)):
            reason = "a file; give the checkpoint folder (with config.json and *.safetensors)"
            if self.exported:
                reason += ", or an exported .onnx, .pte or manifest.json"
        if reason:
            raise Bad(f"{shown(text, PATH_LIMIT)}: {reason}")
        return text

    @property
    def bad(self) -> tuple[str, ...]:
        return ("empty", "spaces", "file", "fifo", "dangling")


@dataclass(frozen=True)
class GenericNames(Kind):
    """Comma-separated generic names (``B,Pts``), or ``none`` for none (a tuple: argparse's unparsed
    ``--flag=--`` is an empty *list*, which ``main`` refuses)."""

    expect: str = "generic names separated by commas (B,Pts), or none"
    metavar: str | None = "B,Pts"

    def parse(self, text: str) -> tuple[str, ...]:
        if text.strip().lower() == "none":
            return ()
        names = tuple(n.strip() for n in text.split(","))
        if not text.strip() or any(not n.isidentifier() for n in names):
            raise Bad(f"expected {self.expect}, got {shown(text)}")
        return names

    @property
    def bad(self) -> tuple[str, ...]:
        return ("empty", "spaces", "nul")


# ----------------------------------------------------------------------------------- declarations

@dataclass(frozen=True)
class Option:
    """One option or positional argument of a command.

    ``name`` is a positional's name (``"images"``) or the flags (``"--out"``, or ``"-o --output"``);
    ``kind=None`` is a switch. The rest is argparse's meaning.
    """

    name: str
    kind: Kind | None = None
    help: str = ""
    default: Any = None
    required: bool = False
    nargs: str | int | None = None
    action: str | None = None
    group: str | None = None
    dest: str | None = None

    @property
    def flags(self) -> list[str]:
        return self.name.split()

    @property
    def positional(self) -> bool:
        return not self.name.startswith("-")

    @property
    def switch(self) -> bool:
        return self.kind is None and not self.positional and self.action is None

    @property
    def label(self) -> str:
        """How errors name it: the longest flag, or the positional's metavar."""
        if self.positional:
            return (self.kind.metavar if self.kind and self.kind.metavar else self.name.upper())
        return max(self.flags, key=len)

    def add_to(self, parser: argparse.ArgumentParser | Any) -> None:
        kw: dict[str, Any] = {"help": self.help}
        if self.switch:
            parser.add_argument(*self.flags, action="store_true", **kw)
            return
        if self.kind is not None:
            kw["type"] = self.kind
            if self.kind.metavar:
                kw["metavar"] = self.kind.metavar
            if isinstance(self.kind, Choice):
                kw["choices"] = self.kind.choices
                kw.pop("metavar", None)
                kw["type"] = str
        for key in ("nargs", "action", "dest"):
            if getattr(self, key) is not None:
                kw[key] = getattr(self, key)
        if self.default is not None:
            kw["default"] = self.default
        if self.required and not self.positional:
            kw["required"] = True
        if self.positional:
            kw.pop("dest", None)
            parser.add_argument(self.name, **kw)
        else:
            parser.add_argument(*self.flags, **kw)

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "label": self.label, "help": self.help,
                               "positional": self.positional, "required": self.required or (
                                   self.positional and self.nargs not in ("?", "*")),
                               "repeatable": self.nargs in ("+", "*") or self.action == "append"}
        if self.kind is not None:
            out.update(self.kind.describe())
        else:
            out["kind"] = "Switch"
        if self.default is not None:
            out["default"] = self.default
        return out


def weights_option(help: str = "read the card's files from DIR instead of the hub") -> Option:
    """``--weights DIR``: the card's files (config.json and *.safetensors) from a local folder."""
    return Option("--weights", ExistingDir(hint="give a folder with config.json and *.safetensors"), help=help)


@dataclass(frozen=True)
class Command:
    """A ``kestrel`` command: its name, the function that runs it, and every option it takes.

    What ``--help`` says comes from ``run``'s docstring: its first line is the one-line help that
    ``kestrel --help`` lists, the paragraphs after it the description (``help`` and ``description``
    override them).
    """

    name: str
    run: Callable[[argparse.Namespace], int]
    options: Sequence[Option] = field(default_factory=tuple)
    help: str = ""
    description: str | None = None
    epilog: str | None = None
    raw: bool = False  # keep the description's and epilog's line breaks

    def __post_init__(self) -> None:
        doc = inspect.getdoc(self.run) or ""
        first, _, rest = doc.partition("\n\n")
        if not self.help:
            if not first:
                raise ValueError(f"{self.name}: give help= or a docstring to {self.run.__name__}")
            object.__setattr__(self, "help", " ".join(first.split()))
        if self.description is None and rest.strip():
            object.__setattr__(self, "description", rest.strip())

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "help": self.help, "options": [o.describe() for o in self.options]}


REGISTRY: dict[str, Command] = {}


def register(command: Command) -> Command:
    """Add ``command`` to :data:`REGISTRY` (the CLI, the site and the fuzzer read it); returns it."""
    names = [o.name for o in command.options]
    if len(set(names)) != len(names):
        raise ValueError(f"{command.name}: an option is declared twice")
    REGISTRY[command.name] = command
    return command


def add_command(sub: argparse._SubParsersAction, command: Command) -> argparse.ArgumentParser:
    """The argparse sub-parser of ``command``, built from its declarations."""
    kw: dict[str, Any] = {"help": command.help, "description": command.description or command.help}
    if command.epilog:
        kw["epilog"] = command.epilog
    if command.raw:
        kw["formatter_class"] = argparse.RawDescriptionHelpFormatter
    p = sub.add_parser(command.name, **kw)
    groups: dict[str, Any] = {}
    for option in command.options:
        target: Any = p
        if option.group:
            target = groups.get(option.group) or groups.setdefault(option.group, p.add_argument_group(option.group))
        option.add_to(target)
    p.set_defaults(run=command.run)
    return p
