"""What a sandbox is asked for: its mode, its limits, the paths it may see and whether it has a network.

`SandboxMode`: `bwrap` (bubblewrap: a fresh filesystem view holding only the interpreter, the installed
packages and the paths named here, its own pid, IPC, UTS and network namespaces, another uid), `process` (a
child under the same limits, its environment scrubbed, in a private temporary directory, as the `nobody` user
where the caller is root, but seeing the host's filesystem and network: the fallback where bubblewrap is
missing, said with a warning) and `none` (the caller's process, no limits: for debugging only).

`Limits` bound what the code inside may use; a breach ends that sandbox's run with a `Breach` naming the limit
(`sandbox_limit` in episode outcomes), never its caller.
"""

from __future__ import annotations

import dataclasses
import enum

from earl_stream.errors import ConfigError

GIB = 1 << 30


class SandboxMode(str, enum.Enum):
    NONE = "none"
    PROCESS = "process"
    BWRAP = "bwrap"


class Breach(str, enum.Enum):
    """The limit a sandboxed run went past."""

    CPU = "cpu"  # CPU seconds (RLIMIT_CPU: SIGXCPU, then SIGKILL)
    WALL = "wall"  # wall-clock seconds (killed by its caller)
    MEMORY = "memory"  # resident memory (its memory cgroup's OOM kill) or address space (allocation refused)
    PROCESSES = "processes"  # processes and threads at once (its pids cgroup refused a fork)


@dataclasses.dataclass(frozen=True)
class Limits:
    cpu_seconds: float = 60.0
    wall_seconds: float = 300.0
    memory_bytes: int = 2 * GIB
    processes: int = 64  # processes and threads together

    def __post_init__(self) -> None:
        bad = [f"{k}={getattr(self, k)}" for k in ("cpu_seconds", "wall_seconds", "memory_bytes", "processes")
               if not getattr(self, k) > 0]
        if bad:
            raise ConfigError("sandbox limits must be > 0: " + ", ".join(bad))


@dataclasses.dataclass(frozen=True)
class SandboxSpec:
    """One sandbox: `read_only` paths are visible read-only at the same path (an environment's own files),
    `writable` ones read-write (a directory holding the socket it talks over); `network` names what it may
    reach (host:port); under bwrap any entry shares the host's network namespace (no per-address filter yet),
    none gives it a network of its own with only a loopback."""

    mode: SandboxMode = SandboxMode.BWRAP
    limits: Limits = Limits()
    network: tuple[str, ...] = ()
    read_only: tuple[str, ...] = ()
    writable: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.mode, SandboxMode):
            try:
                object.__setattr__(self, "mode", SandboxMode(self.mode))
            except ValueError:
                raise ConfigError(f"sandbox mode {self.mode!r}: choose one of "
                                  f"{[m.value for m in SandboxMode]}") from None
        for entry in self.network:
            host, _, port = entry.rpartition(":")
            if not host or not port.isdigit():
                raise ConfigError(f"sandbox network entry {entry!r}: expected host:port")
