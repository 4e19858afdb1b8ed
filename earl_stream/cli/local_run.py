"""Finding a run on this machine, and `earl-stream stop`.

Owns: which run directory a live-run command (`status`, `scale`, `env`, `episodes`, `keys`, `stop`) talks to
when no `--supervisor` is given (the RUN_DIR given, else this directory when it is a run directory, else
`runs/latest`, else the newest `runs/*`), the record `up` leaves there (RUN_DIR/up.json: its pid and summary
path, removed when `up` exits), and stopping a run as Ctrl-C on `up` does. Leaves to `up` the shutdown itself
(drain, checkpoint, summary) and to `security.secret` the run's secret file.
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import json
import os
import signal
import time
from pathlib import Path

from earl_stream.errors import ConfigError, ControlPlaneTimeout
from earl_stream.security.secret import READY_FILE, RUN_SECRET

DEFAULT_RUN_DIR = Path("runs") / "latest"  # config.run_dir's default, relative to where `up` runs
UP_RECORD = "up.json"  # in RUN_DIR while `up` runs: {"pid", "summary"}
RUN_DIR_HELP = ("the run's directory, as `up` made it (default: this directory if it is one, else runs/latest, else the "
                "newest runs/*/ with a supervisor.json)")
SUPERVISOR_HELP = ("the supervisor's address (default: the one the run directory's supervisor.json names, see "
                   "--run-dir; so in the directory where `earl-stream up` runs no flag is needed)")


@dataclasses.dataclass(frozen=True)
class LocalRun:
    """A run directory found on this machine: its supervisor's address and, while `up` runs it, `up`'s pid."""

    run_dir: Path
    address: str
    up_pid: int | None
    summary: Path

    @property
    def secret_file(self) -> Path | None:
        path = self.run_dir / RUN_SECRET
        return path if path.is_file() else None


class RunNotFound(ConfigError):
    """No run directory with a supervisor.json where one was looked for."""


def _candidates(where: Path) -> list[Path]:
    if (where / READY_FILE).is_file():
        return [where]
    if (where / DEFAULT_RUN_DIR / READY_FILE).is_file():
        return [where / DEFAULT_RUN_DIR]
    runs = [p.parent for p in (where / "runs").glob(f"*/{READY_FILE}")]
    return sorted(runs, key=lambda d: (d / READY_FILE).stat().st_mtime, reverse=True)[:1]


def find_run(run_dir: str | Path | None = None, where: Path | None = None) -> LocalRun:
    """The run in `run_dir`, else the newest local run below `where` (default: the working directory).
    Raises RunNotFound naming the path looked at."""
    where = Path.cwd() if where is None else where
    if run_dir is not None:
        found = [Path(run_dir)]
        looked = Path(run_dir) / READY_FILE
    else:
        found = _candidates(where)
        looked = DEFAULT_RUN_DIR / READY_FILE
    if not found or not (found[0] / READY_FILE).is_file():
        raise RunNotFound(f"no run found: {looked} does not exist (start one with `earl-stream up` in this directory, "
                          "or pass --supervisor tcp://HOST:PORT, or the run's directory: --run-dir RUN_DIR, `stop RUN_DIR`)")
    path = found[0]
    try:
        address = json.loads((path / READY_FILE).read_text())["address"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise RunNotFound(f"{path / READY_FILE} names no supervisor address ({exc}); pass --supervisor") from exc
    pid, summary = _up_record(path)
    return LocalRun(path.resolve(), str(address), pid, summary)


def _up_record(run_dir: Path) -> tuple[int | None, Path]:
    """`up`'s pid when an `up` that is still running left its record in `run_dir`, and its summary path."""
    summary = run_dir.resolve() / "summary.json"
    try:
        record = json.loads((run_dir / UP_RECORD).read_text())
        pid, summary = int(record["pid"]), Path(record.get("summary") or summary)
    except (OSError, ValueError, KeyError, TypeError):
        return None, summary
    return (pid if _is_up(pid) else None), summary


def _is_up(pid: int) -> bool:
    """Whether `pid` is a live (not zombie) earl-stream process; where /proc is absent, whether it exists."""
    proc = Path(f"/proc/{pid}")
    try:
        if proc.is_dir():
            state = (proc / "stat").read_text().rpartition(")")[2].split()[0]
            return state not in ("Z", "X") and b"earl" in (proc / "cmdline").read_bytes()
        os.kill(pid, 0)
        return True
    except (OSError, IndexError, ProcessLookupError):
        return False


def record_up(run_dir: Path, summary: Path) -> None:
    """Called by `up`: leave its pid and summary path in RUN_DIR/up.json for `earl-stream stop`, removed when
    it exits."""
    path = run_dir / UP_RECORD
    path.write_text(json.dumps({"pid": os.getpid(), "summary": str(summary.resolve())}))
    atexit.register(path.unlink, missing_ok=True)


def stop_run(run: LocalRun, timeout_s: float) -> str:
    """End the run as Ctrl-C on its `up` does (SIGINT: drain, checkpoint, summary) and wait until `up` has
    exited; a run without `up` (started by hand) is told by its supervisor to finish. Returns what happened."""
    if run.up_pid is None:
        ready = run.run_dir / READY_FILE
        if run.summary.is_file() and run.summary.stat().st_mtime >= ready.stat().st_mtime:
            raise RunNotFound(f"the run in {run.run_dir} has already ended (its summary: {run.summary})")
        return finish_by_supervisor(run.address)
    os.kill(run.up_pid, signal.SIGINT)
    deadline = time.monotonic() + timeout_s
    while _is_up(run.up_pid) and (run.run_dir / UP_RECORD).exists():
        if time.monotonic() > deadline:
            raise ControlPlaneTimeout(f"`up` (pid {run.up_pid}) of the run in {run.run_dir} is still stopping after "
                                      f"{timeout_s:.0f}s (it drains and checkpoints first); wait, or stop again with "
                                      "a longer --timeout")
        time.sleep(0.2)
    where = f"; summary in {run.summary}" if run.summary.is_file() else " (no summary written: see its output)"
    return f"stopped the run in {run.run_dir} (up pid {run.up_pid} exited){where}"


def add_run_args(p: argparse.ArgumentParser) -> None:
    """--supervisor and --run-dir of a live-run command, both optional: the run defaults to the local one."""
    p.add_argument("--supervisor", metavar="tcp://HOST:PORT", help=SUPERVISOR_HELP)
    p.add_argument("--run-dir", metavar="RUN_DIR", help=RUN_DIR_HELP)


def finish_by_supervisor(address: str) -> str:
    from earl_stream import protocol as P
    from earl_stream.security.keys import KeyRole, key_for
    from earl_stream.security.secret import load_secret

    client = P.ControlClient(address, timeout_s=10, secret=key_for(load_secret(), KeyRole.OPERATOR))
    try:
        client.call(P.Finished(worker_id="", reason="stopped by `earl-stream stop`"), what="finish")
    finally:
        client.close()
    return (f"no `up` runs this run: told the supervisor at {address} to finish (the trainer ends, the workers "
            "stop; the processes started by hand exit on their own)")
