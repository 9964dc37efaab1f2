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
"""

from __future__ import annotations

import mmap
import sys

import torch

from .allocator import glibc

_MADV_DONTNEED = 4


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


def release_file_pages(tensor: torch.Tensor) -> int:
    """Drop the resident whole pages under ``tensor``'s bytes when they are a private file mapping.

    The caller guarantees no tensor reads these bytes any more (they would be read again from the
    file, not lost). Returns the number of bytes released (0 when nothing qualified).
    """
    if not sys.platform.startswith("linux") or tensor.device.type != "cpu" or not tensor.is_contiguous():
        return 0
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    page = mmap.PAGESIZE
    first, last = -(-start // page) * page, end // page * page
    libc = glibc()
    if libc is None or last <= first or _file_mapping(start, end) is None:
        return 0
    return last - first if libc.madvise(first, last - first, _MADV_DONTNEED) == 0 else 0
