"""Restarting an external engine (vLLM, SGLang) smaller after it ran out of memory: the pure policy.

Owns: recognising an engine's out-of-memory failure from the text it left (`oom_evidence`: its exception
chain, and for engines whose scheduler runs in a child process, the errors that child logged), the
settings an engine restarts with (`RestartPolicy.next`: the memory knob, and after a failure while
generating the concurrency knob too, lowered by a stated factor down to a floor, for at most
`max_restarts` restarts in the engine's life) and the error that ends it (`EngineOutOfMemory`, naming
the knobs). Starting, stopping and re-issuing requests are the engines' (`vllm_engine`, `sglang_engine`);
what the supervisor learns from a restart is the rollout worker's heartbeat (`oom_sheds`) and the
supervisor's. Settings only go down (no growing back), as the built-in engine's `shedding` ceiling.
"""

from __future__ import annotations

import collections
import enum
import math
from dataclasses import dataclass, replace

from earl_stream.errors import EngineError

# What engines and allocators write when memory ran out (vLLM's KV sizing checks on GPU and CPU, torch's
# allocators). Matched case-sensitively in the text of the failure. Not SGLang's "Not enough memory. Please
# try to increase --mem-fraction-static": its weights fill the static share, which a smaller KV pool
# (what a restart lowers) does not change.
_OOM_MARKERS = (
    "No available memory for the cache blocks",  # vLLM, GPU: nothing left for KV after the profile
    "larger than the available KV cache memory",  # vLLM: one max-length sequence does not fit
    "less than requested memory for kv",  # vLLM, CPU: kv_cache_memory_bytes above the node's free memory
    "is less than desired GPU memory utilization",  # vLLM, GPU: the device is already partly used
    "is less than desired CPU memory utilization",  # vLLM, CPU: gpu_memory_utilization as a share of RAM
    "CUDA out of memory",
    "HIP out of memory",
    "OutOfMemoryError",  # torch.OutOfMemoryError's name in a logged traceback
    "DefaultCPUAllocator: can't allocate memory",
    "DefaultCPUAllocator: not enough memory",
    "MemoryError",
    # vLLM's executor when a worker was SIGKILLed: on Linux that is the kernel's OOM killer unless someone
    # else killed it (a heuristic: the kernel leaves no message in the process)
    "died unexpectedly (exit code: -9)",
)


class OomPhase(enum.Enum):
    """When the engine ran out of memory."""

    START = "start"  # building the engine: weights, profile, KV cache allocation
    GENERATE = "generate"  # serving requests: activations beyond what the start-up sizing left


class EngineOutOfMemory(EngineError):
    """The engine ran out of memory again after its last allowed restart (or at its floor): the message names
    the settings it reached and the knobs that give it room."""


class BatchOutOfMemory(EngineError):
    """The engine ran out of memory with a batch in flight (raised inside an engine, which restarts and re-issues)."""

    def __init__(self, message: str, evidence: str) -> None:
        super().__init__(message)
        self.evidence = evidence


def oom_evidence(*texts: str) -> str | None:
    """The first line of `texts` that says memory ran out (None: no sign of an out-of-memory failure)."""
    for text in texts:
        for line in text.splitlines():
            if any(marker in line for marker in _OOM_MARKERS):
                return line.strip()[:500]
    return None


def exception_text(exc: BaseException) -> str:
    """`exc` and its causes and contexts, one `Type: message` line each (what `oom_evidence` reads)."""
    lines: list[str] = []
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        lines.append(f"{type(current).__name__}: {current}")
        current = current.__cause__ or current.__context__
    return "\n".join(lines)


@dataclass(frozen=True)
class EngineSettings:
    """The start-up knobs a restart lowers: `seqs` of the concurrency knob `seqs_knob` (vLLM `max_num_seqs`,
    SGLang `max_running_requests`) and `memory` of the memory knob `memory_knob` (its own unit: bytes for
    vLLM's `kv_cache_memory_bytes`, GiB for `VLLM_CPU_KVCACHE_SPACE`, a fraction for `gpu_memory_utilization`
    or SGLang's `mem_fraction_static`, tokens for SGLang's `max_total_tokens`)."""

    seqs: int
    memory: float
    seqs_knob: str
    memory_knob: str

    def describe(self) -> str:
        memory = int(self.memory) if float(self.memory).is_integer() else round(self.memory, 4)
        return f"{self.seqs_knob}={self.seqs}, {self.memory_knob}={memory}"


@dataclass(frozen=True)
class RestartPolicy:
    """How far an engine that ran out of memory is lowered per restart.

    A failure at start lowers the memory knob by `factor` (the KV cache did not fit); one while generating
    lowers both knobs by `factor` (activations did not fit beside the KV cache: fewer sequences make them
    smaller, a smaller KV share leaves them room). Neither goes below its floor (`min_seqs`, `min_memory`);
    an integer knob (`integer_memory`) is rounded down. After `max_restarts` restarts, or when nothing can
    be lowered any more, the failure is final (`EngineOutOfMemory`).
    """

    min_memory: float
    factor: float = 0.5
    max_restarts: int = 4
    min_seqs: int = 1
    integer_memory: bool = True

    def __post_init__(self) -> None:
        if not 0.0 < self.factor < 1.0:
            raise EngineError(f"restart factor {self.factor}: must be in (0, 1)")
        if self.max_restarts < 0 or self.min_seqs < 1 or self.min_memory <= 0:
            raise EngineError(f"invalid restart policy {self}: max_restarts >= 0, min_seqs >= 1, min_memory > 0")

    def next(self, now: EngineSettings, phase: OomPhase, restarts: int, engine: str, evidence: str,
             hint: str) -> EngineSettings:
        """The settings of restart number `restarts + 1` after `engine` ran out of memory in `phase` under
        `now` (`evidence`: what said so). Raises `EngineOutOfMemory` (whose message ends with `hint`, the
        user-level knobs) when the limit is reached or both knobs are at their floors."""
        memory = max(self.min_memory, now.memory * self.factor)
        if self.integer_memory:
            memory = float(max(math.ceil(self.min_memory), math.floor(memory)))
        seqs = now.seqs
        if phase is OomPhase.GENERATE:
            seqs = max(self.min_seqs, min(now.seqs, math.floor(now.seqs * self.factor)))
        after = replace(now, seqs=seqs, memory=min(memory, now.memory))
        if restarts >= self.max_restarts or after == now:
            why = (f"after {restarts} restart(s), the limit" if restarts >= self.max_restarts
                   else f"at its floor ({self.floor(now).describe()})")
            raise EngineOutOfMemory(
                f"{engine} ran out of memory ({phase.value}) with {now.describe()}, {why}: {evidence}. "
                f"Give it more memory or start it smaller: {hint}")
        return after

    def floor(self, now: EngineSettings) -> EngineSettings:
        """The lowest settings restarts reach from `now`."""
        return replace(now, seqs=min(now.seqs, self.min_seqs), memory=min(now.memory, self.min_memory))


@dataclass(frozen=True)
class OomRestart:
    """One restart after an out-of-memory failure: when (unix seconds), in which phase, the settings before and
    after, the seconds the restart took (stop + start), the requests re-issued, and what said memory ran out."""

    time: float
    phase: OomPhase
    before: EngineSettings
    after: EngineSettings
    seconds: float
    reissued: int
    evidence: str


class RestartRecord:
    """What an external engine keeps of its out-of-memory restarts, behind the two properties every engine
    reports (`oom_restarts`, `oom_shed_total`). The engine calls `_init_restart_record()` when it is built,
    `_count_restart()` each time it lowers its settings, and `_record_restart()` once the restart is over."""

    RECORDS = 256  # restarts kept per engine (the oldest are dropped)
    _restarts: collections.deque[OomRestart]
    _restart_total: int

    def _init_restart_record(self) -> None:
        self._restarts = collections.deque(maxlen=self.RECORDS)
        self._restart_total = 0

    def _count_restart(self) -> None:
        self._restart_total += 1

    def _record_restart(self, restart: OomRestart) -> None:
        self._restarts.append(restart)

    @property
    def oom_restarts(self) -> tuple[OomRestart, ...]:
        """The restarts after running out of memory, oldest first (the last `RECORDS`)."""
        return tuple(self._restarts)

    @property
    def oom_shed_total(self) -> int:
        """Restarts after running out of memory since the engine was built (heartbeats report it as `oom_sheds`)."""
        return self._restart_total
