"""Leaving a failed step together, in a trainer pool of several ranks (`trainer.oom_recovery`).

Owns `PoolGuard`: it runs a rank's step under `oom_step.run_guarded` so that when any rank fails to
allocate before its optimizer stepped, every rank abandons the step with nothing applied, within
`trainer.oom_abort_seconds`, and the pool's default process group is re-formed for the retry. Asking the
supervisor for a plan and re-binding the model to the new group's meshes is `workers.oom_retry`'s.

How each rank learns of a failure:
- the rank that failed to allocate writes it under the pool's rendezvous store (key `earl/oom/<generation>`;
  the first writer wins, so there is one failure per generation however many ranks fail), then destroys its
  process groups: a peer blocked in a collective with it fails at once (gloo: its connections close);
- a peer busy computing learns from the key: a watcher thread polls it and raises `PeerAbandoned` in the
  rank's main thread (delivered between two Python bytecodes, i.e. between two ops) and, on NCCL, aborts the
  group, whose pending kernels would otherwise wait for the collective timeout. gloo does not honour an
  abort from another thread while a collective is pending (measured: the collective completes once its peer
  joins), hence the key and the closed connections rather than an abort on gloo;
- a rank whose collective failed looks for the key for at most `trainer.oom_abort_seconds`; without it the
  error is not an allocation failure and is raised as before (`CollectiveFailed`, resume from checkpoint).

Then each rank says under `earl/oom/<generation>/rank<r>` whether its state is that of the last completed
step (its optimizer did not step). If one did, or a rank does not answer within 2 x the bound (a rank that
gives up says so under `.../abandoned`, so a late peer raises too), every rank raises: the pool resumes
from its checkpoint, as after any crash. Otherwise every rank re-forms the default process group under the
next generation, on a `PrefixStore` of the same rendezvous store.

Known limit (measured, gloo): under FSDP2 a peer blocked in one of the model's collectives is not released
by the failing rank's abort: something of the failed step (FSDP's mesh info, and a reference we did not
find) still holds the mesh's groups, so their connections stay open until the failing process exits. Such
a failure ends as without recovery, in bounded time (tests/workers/test_pool_rebind.py). Replicated plans
(dp) recover; a sharded model whose ranks all left the step is re-bound (`sharding.rebind`). NCCL takes the
same path plus the watcher's abort: untested here (no GPU).
"""

from __future__ import annotations

import ctypes
import dataclasses
import datetime
import gc
import json
import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _abort_process_group, _get_default_store

from earl_stream.workers.oom import is_allocation_failure
from earl_stream.workers.oom_step import AllocationFailure, TrainerOutOfMemory, run_guarded

log = logging.getLogger(__name__)
T = TypeVar("T")
KEY = "earl/oom"
POLL_S = 0.02  # how often the watcher looks for a peer's failure


class PeerAbandoned(RuntimeError):
    """Raised in a rank's main thread: another rank of the pool failed to allocate during this step."""


@dataclasses.dataclass(frozen=True)
class PoolFailure:
    """The failure every rank of the pool agrees on (the first rank to write it)."""

    rank: int  # the rank that failed to allocate
    error: str
    attempted_bytes: int
    at: float  # unix seconds, when it said so (the pool's hosts' clocks: for the log only)

    def encode(self) -> bytes:
        return json.dumps(dataclasses.asdict(self)).encode()

    @classmethod
    def decode(cls, raw: bytes) -> PoolFailure:
        return cls(**json.loads(raw))


class PoolGuard:
    """One rank's side of leaving a failed step together and re-forming the pool (every rank makes one,
    right after the default process group is initialised)."""

    def __init__(self, rank: int, world: int, *, backend: str, abort_seconds: float,
                 timeout: datetime.timedelta) -> None:
        self.rank, self.world, self.backend = rank, world, backend
        self.abort_seconds, self.timeout = abort_seconds, timeout
        self.store: Any = _get_default_store()  # the rendezvous: it outlives each generation's group
        self._watch_store = _clone(self.store)  # the watcher's own connection (a TCPStore client is one socket)
        self.generation = 0
        self._lock = threading.Lock()
        self._open = False  # the main thread is inside a guarded step and its optimizer has not stepped
        self._injected = False
        self._peer = False  # the step was abandoned for another rank's failure
        self._main = threading.main_thread().ident or 0

    def key(self, suffix: str = "") -> str:
        return f"{KEY}/{self.generation}{suffix}"

    def run(self, run: Callable[[], T], optimizer: torch.optim.Optimizer, device: torch.device) -> T | AllocationFailure:
        """`run()` (this rank's part of a step), or the `AllocationFailure` every rank of the pool agrees on
        when one of them failed to allocate before its optimizer stepped. After a failure this rank's
        process groups are gone: call `reform` before the next collective."""
        self._main = threading.get_ident()
        done = threading.Event()
        watcher = threading.Thread(target=self._watch, args=(done,), name="oom-watch", daemon=True)
        handle = optimizer.register_step_pre_hook(self._before_step)  # before run_guarded's: it may refuse the step
        self._open, self._injected, self._peer = True, False, False
        watcher.start()

        def guarded() -> T:
            try:
                return run()
            finally:
                self._close()

        try:
            outcome = run_guarded(guarded, optimizer, device, peer_failure=self._peer_failure)
        except BaseException as exc:
            self._close()
            if is_allocation_failure(exc):  # after this rank's optimizer stepped: let the peers leave too
                self._publish(PoolFailure(self.rank, str(exc).splitlines()[0][:300] if str(exc) else "", 0,
                                          time.time()))
            if self.store.check([self.key()]):  # a failure the pool cannot recover from: say so, let peers go
                self.store.set(self.key(f"/rank{self.rank}"), b"stepped")
                _leave_group()
            raise
        finally:
            done.set()
            watcher.join()
            handle.remove()
        if isinstance(outcome, AllocationFailure) and not self._peer:
            self._publish(PoolFailure(self.rank, outcome.error, outcome.attempted_bytes, time.time()))
            _leave_group()  # the group is spent; closing it frees peers still blocked in it
            log.warning("trainer rank %d: left the step %.2fs after it failed to allocate", self.rank,
                        time.monotonic() - outcome.failed)
        return outcome

    def _publish(self, failure: PoolFailure) -> None:
        """`failure` under the generation's key, unless a rank wrote one first (then that one stands)."""
        self.store.compare_set(self.key(), b"", failure.encode())

    def reform(self) -> PoolFailure:
        """After a failed step (every rank together): the failure, once every rank said its state is that of
        the last completed step; the default process group re-formed under the next generation."""
        start = time.monotonic()
        failure = PoolFailure.decode(self.store.get(self.key()))
        self.store.set(self.key(f"/rank{self.rank}"), b"intact")
        keys = [self.key(f"/rank{r}") for r in range(self.world)]
        try:  # a peer may take up to the bound to leave the step after this rank did
            self.store.wait(keys, datetime.timedelta(seconds=2 * self.abort_seconds))
            late = self.store.check([self.key("/abandoned")])  # a rank gave up waiting for this one
        except (RuntimeError, dist.DistError) as exc:
            self.store.set(self.key("/abandoned"), b"1")  # a late peer must not wait to re-form without this rank
            raise TrainerOutOfMemory(f"rank {failure.rank} failed to allocate ({failure.error}) and not every rank "
                                     f"left the step within trainer.oom_abort_seconds={self.abort_seconds:g}s: not "
                                     "retried (the pool resumes from its last checkpoint)") from exc
        if late:
            raise TrainerOutOfMemory(f"rank {failure.rank} failed to allocate ({failure.error}) and this rank left the "
                                     f"step later than trainer.oom_abort_seconds={self.abort_seconds:g}s allows: not "
                                     "retried (the pool resumes from its last checkpoint)")
        stepped = [r for r, k in enumerate(keys) if self.store.get(k) != b"intact"]
        _leave_group()
        if stepped:
            raise TrainerOutOfMemory(f"rank {failure.rank} failed to allocate ({failure.error}) after the optimizer "
                                     f"of rank(s) {stepped} stepped: no rank can prove its state is that of the last "
                                     "completed step, so the step is not retried (the pool resumes from its last "
                                     "checkpoint)")
        self.generation += 1
        dist.init_process_group(self.backend, store=dist.PrefixStore(f"earl/pool/{self.generation}", self.store),
                                rank=self.rank, world_size=self.world, timeout=self.timeout)
        log.warning("trainer rank %d: the pool re-formed (generation %d) %.2fs after agreeing on rank %d's failure",
                    self.rank, self.generation, time.monotonic() - start, failure.rank)
        return failure

    def _peer_failure(self, exc: BaseException) -> AllocationFailure | None:
        """Another rank's failure that explains `exc` (its key shows up within the bound), or None."""
        collective = isinstance(exc, (PeerAbandoned, dist.DistError)) or any(
            w in str(exc) for w in ("gloo", "NCCL", "Connection closed", "Connection reset"))
        try:
            if collective:
                self.store.wait([self.key()], datetime.timedelta(seconds=self.abort_seconds))
            elif not self.store.check([self.key()]):
                return None
        except (RuntimeError, dist.DistError):  # the store's wait timed out: not a peer's allocation failure
            return None
        _leave_group()  # the group is spent either way; closing it frees peers still blocked in it
        self._peer = True
        peer = PoolFailure.decode(self.store.get(self.key()))
        log.warning("trainer rank %d: rank %d failed to allocate (%s); left the step %.2fs after it (%s: %s)",
                    self.rank, peer.rank, peer.error, time.time() - peer.at, type(exc).__name__,
                    str(exc).splitlines()[0][:120] if str(exc) else "")
        now = time.monotonic()
        return AllocationFailure(peer.error, peer.attempted_bytes, now, now)

    def _watch(self, done: threading.Event) -> None:
        key = self.key()
        while not done.wait(POLL_S):
            if self._watch_store.check([key]):
                break
        else:
            return
        with self._lock:
            if self._open and not self._injected:
                _raise_in(self._main, PeerAbandoned)
                self._injected = True
        if "nccl" in self.backend and dist.is_initialized():  # gloo ignores it; NCCL's kernels need it (untested)
            _abort_process_group()

    def _close(self) -> None:
        with self._lock:
            self._open = False
            if self._injected:
                _raise_in(self._main, None)  # one not delivered yet is dropped

    def _before_step(self, *_: Any) -> None:
        """No optimizer step once a peer failed: the step is abandoned instead (every rank's state intact)."""
        self._close()
        if self._injected or self.store.check([self.key()]):
            raise PeerAbandoned("another rank failed to allocate during this step")


def _raise_in(thread_id: int, exc: type[BaseException] | None) -> None:
    """Raise `exc` in the thread `thread_id` at its next bytecode (None: cancel one not raised yet)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(exc) if exc else None)


def _clone(store: Any) -> Any:
    try:
        return store.clone()
    except (RuntimeError, NotImplementedError, AttributeError):  # a store that cannot: shared (FileStore locks)
        return store


def _leave_group() -> None:
    """Abort and forget this rank's process groups (all of them): peers blocked in a collective with it fail
    at once, because the gloo connections close when the last reference to the group goes. One such
    reference outlives the registry: `torch.distributed.nn.functional`'s default arguments
    (`group=group.WORLD`, bound when it is imported, which importing torch._dynamo does, e.g. when an AdamW
    is made). Measured with it kept: the blocked peer waited ~9 s, until the failing process exited; with
    it dropped, ~0.01 s."""
    if not dist.is_initialized():
        return
    world = dist.group.WORLD
    functional = sys.modules.get("torch.distributed.nn.functional")
    for fn in vars(functional).values() if functional is not None else ():
        if callable(fn) and getattr(fn, "__defaults__", None) and any(d is world for d in fn.__defaults__):
            fn.__defaults__ = tuple(None if d is world else d for d in fn.__defaults__)  # None: the default group
    del world
    _abort_process_group()
    gc.collect()
