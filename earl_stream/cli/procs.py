"""Child processes of `earl-stream up` and `worker --nproc`: start, watch, stop, leave no orphans.

Children are started in their own session (the terminal's Ctrl-C reaches only the parent, which
then stops them in order) and with PR_SET_PDEATHSIG, so that they die with their parent even if the
parent is killed with SIGKILL.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger(__name__)
PR_SET_PDEATHSIG = 1
STOP_GRACE_S = 15.0  # between SIGTERM and SIGKILL, for a child without a grace of its own


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:  # not Linux: children then rely on the parent's orderly stop
        pass


@dataclasses.dataclass
class Child:
    name: str
    proc: subprocess.Popen
    log_path: str | None = None
    args: Sequence[str] = ()  # `earl-stream` arguments, for `ProcessGroup.restart`
    env: dict[str, str] | None = None
    prefix: Sequence[str] = ()  # what runs `python -m earl_stream ...` (e.g. an srun step), if anything
    stop_grace_s: float | None = None  # its time between SIGTERM and SIGKILL (None: the group's, STOP_GRACE_S)

    def poll(self) -> int | None:
        return self.proc.poll()

    def describe_exit(self) -> str:
        """How it ended, where its log is, and the log's last lines (a launcher's `Placed`)."""
        return describe_exit(self) + log_tail(self.log_path)


class ProcessGroup:
    def __init__(self) -> None:
        self.children: list[Child] = []

    def start(self, name: str, args: Sequence[str], *, env: dict[str, str] | None = None,
              log_path: str | None = None, prefix: Sequence[str] = (), stop_grace_s: float | None = None) -> Child:
        """Start `python -m earl_stream ARGS` (behind `prefix`, e.g. `srun ...`, when given). `stop_grace_s`:
        how long `stop` lets it finish after SIGTERM (a trainer's step and checkpoint) before SIGKILL."""
        child = Child(name, _spawn(args, env, log_path, prefix), log_path, list(args), env, list(prefix),
                      stop_grace_s)
        self.children.append(child)
        log.debug("started %s (pid %d)", name, child.proc.pid)
        return child

    def restart(self, child: Child, args: Sequence[str] | None = None) -> None:
        """Start an exited child again in its place (same log, appended), with `args` if given."""
        if child.proc.poll() is None:
            raise RuntimeError(f"{child.name} (pid {child.proc.pid}) is still running")
        if args is not None:
            child.args = list(args)
        child.proc = _spawn(child.args, child.env, child.log_path, child.prefix)
        log.debug("restarted %s (pid %d)", child.name, child.proc.pid)

    def failed(self) -> Child | None:
        """The first child that exited with a non-zero code, if any."""
        for c in self.children:
            code = c.proc.poll()
            if code not in (None, 0):
                return c
        return None

    def stop(self, timeout_s: float = STOP_GRACE_S, *, only: Sequence[Child] | None = None) -> None:
        """SIGTERM every live child, wait, then SIGKILL what is left after its grace (its `stop_grace_s`,
        else `timeout_s`).

        Children stop in reverse start order (workers before the supervisor they talk to), in waves:
        those with a grace of their own (a trainer finishing its last step, which may still pull rows
        from the rollout workers and report to the supervisor), then the others but the first child,
        then the first child.
        """
        children = list(only if only is not None else self.children)
        rest = children[1:][::-1]
        waves = ([[c for c in rest if c.stop_grace_s is not None], [c for c in rest if c.stop_grace_s is None],
                  children[:1]] if only is None else [children])
        for wave in waves:
            for c in wave:
                if c.proc.poll() is None:
                    c.proc.send_signal(signal.SIGTERM)
                    c.proc.send_signal(signal.SIGCONT)  # a stopped (frozen) child handles SIGTERM only once resumed
            started = time.monotonic()
            for c in wave:
                grace = timeout_s if c.stop_grace_s is None else c.stop_grace_s
                try:
                    c.proc.wait(max(0.0, started + grace - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.warning("%s (pid %d) did not stop within %.0fs: killing it", c.name, c.proc.pid, grace)
                    c.proc.kill()
                    c.proc.wait()


def _spawn(args: Sequence[str], env: dict[str, str] | None, log_path: str | None,
           prefix: Sequence[str] = ()) -> subprocess.Popen:
    out = open(log_path, "ab") if log_path else None  # the child keeps its own copy of the descriptor
    try:
        return subprocess.Popen([*prefix, sys.executable, "-m", "earl_stream", *args], env={**os.environ, **(env or {})},
                                stdout=out, stderr=subprocess.STDOUT if out else None, stdin=subprocess.DEVNULL,
                                start_new_session=True, preexec_fn=_die_with_parent)
    finally:
        if out:
            out.close()


def describe_exit(child: Child) -> str:
    code = child.proc.returncode
    how = f"was killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exited with code {code}"
    where = f"; its log: {child.log_path}" if child.log_path else ""
    return f"{child.name} (pid {child.proc.pid}) {how}{where}"


def log_tail(path: str | None, lines: int = 12) -> str:
    """The last lines of a log, indented, for an error message ("" when there is no log)."""
    if not path or not Path(path).exists():
        return ""
    text = Path(path).read_text(errors="replace").strip().splitlines()[-lines:]
    return "\n  last lines of its log:\n    " + "\n    ".join(text)
