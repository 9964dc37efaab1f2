"""What kernels derive from weights (packed layouts, decisions, quantised copies), kept in one place.

:class:`WeightCache` holds every value a kernel computed from one or more weight tensors, under a kind
(``"packed"``, ``"decision"``, ...), the weights it came from, and an optional extra key. One rule
decides whether an entry stands: **each weight it was derived from is still the same live object at the
version it had when the entry was made.** An entry goes when any of its weights is collected, and a
lookup that finds a weight written to since (its version counter moved) drops the entry and misses.
(An inference tensor has no version counter: it cannot be written outside inference mode, and a write
in inference mode goes unseen.)

The cache is also the only place where a parameter's storage is moved: :meth:`WeightCache.fuse` makes
several parameters views of one concatenation (same objects, names and values) and keeps that
concatenation, so the rewrite is owned, recorded and found again by identity.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch


def version(t: torch.Tensor) -> int:
    """``t``'s version counter (-1 for an inference tensor, which has none)."""
    try:
        return t._version
    except RuntimeError:
        return -1


class _Entry:
    __slots__ = ("refs", "serial", "value", "versions")

    def __init__(self, owners: Sequence[torch.Tensor], value: Any, serial: int,
                 on_collect: Callable[[Any], None]) -> None:
        # the callbacks live as long as the entry: a replaced entry's never fire
        self.refs = tuple(weakref.ref(o, on_collect) for o in owners)
        self.versions = tuple(version(o) for o in owners)
        self.value = value
        self.serial = serial


class WeightCache:
    """Values derived from weights, valid while those weights are the same objects at the same versions."""

    def __init__(self) -> None:
        self._entries: dict[tuple, _Entry] = {}
        self._serial = 0

    def get(self, kind: str, owners: Sequence[torch.Tensor], extra: Hashable = None) -> Any:
        """The value kept for ``owners`` (and ``extra``) under ``kind``; None when absent or stale."""
        # on the path of every linear call: one owner is checked without building tuples
        if len(owners) == 1:
            owner = owners[0]
            key: tuple = (kind, extra, id(owner))
            entry = self._entries.get(key)
            if entry is None:
                return None
            if entry.refs[0]() is owner and entry.versions[0] == version(owner):
                return entry.value
            del self._entries[key]
            return None
        key = _key(kind, owners, extra)
        entry = self._entries.get(key)
        if entry is None:
            return None
        for ref, v, o in zip(entry.refs, entry.versions, owners):
            if ref() is not o or v != version(o):
                del self._entries[key]
                return None
        return entry.value

    def put(self, kind: str, owners: Sequence[torch.Tensor], value: Any, extra: Hashable = None) -> Any:
        """Keep ``value`` for ``owners`` (replacing what was kept); returns it."""
        key = _key(kind, owners, extra)
        self._entries.pop(key, None)  # the old value goes before the new one is kept
        self._serial += 1
        self._entries[key] = _Entry(owners, value, self._serial, self._dropper(key, self._serial))
        return value

    def get_or_make(self, kind: str, owners: Sequence[torch.Tensor], make: Callable[[], Any],
                    extra: Hashable = None) -> Any:
        """The value kept for ``owners``, or ``make()`` kept now."""
        value = self.get(kind, owners, extra)
        return value if value is not None else self.put(kind, owners, make(), extra)

    def pop(self, kind: str, owners: Sequence[torch.Tensor], extra: Hashable = None) -> None:
        """Forget the value kept for ``owners`` under ``kind``."""
        self._entries.pop(_key(kind, owners, extra), None)

    def clear(self, *kinds: str) -> None:
        """Forget every value of these kinds (of all kinds when none is named)."""
        if not kinds:
            self._entries.clear()
            return
        for key in [k for k in self._entries if k[0] in kinds]:
            del self._entries[key]

    def count(self, kind: str) -> int:
        """How many values of ``kind`` are kept (for tests and reports)."""
        return sum(1 for k in self._entries if k[0] == kind)

    def fuse(self, parts: Sequence[torch.Tensor], release: Callable[[torch.Tensor], Any] | None = None) -> torch.Tensor:
        """The concatenation of ``parts`` along axis 0, each part made a view of it (no extra memory).

        Parameters keep their objects, names and values: only their storage moves, here and nowhere
        else. Later calls get the same concatenation back while the parts still lie end to end in it.
        ``release(old)`` is called on each part's former data once nothing reads it (handing back
        checkpoint pages).
        """
        whole = adjacent(parts)
        cached = self._fused(parts)
        if (whole is not None and cached is not None and cached.data_ptr() == whole.data_ptr()
                and cached.shape == whole.shape):
            return cached
        if whole is None:
            with torch.inference_mode(False), torch.no_grad():  # normal tensors, even in inference mode
                old = [p.detach() for p in parts]
                whole = torch.cat(old, dim=0)
                start = 0
                for p in parts:
                    p.data = whole[start:start + p.shape[0]]
                    start += p.shape[0]
            if release is not None:
                for t in old:
                    release(t)
            del old
        return self.put("fused", parts, whole)

    def _fused(self, parts: Sequence[torch.Tensor]) -> torch.Tensor | None:
        # identity only: moving the storage (``p.data = ...``) is this cache's own doing
        entry = self._entries.get(_key("fused", parts, None))
        if entry is None or any(r() is not p for r, p in zip(entry.refs, parts)):
            return None
        return entry.value

    def _dropper(self, key: tuple, serial: int) -> Callable[[Any], None]:
        cache_ref = weakref.ref(self)

        def drop(_ref: Any) -> None:  # a weight of this entry was collected
            cache = cache_ref()
            entry = cache._entries.get(key) if cache is not None else None
            if entry is not None and entry.serial == serial:  # not a later entry under the same ids
                del cache._entries[key]

        return drop


def _key(kind: str, owners: Sequence[torch.Tensor], extra: Hashable) -> tuple:
    return (kind, extra, *map(id, owners))


def adjacent(parts: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The concatenation along axis 0 as a view, when the parts already lie end to end in one storage."""
    first = parts[0]
    if not all(p.is_contiguous() and p.dtype == first.dtype and p.device == first.device
               and p.shape[1:] == first.shape[1:] for p in parts):
        return None
    try:
        ptr = first.untyped_storage().data_ptr()
        if any(p.untyped_storage().data_ptr() != ptr for p in parts):
            return None
    except (RuntimeError, NotImplementedError):  # fake, meta or functional tensors
        return None
    offset = first.storage_offset()
    for p in parts:
        if p.storage_offset() != offset:
            return None
        offset += p.numel()
    rows = sum(p.shape[0] for p in parts)
    return first.as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())


# the process's one cache: every kernel keeps what it derives from weights here
WEIGHTS = WeightCache()
