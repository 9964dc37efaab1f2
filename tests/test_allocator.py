"""runtime.allocator: freed activations stay in the process (glibc), and KESTREL_MALLOC=system opts out."""

import os
import platform
import subprocess
import sys

import pytest

PROBE = r"""
import ctypes, resource
from kestrel.runtime.allocator import retain_freed_memory
applied = retain_freed_memory()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
def touch():  # a layer's worth of activations: four 16 MB blocks alive at once, written, then freed
    blocks = [libc.malloc(16 << 20) for _ in range(4)]
    for b in blocks:
        ctypes.memset(b, 1, 16 << 20)
    for b in blocks:
        libc.free(b)
touch()
touch()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
touch()
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def probe(**env: str) -> tuple[bool, int]:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True,
                         env={**os.environ, **env}).stdout.split()
    return out[0] == "True", int(out[1])


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_freed_activations_are_reused_without_page_faults():
    applied, faults = probe(KESTREL_MALLOC="")
    assert applied
    assert faults < 1000, f"re-allocating 64 MB of blocks took {faults} page faults"
    applied, faults = probe(KESTREL_MALLOC="system")
    assert not applied
    assert faults > 10_000, f"glibc's default should map those 64 MB afresh (16,384 pages); saw {faults} faults"
