"""`earl-stream worker`: a rollout worker, or a trainer pool of --nproc ranks started torchrun-style on
this host. The workers themselves live in `earl_stream.workers`; this module only starts them."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from earl_stream.workers.common import RENDEZVOUS_ENV

if TYPE_CHECKING:
    from earl_stream.cli.procs import ProcessGroup

log = logging.getLogger(__name__)


def run_worker(args: argparse.Namespace) -> int:
    if args.restart < 0 or args.collective_timeout <= 0 or args.stop_grace <= 0:
        from earl_stream.errors import ConfigError

        raise ConfigError("--restart must be >= 0, --collective-timeout and --stop-grace > 0")
    if args.role == "rollout":
        from earl_stream.workers.rollout import run_rollout_worker

        run_rollout_worker(args.supervisor, host=args.advertise, drain_on_term=args.drain_on_term)
        return 0
    if "RANK" in os.environ:
        if args.restart:
            log.warning("--restart is ignored under torchrun (RANK is set): use torchrun --max-restarts")
    elif args.nproc > 1 or args.restart > 0:
        return _spawn_ranks(args)
    from earl_stream.workers.trainer import run_trainer_rank

    return run_trainer_rank(args.supervisor, host=args.advertise, collective_timeout_s=args.collective_timeout)


def _spawn_ranks(args: argparse.Namespace) -> int:
    """Start --nproc trainer ranks on this host, torchrun-style (RANK, WORLD_SIZE; they meet through a file).

    A rank that dies stops the whole pool (the others would fail in their next collective anyway);
    with --restart N the pool is started again, up to N times, and resumes from its checkpoint.
    """
    import signal

    from earl_stream.errors import ChildProcessFailed

    stopping = _PoolSignals()
    signal.signal(signal.SIGTERM, stopping)
    signal.signal(signal.SIGINT, stopping)
    for attempt in range(args.restart + 1):
        failure = _run_pool(args, stopping)
        if failure is None or stopping:
            return 0
        if attempt == args.restart:
            raise ChildProcessFailed(f"{failure}; the trainer pool stopped"
                                     + (f" after {args.restart} restarts" if args.restart else
                                        " (relaunch it, or pass --restart N, to resume from its latest checkpoint)"))
        log.warning("%s: restarting the trainer pool (%d of %d); it resumes from its latest checkpoint", failure,
                    attempt + 1, args.restart)
    return 0


class _PoolSignals:
    """SIGTERM/SIGINT of the pool's own process: the first stops its ranks gently (each finishes its step
    and writes a checkpoint, within --stop-grace); a second one is passed on to the ranks, which then stop
    at once."""

    def __init__(self) -> None:
        self.received = 0
        self.group: ProcessGroup | None = None  # the ranks running now

    def __call__(self, signum: int, _frame: object) -> None:
        self.received += 1
        if self.received > 1 and self.group is not None:
            for c in self.group.children:
                if c.proc.poll() is None:
                    c.proc.send_signal(signum)

    def __bool__(self) -> bool:
        return self.received > 0


def _run_pool(args: argparse.Namespace, stopping: _PoolSignals) -> str | None:
    """Run one incarnation of the pool; returns what failed (None: it finished or was stopped)."""
    import time

    from earl_stream.cli.procs import STOP_GRACE_S, ProcessGroup, describe_exit

    # The ranks of one host meet through a file, not a port picked here and bound later by rank 0: in
    # between another process (a rollout worker's metrics server) could take that port.
    meeting = Path(tempfile.mkdtemp(prefix="earl-stream-pool-"))
    group = stopping.group = ProcessGroup()
    for rank in range(args.nproc):
        env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(args.nproc),
               "LOCAL_WORLD_SIZE": str(args.nproc), RENDEZVOUS_ENV: f"file://{meeting / 'rendezvous'}"}
        group.start(f"trainer rank {rank}", ["worker", "--role", "trainer", "--supervisor", args.supervisor,
                                             "--advertise", args.advertise, "--collective-timeout",
                                             str(args.collective_timeout)], env=env)
    try:
        while True:
            failed = [c for c in group.children if c.proc.poll() not in (None, 0)]
            if failed and not stopping:  # the rank that was killed, rather than the ones that then lost their peer
                return describe_exit(min(failed, key=lambda c: c.proc.returncode))
            if stopping or all(c.proc.poll() is not None for c in group.children):
                break  # stopped, or every rank finished (a pool of one that died is a failure, above)
            time.sleep(0.2)
    finally:
        # Stopped: every rank at once, with the time to finish its step (they agree on the step to stop
        # after). Failed: the survivors are stuck in a collective with the dead rank, so not waited for long.
        group.stop(args.stop_grace if stopping else STOP_GRACE_S, only=group.children)
        shutil.rmtree(meeting, ignore_errors=True)
    return None
