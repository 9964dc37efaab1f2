"""kestrel.runtime.output: outputs checked before the work, written atomically, with the umask's permissions."""

from __future__ import annotations

import os
import stat

import pytest

from kestrel.errors import KestrelError, OutputError
from kestrel.runtime.output import atomic_path, prepare_output, prepare_output_dir, umask, write_bytes, write_text


@pytest.fixture
def mask():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_umask_is_read_without_changing_it(mask):
    os.umask(0o027)
    assert umask() == 0o027 and umask() == 0o027


@pytest.mark.parametrize(("mask_bits", "mode"), [(0o022, 0o644), (0o027, 0o640), (0o077, 0o600), (0o002, 0o664)])
def test_new_files_get_the_umask_permissions(tmp_path, mask, mask_bits, mode):
    os.umask(mask_bits)
    path = write_text(tmp_path / "a" / "b" / "out.txt", "hello")
    assert path.read_text() == "hello" and stat.S_IMODE(path.stat().st_mode) == mode
    assert sorted(os.listdir(path.parent)) == ["out.txt"]  # no temporary or probe file left


def test_a_replaced_file_keeps_its_mode(tmp_path, mask):
    path = tmp_path / "out.bin"
    path.write_bytes(b"old")
    path.chmod(0o600)
    write_bytes(path, b"new")
    assert path.read_bytes() == b"new" and stat.S_IMODE(path.stat().st_mode) == 0o600


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "out.safetensors"
    path.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="writer failed"), atomic_path(path) as tmp:
        assert tmp.parent == tmp_path and tmp.name.endswith(".safetensors") and tmp.name.startswith(".")
        tmp.write_bytes(b"half")
        raise RuntimeError("writer failed")
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["out.safetensors"]


def test_readers_never_see_a_partial_file(tmp_path):
    path = tmp_path / "out.bin"
    path.write_bytes(b"old")
    with atomic_path(path) as tmp:
        tmp.write_bytes(b"new contents")
        assert path.read_bytes() == b"old"  # until the block ends
    assert path.read_bytes() == b"new contents"


def test_symlinks_devices_and_folders_are_never_replaced(tmp_path):
    target = tmp_path / "target.txt"
    target.write_text("keep")
    link = tmp_path / "link.txt"
    link.symlink_to(target)
    with pytest.raises(OutputError, match="is a symbolic link; refusing to replace it"):
        write_text(link, "x")
    assert link.is_symlink() and target.read_text() == "keep"
    with pytest.raises(OutputError, match="not a regular file"):
        prepare_output("/dev/null")
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(OutputError, match="not a regular file"):
        write_text(fifo, "x")
    with pytest.raises(OutputError, match="is a folder"):
        prepare_output(tmp_path)


def test_a_symlink_appearing_during_the_work_is_refused_at_the_rename(tmp_path):
    target = tmp_path / "target.txt"
    target.write_text("keep")
    path = tmp_path / "out.txt"
    with pytest.raises(OutputError, match="symbolic link"), atomic_path(path) as tmp:
        tmp.write_text("new")
        path.symlink_to(target)
    assert target.read_text() == "keep" and sorted(os.listdir(tmp_path)) == ["out.txt", "target.txt"]


def test_parent_folders_are_created_and_a_file_in_the_way_is_named(tmp_path):
    assert prepare_output(tmp_path / "x" / "y" / "z.svg") == tmp_path / "x" / "y" / "z.svg"
    assert (tmp_path / "x" / "y").is_dir() and not (tmp_path / "x" / "y" / "z.svg").exists()
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(OutputError, match=f"cannot create folder {blocker / 'sub'}: {blocker} is a file"):
        prepare_output(blocker / "sub" / "out.svg")


def test_output_dirs(tmp_path):
    assert prepare_output_dir(tmp_path / "new" / "dir").is_dir()
    linked = tmp_path / "linked"
    linked.symlink_to(tmp_path / "new")
    assert prepare_output_dir(linked) == linked  # a link to a folder is a fine place to write into
    (tmp_path / "f").write_text("")
    with pytest.raises(OutputError, match="exists and is not a folder"):
        prepare_output_dir(tmp_path / "f")


def test_output_errors_are_kestrel_errors_and_os_errors(tmp_path):
    with pytest.raises(OutputError) as info:
        prepare_output(tmp_path)
    assert isinstance(info.value, KestrelError) and isinstance(info.value, OSError)
    assert str(info.value).startswith(f"cannot write {tmp_path}: ")
