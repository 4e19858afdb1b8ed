"""`trainer.malloc_mmap_threshold`: with glibc's default, a CPU rank's freed tensors stay in the C library's heap
(resident memory above the live tensors, which the memory model counts); with the threshold set, freed tensors of
at least that size go back to the OS. Each case runs in a fresh process (glibc's settings are per process)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# 400 tensors of 100 KB (under glibc's initial 128 KiB threshold: heap blocks by default), each followed by a small
# tensor that stays alive, so that the freed blocks are holes the heap cannot trim; resident MiB before the
# big ones, with them, and after they are freed
_CHILD = """
import json, sys, torch
from earl_stream.workers.host_memory import set_malloc_mmap_threshold
applied = set_malloc_mmap_threshold(int(sys.argv[1])) if int(sys.argv[1]) else None
def rss():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) / 1024
before = rss()
big, small = [], []
for _ in range(400):
    big.append(torch.ones(25_000))
    small.append(torch.ones(64))
held = rss()
big.clear()
print(json.dumps({"applied": applied, "held": held - before, "after": rss() - before}))
"""


def _run(threshold: int) -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD, str(threshold)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc and /proc")
def test_freed_tensors_return_to_the_os_only_with_the_threshold() -> None:
    default, mapped = _run(0), _run(65536)
    assert default["held"] > 30 and mapped["held"] > 30  # 40 MB of tensors were resident in both
    assert default["after"] > 0.8 * default["held"], default  # glibc's heap kept the freed blocks
    assert mapped["applied"] is True and mapped["after"] < 0.2 * mapped["held"], mapped  # unmapped when freed
