"""Releasing the resident pages of checkpoint data nobody reads any more: only file-backed pages, and
their content comes back from the file."""

from __future__ import annotations

import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kestrel.kernels.pages import file_pages, release_file_pages
from reference import resident_pages

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and /proc are Linux's")


def _rss_file_kb() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("RssFile:"):
            return int(line.split()[1])
    raise AssertionError("no RssFile in /proc/self/status")


def test_file_backed_pages_are_dropped_and_read_again_from_the_file(tmp_path):
    want = torch.randn(2048, 1024)  # 8 MiB
    save_file({"w": want}, str(tmp_path / "m.safetensors"))
    with safe_open(str(tmp_path / "m.safetensors"), framework="pt") as f:
        w = f.get_tensor("w")
    assert torch.equal(w, want)  # every page read: resident
    before = _rss_file_kb()
    released = release_file_pages(w)
    assert released >= 8 * 2**20 - 2 * 4096
    assert _rss_file_kb() <= before - released // 1024 // 2  # counted as the process's memory no more
    assert torch.equal(w, want)  # the same numbers, faulted in from the file again


def test_anonymous_memory_is_never_released():
    t = torch.randn(2048, 1024)
    copy = t.clone()
    assert release_file_pages(t) == 0
    assert torch.equal(t, copy)





def test_file_pages_tells_the_files_own_pages_from_written_copies(tmp_path):
    save_file({"a": torch.randn(1024, 1024), "b": torch.randn(1024, 1024)}, str(tmp_path / "m.safetensors"))
    with safe_open(str(tmp_path / "m.safetensors"), framework="pt") as f:
        a, b = f.get_tensor("a"), f.get_tensor("b")
    assert file_pages(a) and file_pages(b)  # mapped, not yet read
    a.sum()
    assert file_pages(a) and resident_pages(a) > 0  # read: resident, still the file's own
    b[300, 7] = 1.0  # one written page is a private copy: releasing it would lose the write
    assert not file_pages(b)
    assert not file_pages(torch.randn(1024, 1024))  # the heap is no file
    release_file_pages(a)
    assert resident_pages(a) == 0 and file_pages(a)
