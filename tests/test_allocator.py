"""kernels.allocator: freed activations stay in the process (glibc), and KESTREL_MALLOC=system opts out."""

import os
import platform
import subprocess
import sys

import pytest

PROBE = r"""
import ctypes, os, resource
from kestrel.kernels.allocator import retain_freed_memory
applied = retain_freed_memory()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
size = int(os.environ["PROBE_BLOCK_BYTES"])
def touch():  # a layer's worth of activations: four blocks alive at once, written, then freed
    blocks = [libc.malloc(size) for _ in range(4)]
    for b in blocks:
        ctypes.memset(b, 1, size)
    for b in blocks:
        libc.free(b)
touch()
touch()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
touch()
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def probe(block_bytes: int, **env: str) -> tuple[bool, int]:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True,
                         env={**os.environ, **env, "PROBE_BLOCK_BYTES": str(block_bytes)}).stdout.split()
    return out[0] == "True", int(out[1])


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
# 16 MB: a token-wide tensor of ViT-B at batch 8 and more; 34 MB: DINOv2-B at 518 px, batch 8 (8 x 1370 x
# 768 floats), above glibc's own 32 MiB ceiling for its adaptive threshold
@pytest.mark.parametrize("block_bytes", [16 << 20, 34 << 20])
def test_freed_activations_are_reused_without_page_faults(block_bytes: int):
    pages = 4 * block_bytes // 4096
    applied, faults = probe(block_bytes, KESTREL_MALLOC="")
    assert applied
    assert faults < 1000, f"re-allocating 4 blocks of {block_bytes >> 20} MB took {faults} page faults"
    applied, faults = probe(block_bytes, KESTREL_MALLOC="system")
    assert not applied
    assert faults > pages * 0.6, f"glibc's default should map those blocks afresh ({pages} pages); saw {faults} faults"


def test_an_entry_that_calibrated_hands_freed_memory_back_once(monkeypatch):
    """A calibration's transient blocks are freed mid-forward; the entry trims the heap when it returns,
    only after a call in which something was measured (an ordinary call pays nothing)."""
    import torch

    from kestrel.blocks import Block, Dim, Float, entry, f32
    from kestrel.kernels import allocator

    class Bursty(Block, module="test.allocator"):
        D: Dim
        T: Float = f32

        @entry
        def forward(self, x: "Tensor[B, D; T]") -> "Tensor[B, D; T]":
            if self.measure:  # what kernels.measure and the attention budget timing do
                allocator.note_burst()
            return x * 2

    trims: list[int] = []
    monkeypatch.setattr(allocator, "release_free_memory", lambda: trims.append(allocator.bursts()))
    block = Bursty(D=3)
    block.measure = True
    assert torch.equal(block.forward(torch.ones(2, 3)), torch.full((2, 3), 2.0))
    assert len(trims) == 1
    block.measure = False
    block.forward(torch.ones(2, 3))
    assert len(trims) == 1
