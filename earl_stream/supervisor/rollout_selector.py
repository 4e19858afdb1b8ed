"""The rollout side of the parallelism selector: an engine's KV budget, concurrency and episode bound.

Owns `RolloutSelector` (per engine: what its memory leaves after the weights and the engine's transient peak,
in KV tokens of `rollout.dtype`; how many design-length sequences that holds; the engine tensor-parallel size;
the per-engine corrections learnt from the allocation failures the engines shed),
`resize` (the same decision for a new memory figure, e.g. the smallest that the rollout workers
reported), `fused_copy_params` (the extra weights the built-in engine's fused projections hold) and
`largest_trainable_seq_len` (the longest sequence any trainer plan fits: episodes longer than that
are stopped by the workers, `RolloutDecision.max_episode_tokens`). Hysteresis and versions are the
shared `hysteresis.PoolSelector`'s; the byte counts are `memory_model`'s (weights, KV) and `rollout_memory`'s (the
built-in engine's prefill and decode transients). Per device of an engine of tp devices:

    KV capacity (tokens) = (memory - reserve - weights - c x transient peak) / (c x KV bytes per token)

where the transient peak is `rollout_memory.engine_transient` for the design length L and the rows R the engine
runs at once (counted for the built-in engine only: vLLM and SGLang size their own workspace). The transient grows
with R (sampling and logits per row, the prefill's positions up to max_prefill_tokens, or up to one chunk of
rollout.prefill_chunk_tokens), so R is the largest count,
at most rollout.max_batch_size, with R x L x c x KV bytes per token + c x transient(R) within the free memory; the
plan's concurrency is R and its KV budget the formula above at R. c >= 1 is the engine's correction, learnt from
the allocation failures its rollout workers shed (`on_sheds`, from the heartbeats' `oom_sheds` and the latest
shed's bytes), kept per engine tensor-parallel size (`memory_corrections`, persisted with the planner). With the
bytes known (the failed allocation's `attempted` and the process's `in_use` then) the failed state needed
in_use + attempted, of which real = in_use + attempted - reserve - weights for KV and transients, where the plan
let the corrected model fill model = memory - reserve - weights: the model was off by real / model (it
under-predicted: the state fit the plan) or by model / real (the device held less than the budget said), and c
grows by that ratio x1.05 (so the failed state no longer fits), at least x1.05 and at most x1.25^4 per report.
With the bytes unknown (0): x1.25 per shed, at most four steps per report.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path

from earl_stream.config import RunConfig
from earl_stream.errors import ConfigError
from earl_stream.supervisor.decisions import Infeasible, RolloutDecision
from earl_stream.supervisor.hysteresis import MIB, PoolBudget, PoolSelector, Thresholds
from earl_stream.supervisor.memory_model import GIB, ModelShape, predict_kv_cache_bytes, predict_rollout_bytes
from earl_stream.supervisor.rollout_memory import ENGINE_MAX_PREFILL_TOKENS, ENGINE_PREFILL_CHUNK_TOKENS, EngineTransient, engine_transient
from earl_stream.supervisor.selector import OOM_CORRECTION_STEP, TrainerSelector

logger = logging.getLogger(__name__)
_TP_GAIN = 1.1  # a larger rollout engine must hold >= 10% more sequences in all to be chosen
_SEARCH_STEP = 64  # granularity of largest_trainable_seq_len between two powers of two (a multiple of any sp)
_SHED_STEPS = 4  # at most this many correction steps per report of sheds (a burst is one cause, not many)
_SHED_MARGIN = 1.05  # a shed with bytes: the correction that makes the failed state not fit, and this much more
DTYPE_BYTES = {"fp32": 4, "bf16": 2}  # rollout.dtype -> bytes per weight and KV element of the engine


def fused_copy_params(shape: ModelShape) -> int:
    """Parameters the built-in engine's `FastDecoder` holds a second time: per layer, the fused
    q/k/v projection [(H + 2 Hkv) x head_dim, hidden] and gate/up projection [2 x intermediate, hidden]."""
    qkv = (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim * shape.hidden_size
    return shape.num_layers * (qkv + 2 * shape.intermediate_size * shape.hidden_size)


def largest_trainable_seq_len(trainer: TrainerSelector, *, limit: int = 1 << 20) -> int:
    """The longest single sequence (tokens) that some plan of `trainer`'s pool fits, at most `limit`;
    0 if not even `thresholds.min_design_seq_len` fits. Found by doubling from the minimum design
    length, then bisecting in steps of 64 tokens; `trainer.plan_for` decides (no state changes)."""
    def fits(n: int) -> bool:
        return not isinstance(trainer.plan_for(n), Infeasible)

    lo = trainer.thresholds.min_design_seq_len
    if not fits(lo):
        return 0
    while lo < limit and fits(min(2 * lo, limit)):
        lo = min(2 * lo, limit)
    hi = min(2 * lo, limit)  # lo fits; hi does not (or lo == limit)
    while hi - lo > _SEARCH_STEP:
        mid = (lo + hi) // 2 // _SEARCH_STEP * _SEARCH_STEP
        if mid <= lo:
            break
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def rollout_selector_for(cfg: RunConfig, shape: ModelShape, memory_bytes: int, memory_source: str, *,
                         thresholds: Thresholds | None = None, max_episode_tokens: int = 0) -> RolloutSelector:
    """The rollout selector of a run: one engine of `memory_bytes` (less selector.reserve_bytes) in
    rollout.dtype, at most rollout.max_batch_size sequences; the built-in engine's fused copies and transients
    counted."""
    r = cfg.rollout
    torch = r.engine == "torch"
    return RolloutSelector(shape, PoolBudget(1, max(1, memory_bytes), cfg.selector.reserve_bytes),
                           thresholds=thresholds, dtype_bytes=DTYPE_BYTES[r.dtype], max_sequences=r.max_batch_size,
                           allow_tp=False, extra_weight_params=fused_copy_params(shape) if torch else 0,
                           max_episode_tokens=max_episode_tokens, memory_source=memory_source,
                           max_prefill_tokens=ENGINE_MAX_PREFILL_TOKENS if torch else None,
                           prefill_chunk_tokens=r.prefill_chunk_tokens)


def engine_kv_capacity(cfg: RunConfig, model_dir: Path, memory_bytes: int, memory_source: str) -> int:
    """KV tokens an engine of `memory_bytes` holds for the model in `model_dir` (0 when the memory model
    cannot read its config.json); ConfigError, with what the smallest plan needs, when not even one
    sequence of the smallest design length fits (a rollout worker checks this at start)."""
    try:
        shape = ModelShape.from_hf(json.loads((model_dir / "config.json").read_text()))
    except (OSError, ValueError, ConfigError) as exc:
        logger.info("engine memory not checked: the memory model cannot read %s/config.json (%s)", model_dir, exc)
        return 0
    sel = rollout_selector_for(cfg, shape, memory_bytes, memory_source)
    smallest = sel.plan_for(sel.thresholds.min_design_seq_len)
    if isinstance(smallest, Infeasible):
        raise ConfigError(f"rollout engine memory {memory_bytes / MIB:.0f} MiB ({memory_source}, less "
                          f"selector.reserve_bytes) holds no plan: {smallest.message}")
    return sel.kv_capacity_tokens()


class RolloutSelector(PoolSelector[RolloutDecision]):
    """Chooses an engine's concurrent sequences, KV budget and tensor-parallel size from the KV cache
    model: per device, what the budget leaves after the weights holds the KV of the sequences.

    `dtype_bytes`: bytes per weight and KV element of the engine (rollout.dtype: fp32 4, bf16 2).
    `extra_weight_params`: parameters the engine holds beyond the model's (`fused_copy_params` for
    the built-in engine). `max_episode_tokens`: the longest episode the trainer pool can train
    (`largest_trainable_seq_len`; 0 = no bound): a decision's bound is the smaller of that and its
    KV budget (one sequence alone). `memory_source` says where the budget's memory figure came from.
    `max_prefill_tokens`: the built-in engine's bound on one prefill (0: none), whose transients
    (`rollout_memory`) are then counted; None: no transient counted (an engine that sizes its own).
    `prefill_chunk_tokens`: the positions its prefill runs per forward (rollout.prefill_chunk_tokens; 0: whole).
    """

    def __init__(self, shape: ModelShape, budget: PoolBudget, *, thresholds: Thresholds | None = None,
                 pool: str = "rollout", dtype_bytes: int = 2, max_sequences: int = 0, allow_tp: bool = True,
                 extra_weight_params: int = 0, max_episode_tokens: int = 0, memory_source: str = "",
                 max_prefill_tokens: int | None = None,
                 prefill_chunk_tokens: int = ENGINE_PREFILL_CHUNK_TOKENS) -> None:
        super().__init__(budget, thresholds, pool)
        if dtype_bytes < 1 or max_sequences < 0 or extra_weight_params < 0 or max_episode_tokens < 0:
            raise ConfigError(f"dtype_bytes={dtype_bytes} must be >= 1, and max_sequences={max_sequences}, "
                              f"extra_weight_params={extra_weight_params}, max_episode_tokens={max_episode_tokens} >= 0")
        self.shape = shape
        self.dtype_bytes, self.max_sequences, self.allow_tp = dtype_bytes, max_sequences, allow_tp
        self.extra_weight_params, self.max_episode_tokens = extra_weight_params, max_episode_tokens
        self.memory_source = memory_source
        self.max_prefill_tokens, self.prefill_chunk_tokens = max_prefill_tokens, prefill_chunk_tokens
        self.memory_corrections: dict[str, float] = {}  # engine ("tp1") -> factor learnt from the sheds of its workers

    def _admissible(self, decision: RolloutDecision) -> bool:
        again = self._plan(decision.design_seq_len, decision.reason, decision.step)
        return not isinstance(again, Infeasible) and dataclasses.replace(again, version=decision.version) == decision

    def weight_bytes(self, tp: int = 1) -> int:
        """The engine's weights on one device (model + `extra_weight_params`, split by tp)."""
        extra = -(-self.extra_weight_params // tp) * self.dtype_bytes
        return predict_rollout_bytes(self.shape, 0, dtype_bytes=self.dtype_bytes, tp=tp) + extra

    def correction(self, tp: int = 1) -> float:
        """The factor on this engine's transient and KV predictions, learnt from its sheds (1: none yet)."""
        return self.memory_corrections.get(f"tp{tp}", 1.0)

    def _free_and_per_token(self, tp: int) -> tuple[int, int]:
        """Bytes per device left after reserve and weights; corrected KV bytes per token."""
        free = self.budget.memory_bytes_per_device - self.budget.reserve_bytes - self.weight_bytes(tp)
        per_token = predict_kv_cache_bytes(self.shape, 1, dtype_bytes=self.dtype_bytes, tp=tp)
        return free, math.ceil(per_token * self.correction(tp))

    def _transient_for(self, tp: int, design: int, rows: int) -> EngineTransient | None:
        if self.max_prefill_tokens is None:
            return None
        return engine_transient(self.shape, design_seq_len=design, rows=rows, dtype_bytes=self.dtype_bytes,
                                max_prefill_tokens=self.max_prefill_tokens,
                                prefill_chunk_tokens=self.prefill_chunk_tokens, tp=tp)

    def _transient_bytes(self, tp: int, design: int, rows: int) -> int:
        transient = self._transient_for(tp, design, rows)
        return math.ceil(transient.peak_bytes * self.correction(tp)) if transient else 0

    def rows(self, tp: int = 1, design: int = 0) -> int:
        """The most `design`-token sequences (0: the smallest design length) an engine runs at once: their KV and
        the engine's transient peak for that many rows fit the budget (both corrected); at most
        rollout.max_batch_size; 0 when not even one does."""
        design = design or self.thresholds.min_design_seq_len
        free, per_token = self._free_and_per_token(tp)
        hi = free // max(1, per_token * design)
        hi = min(hi, self.max_sequences) if self.max_sequences else hi
        lo = 0
        while lo < hi:  # the transient grows with the rows: the largest count whose KV + transient fit
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if mid * design * per_token + self._transient_bytes(tp, design, mid) <= free else (lo, mid - 1)
        return lo

    def transient(self, tp: int = 1, design: int = 0) -> EngineTransient | None:
        """The engine's transient peak (uncorrected) for `design`-token sequences (0: the smallest design length)
        at the rows it runs at once (`rows`, at least 1); None when this engine's transients are not modelled."""
        design = design or self.thresholds.min_design_seq_len
        return self._transient_for(tp, design, max(1, self.rows(tp, design)))

    def kv_capacity_tokens(self, tp: int = 1, design: int = 0) -> int:
        """Tokens of KV cache one engine of `tp` devices can hold within the budget, after its transient peak for
        `design`-token sequences (0: the smallest design length) at `rows`, corrected by its sheds (0 if none)."""
        design = design or self.thresholds.min_design_seq_len
        free, per_token = self._free_and_per_token(tp)
        return max(0, (free - self._transient_bytes(tp, design, max(1, self.rows(tp, design)))) // per_token)

    def shed_step(self, sheds: int, tp: int = 1, attempted_bytes: int = 0, in_use_bytes: int = 0) -> tuple[float, str]:
        """The factor one report of `sheds` allocation failures multiplies an engine's correction by, and why (the
        module docstring: from the latest shed's bytes when both are known, else x1.25 per shed)."""
        cap = OOM_CORRECTION_STEP ** _SHED_STEPS
        fixed = self.budget.reserve_bytes + self.weight_bytes(tp)
        model, real = self.budget.memory_bytes_per_device - fixed, in_use_bytes + attempted_bytes - fixed
        if attempted_bytes <= 0 or in_use_bytes <= 0 or model <= 0 or real <= 0:
            step = OOM_CORRECTION_STEP ** min(max(1, sheds), _SHED_STEPS)
            return step, f"x{OOM_CORRECTION_STEP} per shed (bytes unknown)"
        ratio = max(real / model, model / real)
        step = min(cap, max(1.0, ratio) * _SHED_MARGIN)
        return step, (f"{attempted_bytes / MIB:.1f} MiB asked with {in_use_bytes / MIB:.1f} MiB in use: KV and "
                      f"transients needed {real / MIB:.1f} MiB where the plan allowed {model / MIB:.1f} MiB, x{step:.3f}")

    def on_sheds(self, sheds: int, worker: str, step: int = 0, *, attempted_bytes: int = 0,
                 in_use_bytes: int = 0) -> RolloutDecision | Infeasible | None:
        """`worker`'s engine shed `sheds` more allocation failures, the latest asking `attempted_bytes` with
        `in_use_bytes` held (0: unknown): the engine's predictions are corrected (`shed_step`) and the current design
        re-planned as the next version (outside the hysteresis); None when there is no decision yet. An Infeasible
        keeps the current decision."""
        tp = self._current.engine_tp if self._current is not None else 1
        key, old = f"tp{tp}", self.correction(tp)
        factor, why = self.shed_step(sheds, tp, attempted_bytes, in_use_bytes)
        self.memory_corrections[key] = old * factor
        logger.warning("%s: %s shed %d allocation failure(s) (%s): engine %s predictions scaled x%.3f (was x%.3f)",
                       self.pool, worker, sheds, why, key, self.memory_corrections[key], old)
        current = self._current
        if current is None:
            return None
        reason = (f"{worker} shed {sheds} allocation failure(s) ({why}): engine memory predictions corrected "
                  f"x{self.memory_corrections[key]:.3f}; design length {current.design_seq_len}")
        last = self._last
        result = self._adopt(self._plan(current.design_seq_len, reason, step), last[0] if last else 0, step)
        if not isinstance(result, Infeasible):
            self._last = last  # a correction is no context decision: hysteresis timing is unchanged
        return result

    def resize(self, budget: PoolBudget, memory_source: str, *, step: int = 0,
               design_seq_len: int = 0) -> RolloutDecision | Infeasible | None:
        """Adopt a new memory figure (e.g. reported by the workers): the decision for the current design
        length (`design_seq_len` if there is no decision yet) on `budget` as the next version; None if
        nothing changes. When nothing fits the new budget the current decision (if any) stays and the
        Infeasible is returned (and logged)."""
        current = self._current
        if budget == self.budget and (current is not None or not design_seq_len):
            return None
        old, self.budget, self.memory_source = self.budget, budget, memory_source
        design = current.design_seq_len if current is not None else design_seq_len
        if not design:
            return None
        reason = (f"engine memory now {budget.memory_bytes_per_device / MIB:.0f} MiB ({memory_source}; was "
                  f"{old.memory_bytes_per_device / MIB:.0f} MiB); design length {design}")
        last = self._last
        result = self._adopt(self._plan(design, reason, step), last[0] if last else 0, step)
        if not isinstance(result, Infeasible):
            self._last = last  # a new memory figure is no context decision: hysteresis timing is unchanged
        return result

    def _plan(self, design: int, reason: str, step: int, floor: int = 0) -> RolloutDecision | Infeasible:
        n = self.budget.devices
        options = []  # (sequences per engine, tp), smallest tp first
        for tp in [1 << i for i in range(n.bit_length()) if n % (1 << i) == 0] if self.allow_tp else [1]:
            seqs = self.rows(tp, design) if self.shape.num_heads % tp == 0 else 0
            if seqs >= 1:
                options.append((seqs, tp))
        if not options:
            return Infeasible(self._infeasible_message(design), self.pool, design, reason, step)
        # A bigger engine pays communication and gives up replicas: take it only for a clear gain
        # in sequences held across all engines.
        most = max(seqs * (n // tp) for seqs, tp in options)
        seqs, tp = next((s, t) for s, t in options if s * (n // t) * _TP_GAIN >= most)
        kv_tokens = self.kv_capacity_tokens(tp, design)
        transient = self.transient(tp, design)
        peak = (self.weight_bytes(tp) + predict_kv_cache_bytes(self.shape, kv_tokens, dtype_bytes=self.dtype_bytes, tp=tp)
                + (transient.peak_bytes if transient else 0))
        bound = min(kv_tokens, self.max_episode_tokens) if self.max_episode_tokens else kv_tokens
        return RolloutDecision(version=self.version + 1, max_concurrent_sequences=seqs, kv_budget_tokens=kv_tokens,
                               design_seq_len=design, reason=reason, engine_tp=tp, replicas=n // tp,
                               predicted_peak_bytes=peak, pool=self.pool, step=step, max_episode_tokens=bound,
                               memory_bytes=self.budget.memory_bytes_per_device,
                               sizing=self._sizing(tp, seqs, kv_tokens, design, bound))

    def _sizing(self, tp: int, seqs: int, kv_tokens: int, design: int, bound: int) -> str:
        """What the decision admits and why, in words (RolloutPlan.sizing)."""
        b, c, transient = self.budget, self.correction(tp), self.transient(tp, design)
        per_token = predict_kv_cache_bytes(self.shape, 1, dtype_bytes=self.dtype_bytes, tp=tp)
        extra = f" - {transient.describe()}" if transient else ""
        corrected = f", both x{c:.3f} after sheds" if c != 1.0 else ""
        capped = " (capped by rollout.max_batch_size)" if self.max_sequences and seqs == self.max_sequences else ""
        why = ("the longest sequence a trainer plan fits" if self.max_episode_tokens and bound == self.max_episode_tokens
               else "one sequence alone in the KV budget")
        return (f"KV budget {kv_tokens} tokens = ({b.memory_bytes_per_device / MIB:.0f} MiB per device "
                f"[{self.memory_source or 'given'}] - {b.reserve_bytes / MIB:.0f} MiB reserve - "
                f"{self.weight_bytes(tp) / MIB:.1f} MiB weights{extra}) / {per_token} bytes per token "
                f"({self.dtype_bytes}-byte elements, tp {tp}{corrected}); {seqs} sequences of the design length "
                f"{design}{capped}, more while contexts are shorter (admission counts each row's KV); episodes stop at "
                f"{bound} tokens ({why})")

    def _infeasible_message(self, design: int) -> str:
        def need(tp: int) -> int:
            return (self.budget.reserve_bytes + self.weight_bytes(tp) + self._transient_bytes(tp, design, 1)
                    + design * self._free_and_per_token(tp)[1])

        fits_tp = [tp for tp in (1 << i for i in range(1, 11))
                   if self.shape.num_heads % tp == 0 and need(tp) <= self.budget.memory_bytes_per_device]
        more = f", or an engine tensor-parallel size of >= {fits_tp[0]} devices" if fits_tp else ""
        return (f"{self.pool}: one {design}-token sequence does not fit an engine of {self.budget.devices} device(s) "
                f"with {self.budget.memory_bytes_per_device / MIB:.1f} MiB each: weights + its KV cache + the "
                f"engine's transients + reserve "
                f"need {need(1) / MIB:.1f} MiB ({need(1) / GIB:.3f} GiB) per device on one device{more}")

