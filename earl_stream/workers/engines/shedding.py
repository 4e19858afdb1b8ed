"""Load shedding of the built-in engine: what an allocation failure in a prefill or decode step changes.

Owns the lowered admission after a failure (`Shedder`: a ceiling on the rollout plan's capacity, halved
per failure, and the per-engine record of every shed, `OomShed`), what happens to the failed step's rows
(`ShedSteps._shed`: re-queued first with their context so far as prompt, `running.Row.resume_from_context`,
as an interrupting weight swap does, so the tokens already sampled stay with their log-probs and versions
and the rest is sampled from the re-prefilled logits) and the refusal of a request that fails even alone
(`RequestOutOfMemory`). The engine (`torch_engine`) catches the failure (`workers.oom.is_allocation_failure`)
and drops the failed step's batch; the supervisor's rollout plan is left to the supervisor, to which each shed's
evidence goes (the bytes the failed allocation asked for and the memory in use then, `OomShed`, in the rollout
worker's heartbeat).

The ceiling stays for the engine's life (no growing back: a shed costs a re-prefill, a repeated one
more than the memory a slow regrowth would win); a new plan (`set_capacity`) is capped by it too.
"""

from __future__ import annotations

import collections
import enum
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from earl_stream import metrics as M
from earl_stream.errors import EngineError
from earl_stream.workers.engines.base import EngineCapacity
from earl_stream.workers.engines.kv_store import KVStore
from earl_stream.workers.engines.running import Row
from earl_stream.workers.oom import attempted_bytes, release_cached

_LOG = logging.getLogger(__name__)

_RECORDS = 256  # sheds kept per engine (the oldest are dropped)


class StepPhase(enum.Enum):
    """The forward pass an allocation failed in."""

    PREFILL = "prefill"  # admitting rows (their prefill, or their join into the running batch)
    DECODE = "decode"  # a decode step of the running batch (sampling, retiring, feeding)


class RequestOutOfMemory(EngineError):
    """A request whose step ran out of memory with no other sequence running: the engine cannot serve it
    at all; only that request fails (its episode ends with this reason), the engine goes on."""


@dataclass(frozen=True)
class OomShed:
    """One survived allocation failure: when (unix seconds), in which pass, the sequences the failed step
    ran or admitted together, the concurrency and KV budget (tokens) admission allows after it, the bytes
    the failed allocation asked for (None when the allocator did not say), rows re-queued and failed, and the
    memory the engine's process held when it failed (`memory_in_use`; 0: unknown)."""

    time: float
    phase: StepPhase
    sequences_before: int
    max_sequences_after: int
    kv_budget_tokens_after: int
    bytes_attempted: int | None
    requeued: int
    failed: int
    error: str
    bytes_in_use: int = 0


class Shedder:
    """The engine's ceiling after sheds (None: none yet) and its records."""

    def __init__(self) -> None:
        self.ceiling: EngineCapacity | None = None
        self.records: collections.deque[OomShed] = collections.deque(maxlen=_RECORDS)
        self.total = 0  # sheds since the engine started (records keeps the last _RECORDS)

    def capped(self, plan: EngineCapacity) -> EngineCapacity:
        """The capacity admission uses: the plan's, within the ceiling."""
        if self.ceiling is None:
            return plan
        return EngineCapacity(min(plan.max_concurrent_sequences, self.ceiling.max_concurrent_sequences),
                              min(plan.kv_budget_tokens, self.ceiling.kv_budget_tokens))

    def lower(self, now: EngineCapacity, sequences: int, kv_tokens: int, largest: int) -> EngineCapacity:
        """Halve the concurrency that failed (`sequences` run or admitted together, never below 1) and the KV
        positions it held or planned (`kv_tokens`), never below the `largest` row's own need (prompt + new
        tokens: each row must stay admissible alone). Sets and returns the new ceiling."""
        rows = max(1, min(now.max_concurrent_sequences, sequences // 2))
        budget = max(1, min(now.kv_budget_tokens, max(largest, kv_tokens // 2)))
        self.ceiling = EngineCapacity(rows, budget)
        return self.ceiling

    def record(self, shed: OomShed) -> None:
        self.records.append(shed)
        self.total += 1


def shed_record(phase: StepPhase, sequences: int, after: EngineCapacity, attempted: int | None, requeued: int,
                failed: int, exc: BaseException, in_use: int = 0) -> OomShed:
    return OomShed(time.time(), phase, sequences, after.max_concurrent_sequences, after.kv_budget_tokens, attempted,
                   requeued, failed, f"{type(exc).__name__}: {exc}"[:500], in_use)


def memory_in_use(device: torch.device) -> int:
    """Bytes the engine's process holds on `device` now (0: unknown): on CUDA what the caching allocator reserved
    (tensors and cached blocks: what counts against the device), elsewhere the resident size (VmRSS). Read before
    `release_cached`, it is what was in use when an allocation failed, the failed step's temporaries included."""
    if device.type == "cuda":
        return int(torch.cuda.memory_reserved(device)) if torch.cuda.is_available() else 0
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


class ShedSteps:
    """The shedding of the built-in engine (`torch_engine.TorchEngine` mixes this in): its scheduler state is
    the engine's; when a step failed to allocate, what the failed rows and admission do is this module's."""

    _intake_lock: threading.Lock
    _intake: collections.deque[Row]
    _live_keys: set[str]
    _kv: KVStore
    _device: torch.device
    _shedder: Shedder

    @property
    def capacity(self) -> EngineCapacity:
        raise NotImplementedError

    def _shed(self, rows: list[Row], sequences: int, held: int, phase: StepPhase, exc: BaseException) -> None:
        """An allocation failed in a step that ran or admitted `sequences` rows together (`held`: KV positions
        of a running batch that stays): lower admission and queue `rows` (those not done) first again, with
        their context so far as prompt; a row that failed alone fails (`RequestOutOfMemory`)."""
        in_use = memory_in_use(self._device)
        release_cached(exc, self._device)
        rows = [r for r in rows if not r.done.is_set()]
        tokens = held + sum(len(r.prompt) + r.remaining for r in rows)
        largest = max((len(r.prompt) + r.remaining for r in rows), default=1)
        before = self.capacity
        after = self._shedder.lower(before, sequences, tokens, largest)
        self._kv.set_budget(after.kv_budget_tokens)  # kept caches go first
        M.ROLLOUT_KV_BUDGET_TOKENS.set(after.kv_budget_tokens)
        M.ROLLOUT_OOM_SHED.inc()
        failed = rows if sequences == 1 else []
        for row in failed:
            error = RequestOutOfMemory(f"a request of {len(row.prompt)} context + {row.remaining} new tokens ran out "
                                       f"of memory in a {phase.value} step with no other sequence running: {exc}")
            error.__cause__ = exc
            self._live_keys.discard(row.keep_key or "")
            row.finish(error=error)
        requeued = [] if failed else rows
        for row in requeued:
            row.resume_from_context()  # its kept KV (if any) is dropped: prefilled again with the context
        with self._intake_lock:
            self._intake.extendleft(reversed(requeued))
        self._shedder.record(shed_record(phase, sequences, after, attempted_bytes(exc), len(requeued), len(failed), exc,
                                         in_use))
        _LOG.warning("allocation failed in a %s step of %d sequences (%s): %d re-queued, %d failed; admission lowered "
                     "from %s to %s", phase.value, sequences, exc, len(requeued), len(failed), before, after)
