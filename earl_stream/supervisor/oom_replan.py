"""The supervisor's answer to a trainer step that failed to allocate (`protocol.TrainerOom`).

Owns the evidence record (`OomRecovery`: when, the step, the plan before and after, the bytes, the rows
refused) and `replan_after_oom`: the failed plan's largest micro-batch, as the memory model predicted it,
tells the trainer selector by how much that layout's predictions fell short: from now on no more than half
of it fits (`TrainerSelector.correct_memory`, per layout, never a global factor; halved again at each
failure, the way a batch size backs off), and the selector re-plans for the step's longest row under the
corrected predictions: a smaller micro-batch budget, recomputation or more sharding. The step's claim keeps
its rows; the trainer's next `Claimed` for it carries the new plan.

When no plan the corrected model trusts holds the step's longest row, the longest rows are refused: the
answer (`OomAnswer.refuse_longer_than`) keeps the rows up to the longest length some plan still holds,
re-planned for that length, and the caller (`Supervisor._on_traineroom`) takes the longer ones out of the
claim for good (`Ledger.refuse_longer`: `samples_too_long`, never trained). When not even the shortest row
fits, every row of the step is refused and the step is claimed afresh. The planner keeps the records
(status "plans" -> "oom_recoveries", the run summary) and the corrections (persisted with its state).
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

import msgspec

from earl_stream import metrics as M
from earl_stream.protocol import TrainerOom, TrainerPlan
from earl_stream.supervisor.fitting import check_fit
from earl_stream.supervisor.memory_model import predict_train_memory
from earl_stream.supervisor.selector import Infeasible, PlanDecision, TrainerSelector, layout_name, micro_batch_tokens

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
    refused_rows: int = 0  # rows of the step no plan holds after the correction: refused as samples_too_long
    refused_tokens: int = 0  # their tokens
    refused_reason: str = ""  # why (the shortest refused row's length, the closest plan, its bytes vs the budget)


@dataclasses.dataclass(frozen=True)
class OomAnswer:
    """What the supervisor answers a `TrainerOom` with. `plan`: the plan to retry the step under (None: no
    memory model to re-plan with; the trainer then fails as without recovery). `refuse_longer_than`: the
    step's rows longer than this many tokens are refused for good (None: none; 0: every row)."""

    plan: TrainerPlan | None
    message: str
    refuse_longer_than: int | None = None
    refused_reason: str = ""


def replan_after_oom(planner: Planner, msg: TrainerOom, lengths: list[int]) -> OomAnswer:
    """The plan to retry `msg.step` (claimed rows of `lengths` tokens) under, and the rows to refuse."""
    decision, before = planner.trainer_plan, planner.trainer_wire
    if planner.trainer is None or decision is None or before is None:
        return OomAnswer(None, "the selector is off: no memory model to correct, no other plan to retry under")
    if decision.version != msg.plan_version:  # re-planned since the step was claimed: retry under the current plan
        return OomAnswer(before, f"plan v{msg.plan_version} is no longer current; retry under v{before.version}")
    if not lengths:  # a repeat of a report whose answer refused every row: the step is claimed afresh
        return OomAnswer(before, f"step {msg.step} holds no row any more; claim it again under v{before.version}")
    biggest = max(planner.micro_batches(lengths), key=lambda mb: predict_train_memory(planner.shape, mb).total_bytes)
    failed = predict_train_memory(planner.shape, biggest).total_bytes
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
        result = planner.trainer.replan_after_oom(max(lengths), msg.step, reason)
        if isinstance(result, Infeasible) or (layout_name(result.plan), result.micro_batch_tokens) != (
                name, decision.micro_batch_tokens):
            break
    assert result is not None
    keep, why_refused = max(lengths), ""
    if isinstance(result, Infeasible):  # no plan holds the longest row: refuse the longest rows, keep the rest
        keep, result = _longest_held(planner.trainer, lengths, msg.step, reason)
        why_refused = _why_refused(planner.trainer, lengths, keep)
    after = None if isinstance(result, Infeasible) else result
    if after is not None:
        planner.adopt(after)
    wire = planner.trainer_wire if after is not None else None
    refused = [n for n in lengths if n > keep]
    planner.oom_recoveries.append(OomRecovery(  # plans named with "+rc" under full recomputation
        at=time.time(), step=msg.step, plan_before=name, version_before=before.version,
        plan_after=layout_name(after.plan) if after else "", version_after=wire.version if wire else 0,
        micro_batch_tokens_before=before.micro_batch_tokens, micro_batch_tokens_after=wire.micro_batch_tokens if wire else 0,
        predicted_bytes=failed, attempted_bytes=msg.attempted_bytes, peak_bytes=msg.peak_bytes, correction=factor,
        rows=msg.rows, tokens=msg.tokens, longest=max(lengths), error=msg.error[:300], refused_rows=len(refused),
        refused_tokens=sum(refused), refused_reason=why_refused))
    if not refused:
        assert wire is not None
        return OomAnswer(wire, f"retry under v{wire.version} ({wire.name}, micro-batch {wire.micro_batch_tokens} tokens)")
    if wire is None:  # not even the shortest row fits: all refused; the pool keeps its plan for the next claim
        return OomAnswer(before, f"every row of step {msg.step} refused, claim it afresh under v{before.version}: "
                                 f"{why_refused}", refuse_longer_than=0, refused_reason=why_refused)
    return OomAnswer(wire, f"{why_refused}; the other {len(lengths) - len(refused)} row(s) retry under v{wire.version} "
                           f"({wire.name}, micro-batch {wire.micro_batch_tokens} tokens)",
                     refuse_longer_than=keep, refused_reason=why_refused)


def _longest_held(trainer: TrainerSelector, lengths: list[int], step: int,
                  reason: str) -> tuple[int, PlanDecision | Infeasible]:
    """The longest of `lengths` a plan holds under the corrected model, and that plan (adopted by the
    selector), dropping the longest rows first; (0, Infeasible) when not even the shortest fits.

    `plan_for` (no state change) bisects the distinct lengths, fits being monotone in the length; the
    selector's own `replan_after_oom` then confirms, a length lower at a time where it disagrees."""
    candidates = sorted(set(lengths))
    lo, hi = 0, len(candidates)  # candidates[:lo] fit as far as the probe knows, candidates[hi:] do not
    while lo < hi:
        mid = (lo + hi) // 2
        if isinstance(trainer.plan_for(candidates[mid], step=step), Infeasible):
            hi = mid
        else:
            lo = mid + 1
    result: PlanDecision | Infeasible = Infeasible(f"no plan holds {candidates[0]} tokens", trainer.pool,
                                                   candidates[0], reason, step)
    for n in reversed(candidates[:lo]):
        result = trainer.replan_after_oom(n, step, f"{reason}; rows longer than {n} tokens refused")
        if not isinstance(result, Infeasible):
            return n, result
    return 0, result


def _why_refused(trainer: TrainerSelector, lengths: list[int], keep: int) -> str:
    """Why the rows longer than `keep` tokens are refused: the shortest of them, the layout closest to
    holding it and that layout's predicted bytes per device against its budget after the correction."""
    refused = [n for n in lengths if n > keep]
    shortest = min(refused)
    layouts, cannot = trainer.layout_options(shortest)  # (the status' refusals stay the current plan's)
    fits = [check_fit(trainer.shape, dataclasses.replace(layout, micro_batch=1, seq_len=shortest),
                      trainer.budget_of(layout).memory_bytes_per_device,
                      reserve_bytes=trainer.budget_of(layout).reserve_bytes)
            for layout in layouts]
    head = (f"{len(refused)} row(s) of {shortest}-{max(refused)} tokens refused as samples_too_long: no plan holds "
            f"{shortest} tokens after the correction")
    if not fits:
        return f"{head} (no layout can take it: {'; '.join(f'{r.plan}: {r.reason}' for r in cannot)})"
    best = max(fits, key=lambda f: f.headroom_bytes)
    name, usable = layout_name(best.plan), best.budget_bytes - best.reserve_bytes
    held = micro_batch_tokens(trainer.shape, best.plan, trainer.budget_of(best.plan), max_tokens=max(refused))
    return (f"{head}: the closest, {name}, predicts {best.breakdown.total_bytes} bytes per device for one sequence "
            f"of it against {usable} usable (its predictions corrected x{trainer.memory_corrections.get(name, 1.0):.3f}"
            f"), one micro-batch of at most {held} tokens")
