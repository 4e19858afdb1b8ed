"""A trainer step that fails to allocate, abandoned with nothing applied (`trainer.oom_recovery`).

Owns `run_guarded`: it runs one step and turns an allocation failure (`oom.is_allocation_failure`) raised
before the optimizer's first `step()` into an `AllocationFailure`, after discarding the step's gradients,
restoring the RNG state it started from and releasing what the failed step held, so that the model and
optimizer are exactly those of the last completed step and the same batch can be trained again. A failure
inside or after an optimizer step (several updates per step, or the step's own temporaries) is raised as
it is: the rank's state is no longer that of a completed step, and the pool resumes from its last
checkpoint as after any crash. In a pool of several ranks, `peer_failure` turns the error a rank sees when
another rank abandoned the step (its collective fails, or `pool_abort.PeerAbandoned`) into the same
`AllocationFailure`, with the same clean-up (`workers.pool_abort`). Asking the supervisor for a plan and
retrying is `workers.oom_retry`'s; the supervisor's side is `supervisor.oom_replan`.

`cap_address_space`: for tests and benchmarks, caps the process's address space (RLIMIT_AS) a given
headroom above what it maps now ($EARL_TRAINER_AS_HEADROOM_BYTES in a trainer rank, once its model and
optimizer are built), so that a plan the selector was told fits fails to allocate for real on a CPU;
$EARL_TRAINER_AS_CAP_RANKS (e.g. "1") caps only those ranks of a pool, so that the failure lands on one rank
while the others go on to their next collective.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import resource
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from earl_stream.errors import EarlError
from earl_stream.workers.host_memory import free_unused_memory
from earl_stream.workers.oom import attempted_bytes, is_allocation_failure, release_cached

log = logging.getLogger(__name__)
AS_HEADROOM_ENV = "EARL_TRAINER_AS_HEADROOM_BYTES"
AS_CAP_RANKS_ENV = "EARL_TRAINER_AS_CAP_RANKS"
T = TypeVar("T")


class TrainerOutOfMemory(EarlError):
    """A step failed to allocate and no plan the corrected memory model trusts is left to retry it under."""


@dataclasses.dataclass(frozen=True)
class AllocationFailure:
    """A step abandoned before any update: what the allocator said, and when (monotonic seconds)."""

    error: str  # the failure's first line
    attempted_bytes: int  # the size of the failed allocation (0: the message does not say)
    started: float  # when the failed attempt began
    failed: float  # when it failed


def run_guarded(run: Callable[[], T], optimizer: torch.optim.Optimizer, device: torch.device, *,
                peer_failure: Callable[[BaseException], AllocationFailure | None] | None = None) -> T | AllocationFailure:
    """`run()`, or an `AllocationFailure` when it failed to allocate before the optimizer stepped (then no
    gradient, RNG draw or cached block of the attempt is left). `peer_failure(exc)`: for an error that is not
    an allocation failure, another rank's failure that explains it (None: `exc` is raised as it is)."""
    stepped = False

    def mark(*_: Any) -> None:
        nonlocal stepped
        stepped = True

    handle = optimizer.register_step_pre_hook(mark)
    rng = torch.get_rng_state()
    started = time.monotonic()
    try:
        return run()
    except (RuntimeError, MemoryError) as exc:  # torch.OutOfMemoryError is a RuntimeError
        own = is_allocation_failure(exc)
        elsewhere = None if own or stepped or peer_failure is None else peer_failure(exc)
        if not own and elsewhere is None:
            raise
        if stepped:
            log.error("the step failed to allocate after the optimizer stepped: the rank's state is not that of a "
                      "completed step, so it is not retried (the pool resumes from its last checkpoint)")
            raise
        text = str(exc).strip()
        failure = elsewhere or AllocationFailure(text.splitlines()[0][:300] if text else type(exc).__name__,
                                                 attempted_bytes(exc) or 0, started, time.monotonic())
        release_cached(exc, device)
    finally:
        handle.remove()
    optimizer.zero_grad(set_to_none=True)
    torch.set_rng_state(rng)
    free_unused_memory()
    return failure


def _vm_size() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    return 0


def cap_address_space(environ: dict[str, str] | None = None) -> int | None:
    """Cap RLIMIT_AS at VmSize + $EARL_TRAINER_AS_HEADROOM_BYTES when that is set (Linux) and this rank ($RANK)
    is one of $EARL_TRAINER_AS_CAP_RANKS (comma-separated; unset: every rank); the cap, or None."""
    env = environ if environ is not None else os.environ
    headroom = int(env.get(AS_HEADROOM_ENV, "0") or 0)
    if headroom <= 0 or not Path("/proc/self/status").exists():
        return None
    if (ranks := env.get(AS_CAP_RANKS_ENV, "")) and env.get("RANK", "0") not in ranks.split(","):
        return None
    # the intra-op thread pool first: its threads' stacks mapped before the cap, not by the first parallel op after
    # it, where a failed thread creation aborts the process (libgomp) instead of raising an allocation failure
    torch.ones(1 << 20).sum()
    cap = _vm_size() + headroom
    resource.setrlimit(resource.RLIMIT_AS, (cap, resource.getrlimit(resource.RLIMIT_AS)[1]))
    log.warning("address space capped at %d MiB (%s=%d: a test or benchmark of allocation failures)", cap >> 20,
                AS_HEADROOM_ENV, headroom)
    return cap
