"""Weight swaps of a live rollout engine (`rollout.weight_swap`): when a new policy version is loaded,
and what happens to the rows that are decoding at that moment.

- `drain`: admissions stop until every running row has ended, then the weights load (the batcher's
  `run_exclusive`). The pool idles for the longest reply in flight.
- `interrupt`: running rows stop at the next decode step, the weights load, every row's context (its
  prompt and the tokens it generated so far) is prefilled again under the new weights, and decoding
  goes on (AReaL's interruptible generation).
- `inplace`: the weights load between two decode steps; rows keep their KV cache (computed by the old
  weights) and go on (PipelineRL's in-flight updates). Their KV is not kept for the episode's next turn.

Every token carries the version of the forward whose logits it was sampled from (`GenerateResult.
token_versions`), so the trainer's staleness mask and importance weights see each token's own version.

It owns `SwapMode`, which backends support which mode (`swap_mode_problem`), the engine side of a
staged swap (`WeightSwapper`: the loading thread stages the new state and the thread that drives the
engine applies it at the next step boundary, or the loader applies it itself when no thread drives),
the checks of a state before anything is loaded (`state_problems`), and the worker side (`swap_weights`,
`SwapTally`: the pause and re-prefill figures of each swap, for metrics and status). The built-in
engine's scheduling is `torch_engine`'s. A LoRA version (adapter tensors only) is checked and cast before
the swap and applied unmerged at it (`adapters.LiveAdapters`: a pointer swap, the base untouched); a full
version is copied into the live parameters and drops the adapter.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from earl_stream.errors import EngineError
from earl_stream.model.lora import is_adapter_state

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from earl_stream.workers.engines.adapters import LiveAdapters
    from earl_stream.workers.engines.fast_decoder import FastDecoder
    from earl_stream.workers.engines.kv_store import KVStore
    from earl_stream.workers.engines.running import Row, RunningBatch

_LOG = logging.getLogger(__name__)
_HANDOFF_S = 0.002  # how often a loader whose swap another thread will apply checks whether to apply it itself


class SwapMode(enum.Enum):
    """How a weight load treats the rows decoding at that moment (see the module docstring)."""

    DRAIN = "drain"
    INTERRUPT = "interrupt"
    INPLACE = "inplace"


# Backends that swap only by draining, and why (checked at config load and at engine start).
_DRAIN_ONLY = {
    "vllm": "the installed vLLM (0.32) pauses generation only through its AsyncLLM (pause_generation with "
            "mode 'abort' or 'keep') and the engine core's pause_scheduler; this backend drives vLLM through the "
            "blocking LLM.generate, which returns whole turns, so it can neither stop rows at a decode step nor "
            "tell which of a turn's tokens the old weights sampled (per-token versions would be wrong)",
    "sglang": "the SGLang backend drives the blocking Engine.generate, which returns whole turns: per-token "
              "versions across a swap are not observable",
}


def swap_mode_problem(engine: str, mode: str) -> str | None:
    """Why backend `engine` cannot swap weights by `mode` (None if it can)."""
    if mode == SwapMode.DRAIN.value or engine not in _DRAIN_ONLY:
        return None
    return (f"rollout.weight_swap={mode} is not available with rollout.engine={engine}: {_DRAIN_ONLY[engine]}. "
            f"Use rollout.weight_swap=drain, or rollout.engine=torch (all three modes)")


def state_problems(state: Mapping[str, torch.Tensor], own: Mapping[str, torch.Tensor]) -> list[str]:
    """Every reason `state` cannot be loaded into a model whose state dict is `own` (empty if none):
    unknown or missing names (a missing name is fine when it aliases a provided tensor: tied weights),
    wrong shapes, and non-finite values (a corrupted transfer must not replace working weights)."""
    problems = []
    unknown = sorted(n for n in state if n not in own)
    provided = {own[n].data_ptr() for n in state if n in own}
    missing = sorted(n for n in own if n not in state and own[n].data_ptr() not in provided)
    if unknown:
        problems.append(f"unknown names {unknown[:10]}{' ...' if len(unknown) > 10 else ''}")
    if missing:
        problems.append(f"missing names {missing[:10]}{' ...' if len(missing) > 10 else ''}")
    for name, tensor in state.items():
        if name not in own:
            continue
        if not isinstance(tensor, torch.Tensor):
            problems.append(f"{name} is a {type(tensor).__name__}, not a tensor")
        elif tuple(tensor.shape) != tuple(own[name].shape):
            problems.append(f"{name} has shape {tuple(tensor.shape)}, the model has {tuple(own[name].shape)}")
        elif tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            problems.append(f"{name} holds non-finite values (NaN or inf)")
    return problems


def copy_state(own: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor]) -> None:
    """Copy `state` into the live tensors `own` (names and shapes already checked)."""
    with torch.no_grad():
        for name, tensor in state.items():
            own[name].copy_(tensor)


@dataclass
class Staged:
    """A swap waiting for a step boundary: `done` is set once it was applied (or failed: `error`)."""

    state: Mapping[str, torch.Tensor]
    version: int
    done: threading.Event = field(default_factory=threading.Event)
    error: Exception | None = None
    reprefill_tokens: int = 0  # tokens of running rows' contexts prefilled again (interrupt)
    pause_s: float = 0.0  # how long the engine's step loop was held by the swap (load + re-prefill)


class WeightSwapper:
    """The engine side of interrupt and inplace swaps: one staged swap at a time (see the module docstring)."""

    def __init__(self, mode: SwapMode) -> None:
        self.mode = mode
        self._staged: Staged | None = None
        self._mu = threading.Lock()
        self._loader = threading.Lock()  # one loading thread at a time

    @property
    def pending(self) -> bool:
        """A swap waits to be applied at the next step boundary (read without a lock: a hint)."""
        return self._staged is not None

    def take(self) -> Staged | None:
        with self._mu:
            staged, self._staged = self._staged, None
        return staged

    def run(self, state: Mapping[str, torch.Tensor], version: int, engine_lock: threading.Lock,
            apply: Callable[[], None]) -> Staged:
        """Stage the swap and return once it was applied: by the thread driving the engine at its next
        step, or here (under `engine_lock`) when no thread drives. Raises what the swap raised."""
        with self._loader:
            staged = Staged(state, version)
            with self._mu:
                self._staged = staged
            while not staged.done.is_set():
                if engine_lock.acquire(blocking=False):
                    try:
                        apply()
                    finally:
                        engine_lock.release()
                else:
                    staged.done.wait(_HANDOFF_S)
            if staged.error is not None:
                raise staged.error
            return staged


class SwapSteps:
    """The weight loads of the built-in engine (`torch_engine.TorchEngine` mixes this in): its scheduler
    state is the engine's, the decision of what running rows do is this module's."""

    _lock: threading.Lock
    _intake_lock: threading.Lock
    _intake: collections.deque[Row]
    _batch: RunningBatch | None
    _admitting: bool
    _swapper: WeightSwapper
    _version: int
    _model: PreTrainedModel
    _lora: LiveAdapters
    _fast: FastDecoder | None
    _kv: KVStore
    _counts: dict[str, int]

    def step(self) -> None:
        raise NotImplementedError

    def _admit(self) -> None:
        raise NotImplementedError

    def load_state_dict(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Copy `state` into the live parameters (strict by name and shape, finite values), drop kept caches,
        set the version; a rejected state changes nothing (EngineError). Running rows: see `weight_swap`
        (drain: they finish with the old weights first, no admissions meanwhile). A name missing from
        `state` is accepted only when it aliases a provided tensor (tied weights)."""
        if self._swapper.mode is not SwapMode.DRAIN:
            self.swap_weights(state, version)
            return
        with self._lock:
            state = self._checked(state, version)
            self._admitting = False
            try:
                while self._batch is not None:
                    self.step()
            finally:
                self._admitting = True
            self._load(state, version)

    def set_weight_swap(self, mode: SwapMode | str) -> None:
        """Adopt a weight-swap mode (before the first load; `make_engine` calls it)."""
        self._swapper.mode = SwapMode(mode)

    def swap_weights(self, state: Mapping[str, torch.Tensor], version: int) -> Staged:
        """Load `state` at the next step boundary by this engine's interrupt or inplace mode (without
        waiting for running rows); returns the applied swap (its pause and re-prefilled tokens)."""
        state = self._checked(state, version)
        return self._swapper.run(state, version, self._lock, self._apply_swap)

    def _checked(self, state: Mapping[str, torch.Tensor], version: int) -> Mapping[str, torch.Tensor]:
        if is_adapter_state(state):  # a LoRA version (model.lora): B (A x) added in the forward, the base kept
            return self._lora.checked(state)
        own = self._model.state_dict()
        problems = state_problems(state, own)
        if problems:
            raise EngineError(f"load_state_dict(version={version}) rejected, nothing was loaded (the engine stays "
                              f"on version {self._version}): {'; '.join(problems)}")
        return state

    def _load(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        if is_adapter_state(state):
            self._lora.install(state)
        else:
            copy_state(self._model.state_dict(), state)
            self._lora.clear()
        if self._fast is not None:
            self._fast.refresh()
            self._fast.set_adapters(self._lora.of)
        self._kv.clear()
        self._version = version
        self._counts["swaps"] += 1
        _LOG.info("loaded policy version %d (%d tensors, %s)", version, len(state), self._swapper.mode.value)

    def _apply_swap(self) -> None:
        """Apply the staged swap (engine lock held, at a step boundary). Interrupt: running rows leave the
        batch, queued first with their whole context as prompt, and are prefilled again under the new
        weights before this returns; inplace: they stay, their KV computed by the old weights."""
        staged = self._swapper.take()
        if staged is None:
            return
        start = time.monotonic()
        try:
            batch, reprefill = self._batch, 0
            if batch is not None and self._swapper.mode is SwapMode.INTERRUPT:
                self._batch = None
                reprefill = sum(row.resume_from_context() for row in batch.rows)
                with self._intake_lock:
                    self._intake.extendleft(reversed(batch.rows))
            elif batch is not None:
                for row in batch.rows:
                    row.stale_kv = True
            self._load(staged.state, staged.version)
            if reprefill:
                with torch.inference_mode():
                    self._admit()
        except Exception as exc:  # handed to the loading thread, which raises it
            staged.error = exc
        staged.reprefill_tokens, staged.pause_s = reprefill, time.monotonic() - start
        self._counts["reprefill_tokens"] += reprefill
        staged.done.set()


@dataclass
class SwapTally:
    """A rollout worker's swaps so far, for its metrics and its status (heartbeat stats)."""

    mode: str = SwapMode.DRAIN.value
    swaps: int = 0
    failures: int = 0
    pause_s_total: float = 0.0
    last_pause_s: float = 0.0
    reprefill_tokens_total: int = 0
    last_reprefill_tokens: int = 0

    def stats(self) -> dict[str, float]:
        return {"swaps": self.swaps, "swap_failures": self.failures, "swap_pause_s_total": round(self.pause_s_total, 4),
                "swap_pause_s_last": round(self.last_pause_s, 4), "swap_reprefill_tokens_total": self.reprefill_tokens_total,
                "swap_reprefill_tokens_last": self.last_reprefill_tokens}


async def swap_weights(batcher: Any, engine: Any, state: Mapping[str, torch.Tensor], version: int,
                       mode: SwapMode, tally: SwapTally) -> None:
    """Load `state` as `version` into `engine` (shared through `batcher`) by `mode`, and count it in `tally`.

    The pause of a drain is the time admissions were stopped: from the request until every running
    row ended and the weights loaded. Interrupt and inplace pause only while the engine's step loop is
    held (the load and, for interrupt, the re-prefill of the running rows). A failed load (bad names or
    shapes, non-finite values) raises EngineError; the engine then still runs the old version."""
    start = time.monotonic()
    try:
        if mode is SwapMode.DRAIN:
            await batcher.run_exclusive(lambda: engine.load_state_dict(state, version))
            pause, reprefill = time.monotonic() - start, 0
        else:
            staged = await asyncio.to_thread(engine.swap_weights, state, version)
            pause, reprefill = staged.pause_s, staged.reprefill_tokens
    except EngineError:
        tally.failures += 1
        raise
    tally.swaps += 1
    tally.pause_s_total += pause
    tally.last_pause_s = pause
    tally.reprefill_tokens_total += reprefill
    tally.last_reprefill_tokens = reprefill
