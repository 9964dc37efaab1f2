"""Writing outputs safely: check the destination before the work, then replace it atomically.

Every file Kestrel writes (features, diagrams, exported programs, manifests, masks) goes through this
module, so every command behaves the same way:

- **Check first.** :func:`prepare_output` (a file) or :func:`prepare_output_dir` (a folder) runs before
  any expensive work: it creates missing parent folders, refuses to replace a symbolic link, a device,
  a pipe, a socket or a folder, and proves the folder is writable by creating and removing a probe file.
  A read-only or full destination fails in a second, not after an hour of work.
- **Atomic.** :func:`atomic_path` yields a temporary path in the destination's own folder (so the final
  ``os.replace`` is a rename on one file system); the writer fills it, the data is flushed to disk and
  renamed over the destination. Readers see the old file or the complete new one; on any error the
  temporary file is removed and an existing file is left untouched.
- **Permissions as users expect.** A new file gets ``0o666 & ~umask`` (what ``open()`` or a shell
  redirect would give; temporary files alone would be ``0o600``); a replaced regular file keeps its mode.

Failures raise :class:`~kestrel.errors.OutputError` naming the path and the reason.

>>> out = prepare_output("out/feats.safetensors")     # before the work
>>> with atomic_path(out) as tmp:                     # after it
...     safetensors.torch.save_file(tensors, tmp)
>>> write_text("out/graph.svg", svg)                  # both steps for small outputs
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

from ..errors import OutputError

PathLike = str | os.PathLike[str]

__all__ = ["atomic_path", "prepare_output", "prepare_output_dir", "umask", "write_bytes", "write_text"]


def umask() -> int:
    """The process umask, read without changing it where the system allows (Linux ``/proc``)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)  # elsewhere: read by setting, then restore at once
    os.umask(mask)
    return mask


def _reason(e: OSError) -> str:
    return e.strerror or str(e) or type(e).__name__


def _refuse_non_regular(path: Path) -> None:
    """An OutputError unless ``path`` is absent or a regular file (not through a symlink)."""
    try:
        st = path.lstat()
    except (FileNotFoundError, NotADirectoryError):  # absent (a file in the folder path is reported later)
        return
    except OSError as e:
        raise OutputError(f"cannot write {path}: {_reason(e)}") from None
    if stat.S_ISLNK(st.st_mode):
        raise OutputError(f"cannot write {path}: it is a symbolic link; refusing to replace it "
                          "(remove the link or choose another path)")
    if stat.S_ISDIR(st.st_mode):
        raise OutputError(f"cannot write {path}: it is a folder; give a file name (e.g. {path / 'out'}...)")
    if not stat.S_ISREG(st.st_mode):
        raise OutputError(f"cannot write {path}: it is not a regular file (a device, pipe or socket); "
                          "refusing to replace it")


def _make_folder(folder: Path) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        blocker = next((p for p in [folder, *folder.parents] if p.exists() and not p.is_dir()), folder)
        raise OutputError(f"cannot create folder {folder}: {blocker} is a file, not a folder") from None
    except OSError as e:
        raise OutputError(f"cannot create folder {folder}: {_reason(e)}") from None


def _probe(folder: Path) -> None:
    """Create and remove a file in ``folder``: the only reliable test (root, read-only mounts, quotas)."""
    try:
        fd, name = tempfile.mkstemp(prefix=".kestrel-probe-", dir=folder)
    except OSError as e:
        raise OutputError(f"cannot write to folder {folder}: {_reason(e)}") from None
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(name)


def prepare_output(path: PathLike) -> Path:
    """Check that ``path`` can be written, before the work that produces it; returns it as a ``Path``.

    Creates missing parent folders, refuses an existing symbolic link, folder, device, pipe or socket at
    ``path`` and checks the folder is writable. An existing regular file is fine (it will be replaced).
    """
    dest = Path(os.fspath(path)).expanduser()
    if not dest.name or dest.name in (".", ".."):
        raise OutputError(f"cannot write {os.fspath(path)!r}: give a file name")
    _refuse_non_regular(dest)
    folder = dest.parent
    _make_folder(folder)
    _probe(folder)
    return dest


def prepare_output_dir(path: PathLike) -> Path:
    """Check (and create) an output folder before the work; returns it as a ``Path``.

    A symbolic link to a folder is accepted (the files go inside it); a file, device or broken link at
    ``path`` is refused, and the folder must be writable.
    """
    folder = Path(os.fspath(path)).expanduser()
    if folder.exists() and not folder.is_dir():
        raise OutputError(f"cannot write into {folder}: it exists and is not a folder")
    if folder.is_symlink() and not folder.exists():
        raise OutputError(f"cannot write into {folder}: it is a broken symbolic link")
    _make_folder(folder)
    _probe(folder)
    return folder


def _mode_for(dest: Path) -> int:
    try:
        st = dest.stat()
        if stat.S_ISREG(st.st_mode):
            return stat.S_IMODE(st.st_mode)  # replacing a file keeps its permissions
    except OSError:
        pass
    return 0o666 & ~umask()


@contextlib.contextmanager
def atomic_path(path: PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; when the block succeeds, move it into place atomically.

    The temporary name keeps the destination's suffix (``.feats.x1y2.tmp.safetensors``) for writers
    that choose a format by it. The destination is checked as :func:`prepare_output` does, both before
    and again just before the rename. On any exception the temporary file is removed, the destination
    untouched, and the exception propagates (an ``OSError`` of the file system becomes
    :class:`~kestrel.errors.OutputError`).
    """
    dest = prepare_output(path)
    try:
        fd, name = tempfile.mkstemp(prefix=f".{dest.stem}.", suffix=f".tmp{dest.suffix}", dir=dest.parent)
    except OSError as e:
        raise OutputError(f"cannot write {dest}: {_reason(e)}") from None
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        _refuse_non_regular(dest)
        try:
            os.chmod(tmp, _mode_for(dest))
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, dest)
        except OSError as e:
            raise OutputError(f"cannot write {dest}: {_reason(e)}") from None
        _fsync_folder(dest.parent)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()


def _fsync_folder(folder: Path) -> None:
    """Make the rename durable where the platform allows it (best effort)."""
    with contextlib.suppress(OSError, AttributeError):
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_bytes(path: PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (checked, umask-honouring, never through a symlink)."""
    with atomic_path(path) as tmp:
        try:
            tmp.write_bytes(data)
        except OSError as e:
            raise OutputError(f"cannot write {path}: {_reason(e)}") from None
    return Path(os.fspath(path)).expanduser()


def write_text(path: PathLike, text: str, encoding: str = "utf-8") -> Path:
    """Write ``text`` to ``path`` atomically (see :func:`write_bytes`)."""
    return write_bytes(path, text.encode(encoding))
