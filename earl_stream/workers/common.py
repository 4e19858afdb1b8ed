"""What every worker role does the same way: register with the supervisor and receive the run's
config, find the model, and stop cleanly on SIGTERM/SIGINT."""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import socket
import threading
import time
from pathlib import Path

from earl_stream import protocol as P
from earl_stream.config import RunConfig, config_from_dict, parse_cpus
from earl_stream.errors import ConfigError
from earl_stream.security.keys import KeyRole, role_of
from earl_stream.security.secret import SECRET_ENV, load_secret

# A trainer pool's rendezvous when it is not torchrun's env:// (MASTER_ADDR/PORT): `worker --nproc N` sets
# a file:// URL, so that the ranks of one host never race another process for a port.
RENDEZVOUS_ENV = "EARL_STREAM_RENDEZVOUS"
# A second signal this soon after the first is the same stop arriving twice: Slurm signals every process of a
# step, and the pool process (`worker --nproc`) or torchrun above a trainer rank passes the stop on as well.
SAME_STOP_S = 2.0

log = logging.getLogger(__name__)


def worker_key() -> tuple[bytes | None, str | None]:
    """The credential a worker signs and serves with, and its file ($EARL_STREAM_SECRET_FILE; None: an open run).
    The worker key is what a worker needs (security/keys.py); the cluster secret still works (older setups, a
    worker started by hand), with a warning; any other role's key is a ConfigError."""
    path = os.environ.get(SECRET_ENV)
    credential = load_secret(path)
    held = role_of(credential)
    if held is KeyRole.CLUSTER:
        log.warning("this worker holds the cluster secret, more than it needs: give workers the worker key "
                    "(`earl-stream keys derive worker --out PATH`; `up`'s launchers do)")
    elif held is not None and held is not KeyRole.WORKER:
        raise ConfigError(f"a worker needs the worker key (or the cluster secret); {path} holds the {held.value} key: "
                          "`earl-stream keys derive worker --out PATH` writes the worker key")
    return credential, path


def register(client: P.ControlClient, role: P.Role, *, host: str, rank: int = -1, shard_address: str = "",
             metrics_address: str = "", worker_id: str = "", deadline_s: float = 60.0,
             openai_url: str = "") -> tuple[P.Registered, RunConfig]:
    reply = client.call_retry(
        P.Register(role=role, host=host or socket.gethostname(), pid=os.getpid(), rank=rank,
                   shard_address=shard_address, metrics_address=metrics_address, worker_id=worker_id,
                   ray_node_id=os.environ.get("EARL_STREAM_RAY_NODE_ID", ""),  # set by the ray launcher
                   openai_url=openai_url),
        deadline_s=deadline_s, what="registration")
    return reply, config_from_dict(json.loads(reply.config_json))


def model_path(cfg: RunConfig) -> Path:
    """The model directory of the run: the user's, this host's checked copy of the Hub model the run pinned
    (`model.hub.local_model_dir`: a copy that differs is a ModelError), or an embedded tiny model (empty or
    `default:<game>`: built once)."""
    from earl_stream.model.default import embedded_game

    game = embedded_game(cfg.model.path)
    if game is None:
        from earl_stream.model.hub import local_model_dir

        found = local_model_dir(cfg.model)
        assert found is not None
        return found
    from earl_stream.model import ensure_default_model

    return ensure_default_model(game=game, warm_start_steps=cfg.model.warm_start_steps,
                                warm_start_seconds=cfg.model.warm_start_seconds)


def pin_to_cpus(cpus: str, threads: int) -> list[int]:
    """Pin this process to `cpus` (a config `cpus` field) and size torch's thread pool.

    With CPUs given, torch gets one thread per pinned CPU (a pool uses exactly its cores, as a
    disaggregated GPU pool would); without, it keeps `threads` and the OS schedules freely.
    Returns the CPUs pinned to ([] = not pinned).
    """
    import torch

    ids = parse_cpus(cpus)
    if ids:
        # sched_setaffinity(0) pins only the calling thread: pin every thread started so far (ZMQ I/O,
        # shard node, metrics server); threads started later inherit the mask.
        for tid in os.listdir("/proc/self/task"):
            try:
                os.sched_setaffinity(int(tid), ids)
            except ProcessLookupError:  # the thread has just exited
                pass
        threads = len(ids)
    torch.set_num_threads(threads)
    log.info("torch threads %d, %s", threads, f"pinned to CPUs {ids}" if ids else "not pinned")
    return ids


class StopFlag:
    """Set by SIGTERM/SIGINT (or by the supervisor); loops check it at safe points.

    With `drain_on_term` the first SIGTERM only sets `leaving`: the worker asks to be drained and stops
    once the supervisor says it drained (how a Kubernetes pod or a preempted node hands its work back);
    SIGINT, or a second SIGTERM, stops it as usual. `stopping` says in the log what the worker does
    before it stops (a trainer rank finishes its step and writes a checkpoint). A second signal stops
    the worker at once (os._exit), unless it comes within SAME_STOP_S of the first."""

    def __init__(self, install_signals: bool = True, *, drain_on_term: bool = False,
                 stopping: str = "stopping at the next safe point") -> None:
        self._event = threading.Event()
        self.drain_on_term = drain_on_term
        self.stopping = stopping
        self.leaving = False
        self._signalled_at = -math.inf  # monotonic time of the signal that stopped it
        if install_signals and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_signal)
            signal.signal(signal.SIGINT, self._on_signal)

    def _on_signal(self, signum: int, _frame: object) -> None:
        if self.drain_on_term and signum == signal.SIGTERM and not self.leaving and not self._event.is_set():
            log.info("received SIGTERM: draining (no new prompts; leaving once the samples held are trained and "
                     "released); a second SIGTERM stops at once")
            self.leaving = True
            return
        if self._event.is_set():
            if time.monotonic() - self._signalled_at < SAME_STOP_S:
                return  # the same stop, passed on by the process above this one
            os._exit(128 + signum)  # a second signal: the user does not want to wait
        self._signalled_at = time.monotonic()
        log.info("received %s: %s; a second signal stops at once", signal.Signals(signum).name, self.stopping)
        self._event.set()

    def set(self) -> None:
        self._event.set()

    def __bool__(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float) -> bool:
        return self._event.wait(timeout)
