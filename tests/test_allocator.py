"""runtime.allocator: freed activations stay in the process (glibc), and KESTREL_MALLOC=system opts out."""

import os
import platform
import subprocess
import sys

import pytest

PROBE = r"""
import resource, torch
from kestrel.runtime.allocator import retain_freed_memory
applied = retain_freed_memory()
def touch():  # a 64 MB activation, written, then freed
    torch.empty(16 * 1024 * 1024).fill_(1.0)
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
    assert faults < 1000, f"a re-allocated 64 MB block took {faults} page faults"
    applied, faults = probe(KESTREL_MALLOC="system")
    assert not applied
    assert faults > 10_000, f"glibc's default should map 64 MB afresh (16,384 pages); saw {faults} faults"
