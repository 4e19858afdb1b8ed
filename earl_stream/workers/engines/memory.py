"""How much memory a rollout engine has: `rollout.memory_bytes`, else what the place it runs on gives.

Owns `EngineMemory` (a figure and where it came from) and the ways to derive it: a CUDA device's
free memory, or the host's RAM (the smaller of physical memory and a cgroup limit) shared among the
processes of a host, capped by the process's own RLIMIT_AS. Turning memory into a KV budget is the
selector's job (`supervisor.rollout_selector`); rollout workers report what they derived in their
heartbeats (`stats["memory_bytes"]`) so that the supervisor sizes plans by the smallest.
"""

from __future__ import annotations

import logging
import os
import resource
from dataclasses import dataclass
from pathlib import Path

_LOG = logging.getLogger(__name__)
_CGROUP_FILES = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


@dataclass(frozen=True)
class EngineMemory:
    """`bytes` of memory for one engine (per device) and, in words, where the figure came from."""

    bytes: int
    source: str


def host_ram_bytes() -> int:
    """Physical RAM, or the cgroup's memory limit where that is smaller (a container)."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for name in _CGROUP_FILES:
        try:
            text = Path(name).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            ram = min(ram, int(text))
    return ram


def _address_space_left() -> int | None:
    """What RLIMIT_AS still allows this process to map (None without a limit)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        mapped = int(Path("/proc/self/statm").read_text().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        mapped = 0
    return max(0, soft - mapped)


def host_share(processes: int) -> EngineMemory:
    """The host's RAM divided among `processes` processes (>= 1), capped by this process's RLIMIT_AS."""
    n = max(1, processes)
    ram = host_ram_bytes()
    mem = EngineMemory(ram // n, f"host RAM {ram / (1 << 30):.1f} GiB / {n} processes")
    left = _address_space_left()
    if left is not None and left < mem.bytes:
        mem = EngineMemory(left, f"RLIMIT_AS of the process ({left / (1 << 20):.0f} MiB left to map)")
    return mem


def engine_memory(configured: int, device: str, processes: int) -> EngineMemory:
    """`configured` (rollout.memory_bytes) if > 0; else, when `device` is a CUDA device ("cuda",
    "cuda:1"), its memory free now (call it before the model loads: the weights are part of the
    budget; free rather than total, as a GPU may be shared with a trainer rank or other workers);
    else `host_share(processes)`."""
    if configured > 0:
        return EngineMemory(configured, "rollout.memory_bytes")
    if device.startswith("cuda"):
        import torch

        free, total = torch.cuda.mem_get_info(torch.device(device))
        return EngineMemory(int(free), f"{device} free at start ({total / (1 << 30):.1f} GiB total)")
    return host_share(processes)
