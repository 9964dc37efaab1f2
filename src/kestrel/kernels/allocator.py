"""Keep freed activations in the process instead of handing them back to the OS after every call.

glibc's malloc serves large blocks (above a threshold that adapts up to 32 MiB) with ``mmap`` and
returns them with ``munmap`` when freed, and trims the heap's free top above ``M_TRIM_THRESHOLD``.
An encoder's activations are exactly such blocks, so every forward pass maps fresh pages and takes a
page fault on each 4 KiB of them inside the GEMMs: measured here on ViT-B/16 at batch 8 (2 threads),
about 113,000 minor faults and 7-8% of the time per call. Raising both thresholds keeps those pages in
the heap for the next call: one call's faults drop to a handful. Peak memory is the same or lower
(measured); what changes is that the process keeps what it used resident after a call instead of
returning it. Blocks above 160 MiB are still mapped and unmapped per call (see RETAIN_BYTES).

This is process-wide state, so :func:`kestrel.load` applies it once (inference processes are what
loads models) and ``KESTREL_MALLOC=system`` leaves the allocator as it was. Nothing happens where
the C library is not glibc.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
from collections.abc import Callable, Iterator

from . import settings

# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# blocks up to this size come from the heap and stay there when freed. Five times glibc's own ceiling
# for its adaptive threshold (32 MiB), because at batch 8 the activations of these encoders sit above
# it: DINOv2-B at 518 px has 8 x 1370 x 768 floats per token-wide tensor and 8 x 1370 x 3072 in its MLP,
# SAM's decoder 8 x 4096 x 256. Far larger is not better: a fragmented heap raises the high-water mark.
# (The page faults, times and peaks measured at 32, 64, 160 MiB and 1 GiB: README, "Measurements behind
# the kernels".)
RETAIN_BYTES = 160 << 20
# inside mapped_apart(): blocks from this size up are mapped apart from the heap
APART_BYTES = 1 << 20
TRIM_BYTES = 1 << 30

_state: dict[str, bool] = {}


def retain_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds once per process; True when they are raised."""
    if "applied" in _state:
        return _state["applied"]
    applied = False
    if not settings.system_malloc():
        libc = glibc()
        if libc is not None:
            applied = bool(libc.mallopt(_M_MMAP_THRESHOLD, RETAIN_BYTES)) and bool(
                libc.mallopt(_M_TRIM_THRESHOLD, TRIM_BYTES))
    _state["applied"] = applied
    return applied


@contextlib.contextmanager
def mapped_apart() -> Iterator[None]:
    """Large blocks allocated inside are mapped on their own, not carved from the retained heap.

    For long-lived blocks whose size overstates what is written (MKL's packed weights reserve ~2.6x
    the bytes they fill): fresh pages are resident only once written, and such a block is returned to
    the system when freed. From recycled heap memory the whole block would count as resident.
    """
    libc = _retaining_glibc()
    if libc is not None:
        libc.mallopt(_M_MMAP_THRESHOLD, APART_BYTES)
        # a block may still be carved from a free chunk of the heap, whose pages a freed activation
        # left resident: hand those back first, so only what is written becomes resident again
        libc.malloc_trim(0)
    try:
        yield
    finally:
        if libc is not None:
            libc.mallopt(_M_MMAP_THRESHOLD, RETAIN_BYTES)


_bursts = [0]


def note_burst() -> None:
    """Record a one-off burst of transient allocations (a calibration timing kernels mid-forward)."""
    _bursts[0] += 1


def bursts() -> int:
    """How many bursts were recorded so far: an entry that saw the count move releases free memory after."""
    return _bursts[0]


def release_after_burst() -> Callable[[], None]:
    """An entry hook (:data:`kestrel.blocks.block.ENTRY_HOOKS`): called as an entry starts, it returns
    what to run when the entry returns, which releases free memory when a burst was recorded inside."""
    before = _bursts[0]

    def after() -> None:
        if _bursts[0] != before:  # a calibration ran inside: its freed pages go back now
            release_free_memory()

    return after


def release_free_memory() -> None:
    """Hand the free pages of the retained heap back to the system (``malloc_trim``), once retained.

    For after a call that held a burst: a calibration's transient blocks, freed among the forward's
    activations, would otherwise stay resident and steer where later calls' activations land (the
    peaks measured with and without: README, "Measurements behind the kernels").
    """
    libc = _retaining_glibc()
    if libc is not None:
        libc.malloc_trim(0)


def _retaining_glibc() -> ctypes.CDLL | None:
    """glibc, once :func:`retain_freed_memory` raised its thresholds (else nothing to hand back or lower)."""
    return glibc() if _state.get("applied", False) else None


@functools.cache
def glibc() -> ctypes.CDLL | None:
    """The process's C library when it is glibc (with the prototypes Kestrel calls), else None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018 - only glibc has it
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc
    except (OSError, AttributeError):
        return None
