"""The control groups a sandbox runs in (memory, pids), where this process may make them (root, with cgroup v1
or v2 mounted): their limits, the tasks in them, and whether the kernel enforced a limit (an OOM kill, a refused
fork)."""

from __future__ import annotations

import functools
import os
import signal
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from earl_stream.sandbox.spec import Breach

ROOT = Path("/sys/fs/cgroup")


class Groups:
    """The control groups (memory, pids) one sandbox runs in, where this process may make them."""

    def __init__(self, memory_bytes: int, processes: int) -> None:
        self.name, self.paths = f"earl_sandbox_{os.getpid()}_{uuid.uuid4().hex[:8]}", {}
        for controller, limits in (("memory", {"memory.limit_in_bytes": memory_bytes, "memory.swappiness": 0,
                                               "memory.max": memory_bytes, "memory.swap.max": 0}),
                                   ("pids", {"pids.max": processes})):
            group = self._make(controller)
            if group is None:
                continue
            try:
                for key, value in limits.items():
                    if (group / key).exists():
                        (group / key).write_text(str(value))
            except OSError:
                group.rmdir()
                continue
            self.paths[controller] = group

    def _make(self, controller: str) -> Path | None:
        for parent in (ROOT / controller, ROOT):  # v1 hierarchy, else the v2 one
            if parent == ROOT and controller not in _v2_controllers():
                continue
            if not (parent / "cgroup.procs").exists():
                continue
            try:
                (parent / self.name).mkdir()
            except OSError:
                continue
            return parent / self.name
        return None

    def pids(self) -> list[int]:
        """The processes in the sandbox (as this host numbers them)."""
        return sorted({pid for group in self.paths.values() for pid in _read_pids(group)})

    def procs_files(self) -> list[str]:
        return [str(g / "cgroup.procs") for g in self.paths.values()]

    def breach(self) -> Breach | None:
        memory, pids = self.paths.get("memory"), self.paths.get("pids")
        if memory is not None and _counter(memory, ("memory.oom_control", "memory.events"), "oom_kill") > 0:
            return Breach.MEMORY
        if pids is not None and _counter(pids, ("pids.events",), "max") > 0:
            return Breach.PROCESSES
        return None

    def kill(self) -> None:
        for group in self.paths.values():
            for pid in _read_pids(group):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def remove(self) -> None:
        for group in self.paths.values():
            for _ in range(50):  # the kernel frees a group once its last task is reaped
                try:
                    group.rmdir()
                    break
                except OSError:
                    time.sleep(0.02)


def control_groups() -> frozenset[str]:
    """The controllers ("memory", "pids") a sandbox started from here gets a group of (the rest: rlimits)."""
    probe = Groups(1 << 30, 64)
    try:
        return frozenset(probe.paths)
    finally:
        probe.remove()


@functools.lru_cache(maxsize=1)
def _v2_controllers() -> frozenset[str]:
    try:
        return frozenset((ROOT / "cgroup.controllers").read_text().split())
    except OSError:
        return frozenset()


def _counter(group: Path, files: Sequence[str], key: str) -> int:
    for name in files:
        try:
            for line in (group / name).read_text().splitlines():
                k, _, v = line.partition(" ")
                if k == key and v.strip().isdigit():
                    return int(v)
        except OSError:
            continue
    return 0


def _read_pids(group: Path) -> list[int]:
    try:
        return [int(p) for p in (group / "cgroup.procs").read_text().split()]
    except OSError:
        return []
