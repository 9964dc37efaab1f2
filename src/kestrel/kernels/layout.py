"""Layout kernels: a transposed map copied row-major in cache-sized slabs."""

from __future__ import annotations

import torch

from .library import plain_inference

# Channels per slab: each slab reads ``SLAB`` source rows whole and writes ``SLAB`` numbers per output row
SLAB = 32
# Copying ``[B, C, N]`` to ``[B, N, C]`` in one go reads the source with a stride of N numbers. Where that
# stride is a multiple of 4 KiB (SAM's 64 x 64 grid: 16 KiB), every read of a run of channels falls in the
# same cache sets and evicts the last: on an Intel AMX machine torch's copy of [1, 256, 4096] took 2.5 ms,
# slab by slab 0.53 ms ([1, 768, 4096]: 7.9 -> 1.4 ms; [1, 96, 65536]: 8.6 -> 3.4 ms). Other strides copy
# well as they are (SigLIP's [1, 768, 196]: 0.035 ms whole, 0.25 ms in slabs), so they keep torch's copy.
ALIASING_BYTES = 4096


def aliasing_rows(x: torch.Tensor) -> torch.Tensor | None:
    """``x`` as ``[B, N, C]`` rows when it is a token map over a channels-first buffer whose rows alias in the
    caches (the case :func:`contiguous` copies in slabs); None for any other layout."""
    if x.is_contiguous() or x.dim() < 3 or x.numel() == 0:
        return None
    b, c = x.shape[0], x.shape[-1]
    n = x.numel() // (b * c)
    try:
        rows = x.view(b, n, c)
    except RuntimeError:  # not one run of tokens over a channels-first buffer
        return None
    # a lone image's batch stride is whatever its view made it (SAM's [1, 256, 4096] map transposed: 4096)
    channels_first = rows.stride()[1:] == (1, n) and (b == 1 or rows.stride(0) == n * c)
    if not channels_first or (n * x.element_size()) % ALIASING_BYTES or c <= SLAB:
        return None
    return rows


def contiguous(x: torch.Tensor) -> torch.Tensor:
    """``x`` laid out row-major; a token map transposed from channels-first (``[B, C, H, W]`` viewed as
    ``[B, H * W, C]`` or ``[B, H, W, C]``) whose rows alias in the caches is copied slab by slab."""
    rows = aliasing_rows(x) if x.is_cpu and plain_inference(x) else None
    if rows is None:
        return x.contiguous()
    b, n, c = rows.shape
    out = torch.empty(b, n, c, dtype=x.dtype)
    for start in range(0, c, SLAB):
        out[:, :, start:start + SLAB].copy_(rows[:, :, start:start + SLAB])
    return out.view(x.shape)
