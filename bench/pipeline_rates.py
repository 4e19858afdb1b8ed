"""Measuring `earl-stream up` runs from outside (shared by bench/e2e.py and bench/real_model.py): launching
and polling a run, CPU seconds per role, the trainer's and rollout's log lines, and the async/sync overlap
ceiling. What the runs train, and what is reported from them, is left to each benchmark.

- `start_up` launches an `earl-stream up` command line with a fresh secret and returns it with a control
  client once the supervisor is ready (bench/learning.py polls its own way).
- `watch_up` launches `python -m earl_stream up ARGS` with a fresh secret, polls the supervisor's status
  every `poll_s` seconds and keeps a `Snapshot` of each poll (seconds since launch, wall clock, policy
  version, the status, CPU seconds per role) until its `stop` says so or the run ends; then SIGTERM.
  `Watch.first` is the first poll that saw step >= 1: rates measured from it leave out start-up (model
  load, the first weights) and the first step.
- `step_window` turns the polls from `Watch.first` to the last one into samples/s and CPU seconds per step,
  over whole steps, timed by the trainer log's own timestamps.
- `overlap_ceiling` is the best async/sync ratio one core per pool allows, from a synchronous run's CPU
  seconds per step.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

# Rollout workers learn of a new policy version by heartbeat: a shorter period than the default 1 s
# shortens the synchronous mode's wait for weights (the asynchronous one hardly waits).
HEARTBEAT_S = 0.25
# Both modes, disaggregated: the rollout pool on CPU 0, the trainer pool on CPU 1 (one torch thread each);
# the supervisor is not pinned (it is a light control plane).
PINNED_POOLS = ["rollout.workers=1", "rollout.cpus=0", "trainer.cpus=1", f"supervisor.heartbeat_s={HEARTBEAT_S}"]
# async: the default staleness bound; sync: `trainer.max_staleness=0`, i.e. generate, train, generate.
MODE_OVERRIDES: dict[str, list[str]] = {"async": [], "sync": ["trainer.max_staleness=0"]}
STEP_LINE = re.compile(r"^(\S+ \S+) .*step (\d+): loss \S+ grad-norm \S+ reward \S+ \((\d+) samples, (\d+) tokens\) "
                       r"in ([\d.]+)s \(pull ([\d.]+)s\)")
# the step line's tail: tokens that receive gradient (absent from logs written before it was added)
LOSS_TOKENS = re.compile(r".*; (\d+) loss tokens$")
LOAD_LINE = re.compile(r"^(\S+ \S+) .*loaded policy version \d+ in ([\d.]+)s")


@dataclass(frozen=True)
class Snapshot:
    """One poll of a run: `t` seconds since launch (monotonic), `wall` (time.time()), `step` (the policy
    version), the supervisor's status, and `cpu`: CPU seconds (user + system) so far per role."""

    t: float
    wall: float
    step: int
    status: dict[str, Any]
    cpu: dict[str, float]


@dataclass
class Watch:
    """What `watch_up` saw: every poll, and whether its `stop` ended the run (False: the run ended itself)."""

    snapshots: list[Snapshot] = field(default_factory=list)
    stopped: bool = False

    @property
    def first(self) -> Snapshot | None:
        """The first poll that saw step >= 1: the start of every measured window."""
        return next((s for s in self.snapshots if s.step >= 1), None)


def start_up(cmd: list[str], run_dir: Path, *, what: str = "", wait_s: float = 0.2) -> tuple[subprocess.Popen, Any]:
    """Launch `cmd` (an `earl-stream up` command line, `run_dir=RUN_DIR` among its arguments) with a fresh
    secret; wait for the supervisor's ready file and return the process and a control client on it.
    SystemExit if the run exits first; the caller stops the process (SIGTERM) when it is done."""
    from earl_stream import protocol as P
    from earl_stream.security.secret import SECRET_ENV, create_secret_file, load_secret

    secret_file = create_secret_file(run_dir / "secret")
    ready = run_dir / "supervisor.json"
    ready.unlink(missing_ok=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, env={**os.environ, SECRET_ENV: str(secret_file)})
    try:
        while not ready.exists():
            if proc.poll() is not None:
                raise SystemExit(f"earl-stream up{f' ({what})' if what else ''} exited early with code {proc.returncode}")
            time.sleep(wait_s)
        client = P.ControlClient(json.loads(ready.read_text())["address"], timeout_s=10,
                                 secret=load_secret(str(secret_file)))
    except BaseException:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
        raise
    return proc, client


def watch_up(up_args: list[str], run_dir: Path, stop: Callable[[Snapshot, Snapshot | None], bool], *, what: str,
             poll_s: float = 1.0, exit_ok: bool = False, term_wait_s: float = 120.0,
             on_poll: Callable[[Snapshot], None] | None = None) -> Watch:
    """Run `earl-stream up UP_ARGS` (`run_dir=` among them), polling until `stop(now, first)` is true;
    SystemExit if the run ends first unless `exit_ok` (e.g. a run with `--steps`)."""
    from earl_stream import protocol as P
    from earl_stream.errors import EarlError

    launched = time.monotonic()
    proc, client = start_up([sys.executable, "-m", "earl_stream", "up", *up_args], run_dir, what=what)
    watch = Watch()
    try:
        while proc.poll() is None:
            time.sleep(poll_s)
            try:
                status = json.loads(client.call(P.StatusRequest()).status_json)
            except EarlError:
                continue
            now = Snapshot(round(time.monotonic() - launched, 2), time.time(), int(status["policy_version"]), status,
                           cpu_times(proc.pid, status))
            watch.snapshots.append(now)
            if on_poll is not None:
                on_poll(now)
            if stop(now, watch.first):
                watch.stopped = True
                break
        if not watch.stopped and not exit_ok:
            raise SystemExit(f"earl-stream up ({what}) stopped early with code {proc.returncode}; see {run_dir}/logs")
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(term_wait_s)
    return watch


def cpu_times(up_pid: int, status: dict[str, Any]) -> dict[str, float]:
    """CPU seconds (user+system, all threads) per role: rollout, trainer, supervisor."""
    tick = os.sysconf("SC_CLK_TCK")
    pids = {w["pid"]: w["role"] for w in status.get("workers", []) if w.get("alive")}
    for p in Path("/proc").iterdir():  # the supervisor: the child of `up` that is no worker
        if p.name.isdigit() and int(p.name) not in pids:
            try:
                fields = (p / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[1]) == up_pid and b"supervisor" in (p / "cmdline").read_bytes():
                    pids[int(p.name)] = "supervisor"
            except (OSError, IndexError, ValueError):
                continue
    out: dict[str, float] = {}
    for pid, role in pids.items():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[role] = out.get(role, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def _when(stamp: str) -> float:
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def log_window(path: Path, pattern: re.Pattern[str], start: float, end: float) -> list[tuple[str, ...]]:
    """The groups (timestamp left out) of the lines of `path` that match `pattern`, logged in [start, end]."""
    rows = []
    for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
        m = pattern.match(line)
        if m and start <= _when(m.group(1)) <= end:
            rows.append(m.groups()[1:])
    return rows


@dataclass(frozen=True)
class TrainerStep:
    """One `step N:` line of trainer.log: when it was logged (epoch seconds), samples and tokens trained,
    the step's seconds and the pull's seconds, and its loss tokens (those that receive gradient; None in logs
    written before the line carried them)."""

    when: float
    samples: int
    tokens: int
    seconds: float
    pull_seconds: float
    loss_tokens: int | None = None


def trainer_steps(path: Path) -> dict[int, TrainerStep]:
    """Step number -> its line in trainer.log (the last one, should a step be logged twice)."""
    out = {}
    for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
        if m := STEP_LINE.match(line):
            loss = LOSS_TOKENS.match(line)
            out[int(m.group(2))] = TrainerStep(_when(m.group(1)), int(m.group(3)), int(m.group(4)),
                                               float(m.group(5)), float(m.group(6)),
                                               int(loss.group(1)) if loss else None)
    return out


def step_window(watch: Watch, run_dir: Path) -> dict[str, Any]:
    """Rates over the whole steps between `watch.first` and the last poll: the trainer logs step N before
    it publishes version N, so a poll that sees version N has its line. Samples/s: samples trained in steps
    first+1..last over the time between the lines of steps `first` and `last`; CPU seconds per step: each
    role's CPU time between the two polls over the number of steps."""
    first, last = watch.first, watch.snapshots[-1] if watch.snapshots else None
    if first is None or last is None or last.step <= first.step:
        raise SystemExit(f"no whole step after step 1 to measure in {run_dir}; see {run_dir}/logs")
    logged = trainer_steps(run_dir / "logs" / "trainer.log")
    n = last.step - first.step
    window = [logged[s] for s in range(first.step + 1, last.step + 1) if s in logged]
    if len(window) != n or first.step not in logged:
        raise SystemExit(f"{run_dir}/logs/trainer.log lacks steps {first.step}..{last.step}")
    dt = logged[last.step].when - logged[first.step].when
    cpu = {role: last.cpu[role] - first.cpu.get(role, 0.0) for role in last.cpu}
    return {
        "steps": n, "first_step": first.step, "window_s": round(dt, 2), "startup_s": first.t,
        "samples_per_s": sum(s.samples for s in window) / dt,
        "trained_tokens_per_s": sum(s.tokens for s in window) / dt,
        "loss_tokens_per_s": (sum(s.loss_tokens for s in window if s.loss_tokens is not None) / dt
                              if all(s.loss_tokens is not None for s in window) else None),
        "trainer_step_s_mean": round(sum(s.seconds for s in window) / n, 3),
        "cpu_seconds_per_step": {role: round(v / n, 3) for role, v in cpu.items()},
        "cpu_utilisation": {role: round(v / (last.t - first.t), 3) for role, v in cpu.items()},
        "samples_stale": last.status.get("samples_stale", 0) - first.status.get("samples_stale", 0),
    }


def overlap_ceiling(cpu_per_step: dict[str, float]) -> dict[str, Any]:
    """`async_vs_sync_ceiling` (and a note) from a synchronous run's CPU seconds per step; {} without both roles.
    With one core per pool, overlap turns a synchronous step of gen + train into max(gen, train)."""
    gen, train = cpu_per_step.get("rollout"), cpu_per_step.get("trainer")
    if not (gen and train):
        return {}
    return {"async_vs_sync_ceiling": (gen + train) / max(gen, train),
            "ceiling_note": f"sync step = {gen:.2f} CPU-s generation + {train:.2f} CPU-s training; with one core "
                            "per pool the asynchronous pipeline can at best run a step in the larger of the two"}
