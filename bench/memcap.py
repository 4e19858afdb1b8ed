"""Real per-process memory caps for the benchmarks, with Linux memory cgroups (v1 or v2).

`MemoryCaps(tag)` puts a running process into a cgroup of its own (`cap(pid, above_bytes)`) in which
it may touch `above_bytes` of memory more than it holds at that moment (what it held stays charged
where it was; new pages are charged to the new cgroup); an allocation past the limit gets the
process OOM-killed, as a GPU rank past its device memory dies. Unlike RLIMIT_DATA, a
cgroup counts memory actually used (resident pages), not address space, so thread stacks and
allocator reservations do not hit it. `peak(pid)` is the most the cgroup has held (max_usage /
memory.peak); `oom_kills(pid)` how often the kernel killed in it. `close()` moves what is left back
to the root cgroup and removes every cgroup it made; a later run also removes what a killed run left
(`sweep`). Needs root and a mounted memory controller: `problems()` says what is missing.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["MemoryCaps", "problems"]

_V1 = Path("/sys/fs/cgroup/memory")
_V2 = Path("/sys/fs/cgroup")
_PREFIX = "earl_stream_bench_"


def _root() -> tuple[Path, int] | None:
    if (_V1 / "memory.limit_in_bytes").exists():
        return _V1, 1
    if "memory" in ((_V2 / "cgroup.controllers").read_text() if (_V2 / "cgroup.controllers").exists() else ""):
        return _V2, 2
    return None


def problems() -> list[str]:
    """What keeps this machine from capping a process's memory; empty when nothing does."""
    out = []
    if os.geteuid() != 0:
        out.append("root (memory cgroups are made under /sys/fs/cgroup)")
    if _root() is None:
        out.append("a mounted memory cgroup controller (cgroup v1 /sys/fs/cgroup/memory or v2 with +memory)")
    return out


class MemoryCaps:
    def __init__(self, tag: str) -> None:
        found = _root()
        if found is None or os.geteuid() != 0:
            raise SystemExit("cannot cap memory here: needs " + "; ".join(problems()))
        self.root, self.version = found
        self.tag = tag
        self.groups: dict[int, Path] = {}
        self.limits: dict[int, int] = {}
        self.sweep()

    def _file(self, name: str) -> str:
        v1 = {"limit": "memory.limit_in_bytes", "usage": "memory.usage_in_bytes", "peak": "memory.max_usage_in_bytes"}
        v2 = {"limit": "memory.max", "usage": "memory.current", "peak": "memory.peak"}
        return (v1 if self.version == 1 else v2)[name]

    def cap(self, pid: int, above_bytes: int) -> int:
        """Cap `pid` at its current usage + `above_bytes`; returns the limit in bytes."""
        group = self.root / f"{_PREFIX}{self.tag}_{pid}"
        group.mkdir(exist_ok=True)
        (group / "cgroup.procs").write_text(str(pid))
        self.groups[pid] = group
        # What the process already holds stays charged to the cgroup it came from (charges do not move
        # on v2, nor on v1 kernels that dropped move_charge_at_immigrate); from here on, the pages it
        # touches are charged here: the limit is what is charged here now plus `above_bytes`.
        limit = int((group / self._file("usage")).read_text()) + above_bytes
        (group / self._file("limit")).write_text(str(limit))
        if self.version == 1 and (group / "memory.swappiness").exists():
            (group / "memory.swappiness").write_text("0")
        self.limits[pid] = limit
        return limit

    def peak(self, pid: int) -> int:
        """The most memory `pid`'s cgroup has held, in bytes (0 if unknown)."""
        try:
            return int((self.groups[pid] / self._file("peak")).read_text())
        except (KeyError, OSError, ValueError):
            return 0

    def oom_kills(self, pid: int) -> int:
        """Processes the kernel OOM-killed in `pid`'s cgroup."""
        name = "memory.oom_control" if self.version == 1 else "memory.events"
        try:
            for line in (self.groups[pid] / name).read_text().splitlines():
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
        except (KeyError, OSError, ValueError):
            pass
        return 0

    def close(self) -> None:
        for group in self.groups.values():
            _remove(group, self.root)
        self.groups.clear()

    def sweep(self) -> None:
        """Remove the cgroups an earlier, killed run of any benchmark left behind."""
        for group in self.root.glob(_PREFIX + "*"):
            _remove(group, self.root)


def _remove(group: Path, root: Path) -> None:
    try:
        for pid in (group / "cgroup.procs").read_text().split():
            try:
                (root / "cgroup.procs").write_text(pid)
            except OSError:
                pass  # it exited meanwhile
        group.rmdir()
    except OSError:
        pass
