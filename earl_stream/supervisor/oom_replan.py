"""The supervisor's answer to a trainer step that failed to allocate (`protocol.TrainerOom`).

Owns the evidence record (`OomRecovery`: when, the step, the plan before and after, the bytes) and
`replan_after_oom`: the failed plan's largest micro-batch, as the memory model predicted it, tells the
trainer selector by how much that layout's predictions fell short: from now on no more than half of it fits
(`TrainerSelector.correct_memory`, per layout, never a global factor; halved again at each failure, the way
a batch size backs off), and the selector re-plans for the step's longest row under the corrected
predictions: a smaller micro-batch budget, recomputation or more sharding. The step's claim keeps its rows;
the trainer's next `Claimed` for it carries the new plan. The planner keeps the records (status "plans" ->
"oom_recoveries", the run summary) and the corrections (persisted with its state).
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

import msgspec

from earl_stream import metrics as M
from earl_stream.protocol import TrainerOom, TrainerPlan
from earl_stream.supervisor.memory_model import predict_train_memory
from earl_stream.supervisor.selector import Infeasible, layout_name

if TYPE_CHECKING:
    from earl_stream.supervisor.planning import Planner

_TIGHTENINGS = 4  # corrections tried per failure before giving up on a plan that differs from the failed one


class OomRecovery(msgspec.Struct, frozen=True):
    """One allocation failure of the trainer pool and the plan it was answered with ("" = none fitted)."""

    at: float  # unix seconds
    step: int
    plan_before: str
    version_before: int
    plan_after: str
    version_after: int
    micro_batch_tokens_before: int
    micro_batch_tokens_after: int
    predicted_bytes: int  # the memory model's prediction for the failed plan's largest micro-batch
    attempted_bytes: int  # what the failed allocation asked for (0: not said)
    peak_bytes: int  # the fullest rank's peak before the failure (0: unknown)
    correction: float  # the failed layout's factor on its predictions afterwards
    rows: int
    tokens: int
    longest: int
    error: str = ""


def replan_after_oom(planner: Planner, msg: TrainerOom, lengths: list[int]) -> tuple[TrainerPlan | None, str]:
    """The plan to retry `msg.step` (claimed rows of `lengths` tokens) under, or None and why not."""
    decision, before = planner.trainer_plan, planner.trainer_wire
    if planner.trainer is None or decision is None or before is None:
        return None, "the selector is off: no memory model to correct, no other plan to retry under"
    if decision.version != msg.plan_version:  # re-planned since the step was claimed: retry under the current plan
        return before, f"plan v{msg.plan_version} is no longer current; retry under v{before.version}"
    lengths = lengths or [max(1, msg.longest)]
    biggest = max(planner.micro_batches(lengths), key=lambda mb: predict_train_memory(planner.shape, mb).total_bytes)
    failed = predict_train_memory(planner.shape, biggest).total_bytes
    longest = max(lengths)
    # what may still fit: half the micro-batch that failed (as one packed sequence; halved again at each failure)
    half = dataclasses.replace(biggest, micro_batch=1, seq_len=max(1, biggest.micro_batch * biggest.seq_len // 2))
    fits = min(failed - 1, predict_train_memory(planner.shape, half).total_bytes)
    name = layout_name(decision.plan)
    reason = (f"step {msg.step} failed to allocate under v{before.version} ({before.name}, micro-batch "
              f"{before.micro_batch_tokens} tokens, {msg.attempted_bytes} bytes asked)")
    factor, result = 1.0, None
    for _ in range(_TIGHTENINGS):
        factor = planner.trainer.correct_memory(decision.plan, fits)
        M.SELECTOR_MEMORY_CORRECTION.labels(name).set(factor)
        result = planner.trainer.replan_after_oom(longest, msg.step, reason)
        if isinstance(result, Infeasible) or (layout_name(result.plan), result.micro_batch_tokens) != (
                name, decision.micro_batch_tokens):
            break
    assert result is not None
    after = None if isinstance(result, Infeasible) else result
    if after is not None:
        planner.adopt(after)
    wire = planner.trainer_wire if after is not None else None
    planner.oom_recoveries.append(OomRecovery(  # plans named with "+rc" under full recomputation
        at=time.time(), step=msg.step, plan_before=name, version_before=before.version,
        plan_after=layout_name(after.plan) if after else "", version_after=wire.version if wire else 0,
        micro_batch_tokens_before=before.micro_batch_tokens, micro_batch_tokens_after=wire.micro_batch_tokens if wire else 0,
        predicted_bytes=failed, attempted_bytes=msg.attempted_bytes, peak_bytes=msg.peak_bytes, correction=factor,
        rows=msg.rows, tokens=msg.tokens, longest=longest, error=msg.error[:300]))
    if wire is None:
        assert isinstance(result, Infeasible)
        return None, f"no plan fits step {msg.step}'s longest row ({longest} tokens) after the correction: {result.message}"
    return wire, f"retry under v{wire.version} ({wire.name}, micro-batch {wire.micro_batch_tokens} tokens)"
