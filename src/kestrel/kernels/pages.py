"""Hand back the resident pages of checkpoint data that no tensor reads any more.

Weights are read from safetensors through a private, read-only-in-practice mapping of the file: a
tensor's pages become resident (counted in the process's memory) when first read, and stay so while
the mapping lives, which is as long as any weight of that file does. When Kestrel moves parameters
into a new buffer (the fused q/k/v projection concatenates three weights at their first call), the
pages the old parts occupied would stay resident next to the new copy: 85 MB on DINOv2-B. Those
pages are clean copies of the file, so ``madvise(MADV_DONTNEED)`` drops them at no risk to their
content: if anything read them again they would come back from the file.

Only whole pages inside a private mapping of a regular file are released; anonymous memory (the
heap, or a tensor a user built) is never touched. Linux with glibc only; elsewhere nothing happens.

A parameter that stays in use may also have its pages released (a packed GEMM copy of it does the
reading), but only when :func:`file_pages` shows that every resident page under it is still the
file's own: a page written since it was mapped is a private copy, and releasing it would bring the
file's old bytes back.
"""

from __future__ import annotations

import mmap
import struct
import sys

import torch

from .allocator import glibc

_MADV_DONTNEED = 4
# /proc/self/pagemap: one 64-bit entry per virtual page
_PRESENT, _SWAPPED, _FILE = 1 << 63, 1 << 62, 1 << 61


def _file_mapping(start: int, end: int) -> str | None:
    """The path of the private file mapping that holds ``[start, end)`` whole, else None."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                lo, hi = (int(v, 16) for v in fields[0].split("-"))
                if lo <= start and end <= hi:
                    path = fields[5].strip() if len(fields) == 6 else ""
                    private = fields[1].endswith("p")
                    return path if private and path.startswith("/") and not path.endswith("(deleted)") else None
    except OSError:
        return None
    return None


def _mapped_pages(tensor: torch.Tensor) -> tuple[int, int] | None:
    """``[first, last)``: the whole pages under ``tensor``'s bytes, when they lie in a private file mapping."""
    if not sys.platform.startswith("linux") or tensor.device.type != "cpu" or not tensor.is_contiguous():
        return None
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    page = mmap.PAGESIZE
    first, last = -(-start // page) * page, end // page * page
    return (first, last) if last > first and _file_mapping(first, last) is not None else None


def file_pages(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s whole pages lie in a private file mapping and none of them was written since
    it was mapped (each is resident as the file's own page, or not resident and not in swap): only then
    can :func:`release_file_pages` drop them while the tensor stays in use."""
    pages = _mapped_pages(tensor)
    if pages is None:
        return False
    first, last = pages
    page = mmap.PAGESIZE
    try:
        with open("/proc/self/pagemap", "rb") as f:
            f.seek(first // page * 8)
            raw = f.read((last - first) // page * 8)
    except OSError:
        return False
    if len(raw) != (last - first) // page * 8:
        return False
    for (entry,) in struct.iter_unpack("<Q", raw):
        if entry & _PRESENT:
            if not entry & _FILE:  # a private copy: the only holder of what was written
                return False
        elif entry & _SWAPPED:
            return False
    return True


def release_file_pages(tensor: torch.Tensor) -> int:
    """Drop the resident whole pages under ``tensor``'s bytes when they are a private file mapping.

    The caller guarantees no tensor reads these bytes any more (they would be read again from the
    file, not lost). Returns the number of bytes released (0 when nothing qualified).
    """
    libc, pages = glibc(), _mapped_pages(tensor)
    if libc is None or pages is None:
        return 0
    first, last = pages
    return last - first if libc.madvise(first, last - first, _MADV_DONTNEED) == 0 else 0
