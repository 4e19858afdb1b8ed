"""The parallelism selector: when a pool re-plans, and which plan it adopts.

Owns: the versioned decisions it makes (`decisions`: `PlanDecision`, `RolloutDecision`, `Infeasible`,
`Refusal`, re-exported here), the micro-batch token budget of a plan (`micro_batch_tokens`) and the trainer's
selector (`TrainerSelector`; the rollout engine's is `rollout_selector.RolloutSelector`). What both share, a
pool's memory budget (`PoolBudget`), the re-plan thresholds (`Thresholds`) and their hysteresis
(`PoolSelector`), is `hysteresis`'s, re-exported here. Which layouts a pool can run (and which it refuses) is
`layouts`' answer, what a plan costs in memory `memory_model`'s, how fast it runs `cost_model`'s; the
statistics come from `context_stats`; applying a plan is the pools' job.

A model shape with quirks the memory model does not interpret (`ModelShape.calibrate`) is logged at
start and its predictions scaled once by the first measured step (`TrainerSelector.calibrate_memory`).
An allocation failure of the trainer (`TrainerSelector.correct_memory`) scales the predictions of the
failing layout alone (by name: `dp1`, `fsdp2+rc`, ...) so that no more than half the micro-batch that failed fits;
`replan_after_oom` then picks, outside the thresholds' hysteresis, the plan the corrected model says holds
the step's longest row.

The reserve a layout's fit checks keep free is learnt from the pool's measured step peaks
(`TrainerSelector.observe_peak`, `memory_reserve.LearntReserve`: `selector.reserve_bytes` plus the largest
excess of the layout's recent peaks over their predictions). When it grows so that the current plan's
micro-batch no longer fits, the next `decide` re-plans at once, as when contexts pass the design length
(waiting would run steps the model now says do not fit); the design length stays (only the thresholds
move it, so the reserve adds no band of its own), and a reserve that shrinks again never re-plans by itself.

Everything is pure and deterministic: the same snapshots and steps give the same decisions.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence

from earl_stream.errors import ConfigError
from earl_stream.protocol import plan_name
from earl_stream.supervisor.cost_model import RankedPlan, StepCostModel, rank_plans
from earl_stream.supervisor.decisions import Infeasible, PlanDecision, Refusal, RolloutDecision
from earl_stream.supervisor.fitting import advise, check_fit
from earl_stream.supervisor.hysteresis import DESIGN_QUANTUM, MIB, PoolBudget, PoolSelector, Thresholds
from earl_stream.supervisor.layouts import pool_layouts
from earl_stream.supervisor.memory_model import ModelShape, Recompute, TrainPlan, predict_train_memory
from earl_stream.supervisor.memory_reserve import LearntReserve
from earl_stream.supervisor.switch_memory import switch_refusal

__all__ = ["MIB", "OOM_CORRECTION_STEP", "Infeasible", "PlanDecision", "PoolBudget", "PoolSelector", "Refusal",
           "RolloutDecision", "Thresholds", "TrainerSelector", "layout_name", "micro_batch_tokens"]
logger = logging.getLogger(__name__)
OOM_CORRECTION_STEP = 1.25  # a layout's correction grows at least this much with each of its allocation failures


def micro_batch_tokens(shape: ModelShape, plan: TrainPlan, budget: PoolBudget, *, max_tokens: int = 1 << 16) -> int:
    """The largest token budget of one micro-batch under `plan`'s layout that fits `budget`.

    Binary search over `predict_train_memory` with micro_batch=1 and seq_len=tokens (one packed
    sequence: the most memory any micro-batch of that many tokens, padding included, can take).
    Multiples of plan.sp only (Ulysses splits the sequence); 0 if not even plan.sp tokens fit;
    capped at `max_tokens`.
    """
    q = plan.sp

    def fits(k: int) -> bool:
        trial = dataclasses.replace(plan, micro_batch=1, seq_len=k * q)
        return check_fit(shape, trial, budget.memory_bytes_per_device, reserve_bytes=budget.reserve_bytes).fits

    lo, hi = 0, max_tokens // q  # invariant: lo fits (or is 0), everything above hi is out of range
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo * q


def layout_name(plan: TrainPlan) -> str:
    """A memory-model plan as `selector.plans` names it: the trainer plan's name (`dp2`, `fsdp2`, `tp2`,
    `fsdp2_sp2`, `ep2`, `fsdp2_ep2`, ...), with `+rc` under full recomputation."""
    data = plan.dp // plan.ep  # ep ranks are data ranks: dp (or fsdp) names the rest
    name = plan_name(1 if plan.fsdp else data, data if plan.fsdp else 1, plan.tp, plan.sp, plan.ep)
    return name + ("+rc" if plan.recompute is Recompute.FULL else "")


class TrainerSelector(PoolSelector[PlanDecision]):
    """Chooses dp/tp/sp, FSDP, recomputation and the micro-batch token budget of a trainer pool.

    Layouts are `layouts.pool_layouts`'s (tp x sp x dp, with and without FSDP over dp >= 2 data
    ranks, and with `allow_ep` the expert-parallel degrees of a mixture-of-experts model); the tp x sp
    sizes (and ep degrees) the model or the pool cannot take are refused: `refused` lists them with
    the reason (status shows it), and each is logged once.

    `base` supplies what the selector does not choose (attention kind, precision, logit copies,
    vocab-parallel logits, Megatron sequence parallelism when tp > 1, the optimizer's foreach mode).
    `step_sequences` (episodes per training step) spreads the states sync of a plan over the
    micro-batches of a step, counted as if every episode had the design length.
    `pad_aware`: also rank micro-batch budgets of 1, 2, 4, ... design-length rows below the largest
    that fits, counting a micro-batch of several rows at its expected fill (rows are padded to the
    longest: p50 / p99 of the latest statistics, `prior_fill` before any), so that the cost model
    (with its calibrated fixed cost per micro-batch) weighs padding against per-pass overhead.
    Without it, every plan uses the largest budget that fits.
    A plan whose switch from the plan the pool runs (`running`, else the current decision; before any,
    the start-up layout: replicated, optimizer without state) would not fit the budget is refused
    too (`switch_memory.switch_refusal`, parameters and AdamW state moved shard to shard in
    `reshard_bucket_bytes` buckets), with its reason in `refused` and the log.
    `dynamic_sp_tokens` (trainer.dynamic_sp_tokens; the planner offers dp/FSDP layouts only then): rows longer
    than it run shared over the data ranks at sp = dp (`workers.dynamic_sp`), so a layout holds a design length
    that one rank cannot when the row fits split that way and every row up to the threshold fits one rank; the
    decision's predicted peak is then the larger of its micro-batch budget's and the shared row's. The cost of a
    shared row is counted as the layout's (its all-to-alls are not modelled).
    """

    def __init__(self, shape: ModelShape, budget: PoolBudget, *, base: TrainPlan, thresholds: Thresholds | None = None,
                 cost_model: StepCostModel | None = None, pool: str = "trainer",
                 recomputes: Sequence[Recompute] = (Recompute.NONE, Recompute.FULL), allow_tp: bool = True,
                 allow_sp: bool = True, allow_fsdp: bool = True, allow_ep: bool = False,
                 max_micro_batch_tokens: int = 1 << 16,
                 step_sequences: int = 1, pad_aware: bool = False, prior_fill: float = 0.75,
                 reshard_bucket_bytes: int = 64 * MIB, only: Sequence[str] = (), model_scale: float = 1.0,
                 dynamic_sp_tokens: int = 0) -> None:
        if not 0 < model_scale <= 1e3:
            raise ConfigError(f"selector.memory_model_scale={model_scale} must be within (0, 1000]")
        if model_scale != 1.0:  # a debugging knob: the fit checks see every prediction x model_scale
            usable = max(1, int((budget.memory_bytes_per_device - budget.reserve_bytes) / model_scale))
            budget = dataclasses.replace(budget, memory_bytes_per_device=budget.reserve_bytes + usable)
            logger.warning("%s: selector.memory_model_scale=%g: every memory prediction is scaled x%g (a deliberately "
                           "wrong memory model, for tests and benchmarks of allocation failures)", pool, model_scale,
                           model_scale)
        super().__init__(budget, thresholds, pool)
        self.model_scale = model_scale
        if Recompute.SELECTIVE in recomputes or not recomputes:
            raise ConfigError(f"recomputes={[r.value for r in recomputes]}: choose from none/full (selective "
                              "recomputation of the attention core cannot run on Hugging Face models)")
        if max_micro_batch_tokens < 1 or step_sequences < 1:
            raise ConfigError(f"max_micro_batch_tokens={max_micro_batch_tokens} and step_sequences={step_sequences} "
                              "must be >= 1")
        self.shape, self.base = shape, base
        self.cost_model = cost_model or StepCostModel()
        self.recomputes = tuple(recomputes)
        self.allow_tp, self.allow_sp, self.allow_fsdp, self.allow_ep = allow_tp, allow_sp, allow_fsdp, allow_ep
        self.max_micro_batch_tokens, self.step_sequences = max_micro_batch_tokens, step_sequences
        if not 0 < prior_fill <= 1:
            raise ConfigError(f"prior_fill={prior_fill} must be within (0, 1]")
        self.pad_aware, self.prior_fill = pad_aware, prior_fill
        self.refused: list[Refusal] = []
        self._logged: set[Refusal] = set()
        self.reshard_bucket_bytes = reshard_bucket_bytes
        self.dynamic_sp_tokens = dynamic_sp_tokens  # rows past it run shared, at sp = the data ranks (0: off)
        self.only = frozenset(only)  # layout names (`layout_name`) the pool may run; empty = all
        self.running: TrainPlan | None = None  # the layout the pool holds now, when the planner knows it
        self.memory_scale = 1.0  # measured / predicted peak of the first measured step (shapes with quirks)
        self.memory_corrections: dict[str, float] = {}  # layout name -> factor on its predictions, from allocation failures
        self.reserves = LearntReserve(budget.reserve_bytes)  # layout name -> bytes kept free, from measured peaks
        if shape.calibrate:
            logger.warning("%s: memory prediction for %s will be calibrated from the first measured step (the memory "
                           "model does not interpret: %s)", self.pool, shape.model_type or "this model",
                           "; ".join(shape.quirks))

    def calibrate_memory(self, predicted_bytes: int, measured_bytes: int) -> float:
        """Scale every later memory prediction by the first measured step's `measured_bytes` / `predicted_bytes`
        (never below 1: a model that measured less keeps its prediction's margin) by shrinking the budget
        the fit checks see by that factor. Once; returns the scale in force."""
        if self.memory_scale != 1.0 or predicted_bytes < 1 or measured_bytes < 1:
            return self.memory_scale
        self.memory_scale = max(1.0, measured_bytes / (predicted_bytes * self.model_scale))
        b = self.budget
        usable = max(1, int((b.memory_bytes_per_device - b.reserve_bytes) / self.memory_scale))
        self.budget = dataclasses.replace(b, memory_bytes_per_device=b.reserve_bytes + usable)
        logger.info("%s: memory prediction calibrated: measured %d bytes, predicted %d: later predictions x%.3f",
                    self.pool, measured_bytes, predicted_bytes, self.memory_scale)
        return self.memory_scale

    def correct_memory(self, plan: TrainPlan, fits_bytes: int) -> float:
        """A step under `plan`'s layout failed to allocate: from now on that layout's predictions (no other's)
        are scaled so that at most `fits_bytes` of prediction fit the budget (the caller's choice: the model's
        prediction for half the micro-batch that failed), and at least 1.25 x by the layout's previous
        factor (a second failure always tightens). Returns the factor."""
        name = layout_name(plan)
        usable = self.budget.memory_bytes_per_device - self.budget.reserve_bytes
        old = self.memory_corrections.get(name, 1.0)
        factor = max(old * OOM_CORRECTION_STEP, usable / max(1, fits_bytes))
        self.memory_corrections[name] = factor
        logger.warning("%s: layout %s failed to allocate: its predictions are scaled x%.3f from now on (%d of %d "
                       "bytes predicted fit)", self.pool, name, factor, fits_bytes, usable)
        return factor

    def observe_peak(self, layout: TrainPlan, predicted_bytes: int, measured_bytes: int) -> int:
        """A step under `layout` peaked at `measured_bytes` on its fullest rank where the memory model predicted
        `predicted_bytes` for its largest micro-batch: the layout's reserve learns the excess over the prediction
        as its fit checks see it (calibration and allocation-failure factors applied). Returns the reserve."""
        name = layout_name(layout)
        factor = self.model_scale * self.memory_scale * max(1.0, self.memory_corrections.get(name, 1.0))
        reserve = self.reserves.observe(name, math.ceil(predicted_bytes * factor), measured_bytes)
        if reserve > self.budget.reserve_bytes:
            logger.info("%s: layout %s peaked at %d bytes, %d predicted: its reserve is %d bytes", self.pool, name,
                        measured_bytes, math.ceil(predicted_bytes * factor), reserve)
        return reserve

    def observe_image_share(self, share: float) -> None:
        """The image tokens' share of the episodes' tokens (a vision-language model; the supervisor's window): plans
        from now on count the tower's activations for it, and the plan in force is re-made if its micro-batch no
        longer fits with them (`_unfit`). Changes under 0.01 are ignored (no churn)."""
        share = min(1.0, max(0.0, share))
        if abs(share - self.base.image_share) < 0.01:
            return
        logger.info("%s: image tokens are %.0f%% of the episodes' tokens (was %.0f%%)", self.pool, 100 * share,
                    100 * self.base.image_share)
        self.base = dataclasses.replace(self.base, image_share=share)

    def budget_of(self, layout: TrainPlan) -> PoolBudget:
        """The budget `layout`'s fit checks see: the pool's, with the layout's learnt reserve, shrunk by the
        layout's correction (if any)."""
        name, b = layout_name(layout), self.budget
        factor, reserve = max(1.0, self.memory_corrections.get(name, 1.0)), self.reserves.bytes(name)
        if factor == 1.0 and reserve == b.reserve_bytes:
            return b
        # the learnt part is in real bytes; the pool's budget is already divided by the calibration scale (and
        # the debugging knob's)
        extra = (reserve - b.reserve_bytes) / (self.memory_scale * self.model_scale)
        usable = max(1, int((b.memory_bytes_per_device - b.reserve_bytes - extra) / factor))
        return dataclasses.replace(b, memory_bytes_per_device=reserve + usable, reserve_bytes=reserve)

    def _unfit(self) -> str | None:
        """Why the current plan's micro-batch no longer fits its layout's budget (its reserve grew, or a
        calibration or correction shrank the budget since the plan was made); None while it fits."""
        current = self._current
        if current is None:
            return None
        bound = dataclasses.replace(current.plan, micro_batch=1, seq_len=current.micro_batch_tokens,
                                    image_share=self.base.image_share)
        budget = self.budget_of(current.plan)
        fit = check_fit(self.shape, bound, budget.memory_bytes_per_device, reserve_bytes=budget.reserve_bytes)
        if fit.fits:
            return None
        images = (f" and image tokens {100 * self.base.image_share:.0f}% of it"
                  if self.base.image_share != current.plan.image_share else "")
        return (f"{layout_name(current.plan)}'s micro-batch of {current.micro_batch_tokens} tokens{images} no longer "
                f"fits with its learnt reserve of {budget.reserve_bytes / MIB:.0f} MiB "
                f"({-fit.headroom_bytes / MIB:.0f} MiB short)")

    def replan_after_oom(self, longest: int, step: int, reason: str) -> PlanDecision | Infeasible:
        """A plan, as the next version and outside the thresholds' hysteresis, for a step whose longest row has
        `longest` tokens, under the corrected predictions (call `correct_memory` first)."""
        design = max(self._current.design_seq_len if self._current else 0, longest, 1)
        result = self._plan(design, reason, step, floor=max(1, longest))
        return self._adopt(result, self._snapshot.total if self._snapshot else 0, step)

    def layout_options(self, design_seq_len: int) -> tuple[list[TrainPlan], list[Refusal]]:
        """Every layout variant on exactly `budget.devices` devices for one `design_seq_len` sequence that
        the model and the pool can take, and the refusals of those they cannot (no state changes)."""
        out, refused = pool_layouts(self.shape, self.base, self.budget.devices, design_seq_len,
                                    recomputes=self.recomputes, allow_tp=self.allow_tp, allow_sp=self.allow_sp,
                                    allow_fsdp=self.allow_fsdp, allow_ep=self.allow_ep)
        if self.only:
            refused += [Refusal(layout_name(p), "not among selector.plans") for p in out
                        if layout_name(p) not in self.only]
            out = [p for p in out if layout_name(p) in self.only]
        return out, refused

    def layouts(self, design_seq_len: int) -> list[TrainPlan]:
        """`layout_options`' layouts; sets `refused` (the status') to its refusals, each logged once."""
        out, refused = self.layout_options(design_seq_len)
        for r in refused:
            if r not in self._logged:
                self._logged.add(r)
                logger.info("%s: layout %s refused: %s", self.pool, r.plan, r.reason)
        self.refused = refused
        return out

    def _admissible(self, decision: PlanDecision) -> bool:
        plan, design = decision.plan, decision.design_seq_len
        bound = dataclasses.replace(plan, micro_batch=1, seq_len=decision.micro_batch_tokens)
        budget = self.budget_of(plan)
        return (dataclasses.replace(plan, micro_batch=1, seq_len=design) in self.layouts(design)
                and check_fit(self.shape, bound, budget.memory_bytes_per_device, reserve_bytes=budget.reserve_bytes).fits)

    def _plan(self, design: int, reason: str, step: int, floor: int = 0) -> PlanDecision | Infeasible:
        cap = max(self.max_micro_batch_tokens, design)
        floor = min(floor or design, design)
        ranked: list[tuple[RankedPlan, int, int, float]] = []  # + micro-batch token budget, design length, score
        for layout in self.layouts(design):
            budget = self.budget_of(layout)
            largest = micro_batch_tokens(self.shape, layout, budget, max_tokens=cap)
            reach = self._reach(layout, largest, budget, cap)
            # the longest design this layout holds, down to the floor (one packed sequence of it fits, or one
            # shared row under dynamic SP); rounding to the quantum never goes below a floor the layout holds
            # (the longest row must stay held)
            held = design if reach >= design else reach // DESIGN_QUANTUM * DESIGN_QUANTUM
            if held < floor <= reach:
                held = floor
            if held < floor or held < 1 or not self._switch_fits(layout):
                continue
            for tokens in self._budgets(largest, held):
                rep = dataclasses.replace(layout, seq_len=held, micro_batch=self._rows(tokens // held, layout.dp))
                fit = check_fit(self.shape, rep, budget.memory_bytes_per_device, reserve_bytes=budget.reserve_bytes)
                if held > largest:  # the design is a shared row: it fits as one (the cost stays the layout's)
                    shared = check_fit(self.shape, dataclasses.replace(self._shared(layout), seq_len=held),
                                       budget.memory_bytes_per_device, reserve_bytes=budget.reserve_bytes)
                    fit = dataclasses.replace(fit, breakdown=shared.breakdown)
                # states sync (FSDP gathers, DDP all-reduce) is paid once per step, over its micro-batches
                acc = max(1, math.ceil(self.step_sequences / (rep.dp * rep.micro_batch)))
                r = rank_plans(self.shape, [fit], self.cost_model, accumulation_steps=acc)[0]
                ranked.append((r, tokens, held, self._step_tokens_per_s(rep) * self._fill(rep.micro_batch)))
        if not ranked:
            return Infeasible(self._infeasible_message(design), self.pool, design, reason, step)
        # fastest, then the longest design (fewer re-plans), then most headroom; then the earliest layout
        best, tokens, held, score = min(ranked, key=lambda r: (-r[3], -r[2], -r[0].check.headroom_bytes))
        if held < design:
            reason += f" ({layout_name(best.check.plan)} holds {held} of it, above the headroom's {floor})"
        bound = dataclasses.replace(best.check.plan, micro_batch=1, seq_len=tokens)
        peak = predict_train_memory(self.shape, bound).total_bytes
        if self._shares(best.check.plan) and held > self.dynamic_sp_tokens:
            row = dataclasses.replace(self._shared(best.check.plan), seq_len=held)
            peak = max(peak, predict_train_memory(self.shape, row).total_bytes)
        return PlanDecision(version=self.version + 1, pool=self.pool, plan=best.check.plan, micro_batch_tokens=tokens,
                            design_seq_len=held, predicted_peak_bytes=peak,
                            predicted_tokens_per_s=score, reason=reason, step=step)

    def _step_tokens_per_s(self, plan: TrainPlan) -> float:
        """Pool tokens per second of a whole step of `step_sequences` rows of the plan's length: each data rank's
        share cut into micro-batches of up to `plan.micro_batch` rows, the last one partial, and the step's own
        costs (optimizer, states sync) paid once. (Per micro-batch, a budget of 7 rows for a step of 8 looked
        like two full micro-batches: 14 rows' throughput for the price of 8.)"""
        per_rank = max(1, math.ceil(self.step_sequences / plan.dp))
        full, rest = divmod(per_rank, plan.micro_batch)
        micro_batches = [plan] * full + ([dataclasses.replace(plan, micro_batch=rest)] if rest else [])
        return plan.dp * per_rank * plan.seq_len / self.cost_model.predict_step(self.shape, micro_batches)

    def _shares(self, layout: TrainPlan) -> bool:
        """Whether `layout` runs rows past `dynamic_sp_tokens` shared over its data ranks (`workers.dynamic_sp`)."""
        return self.dynamic_sp_tokens > 0 and layout.dp > 1 and layout.tp == layout.sp == 1

    def _shared(self, layout: TrainPlan) -> TrainPlan:
        """The plan one shared row runs under: `layout`'s sharding (FSDP over all its ranks, or replicas), the
        row's tokens split over the data ranks by Ulysses sp."""
        return dataclasses.replace(layout, dp=1, sp=layout.dp, micro_batch=1)

    def _reach(self, layout: TrainPlan, largest: int, budget: PoolBudget, cap: int) -> int:
        """The longest row `layout` holds: its largest micro-batch of one rank, or under dynamic SP the longest
        shared row, when every row up to the threshold (trained on one rank) fits there."""
        if not self._shares(layout) or largest < self.dynamic_sp_tokens:
            return largest
        return max(largest, micro_batch_tokens(self.shape, self._shared(layout), budget, max_tokens=cap))

    def _rows(self, fit_rows: int, data_ranks: int) -> int:
        """Rows a micro-batch really holds: what its budget fits, but no more than a step gives a data
        rank (a budget of 4 rows is 1 row when a step brings one sequence per rank)."""
        return max(1, min(fit_rows, math.ceil(self.step_sequences / max(1, data_ranks))))

    def _switch_fits(self, layout: TrainPlan) -> bool:
        """Whether the pool can move from the layout it holds to `layout`; if not, the refusal is kept."""
        held = self.running or (self._current.plan if self._current else None)
        start = held is None  # start-up: every rank holds a replica, the optimizer has not stepped
        old = held or dataclasses.replace(self.base, dp=self.budget.devices, tp=1, sp=1, fsdp=False)
        refusal = switch_refusal(self.shape, old, layout, self.reshard_bucket_bytes,
                                 budget_bytes=self.budget.memory_bytes_per_device,
                                 reserve_bytes=self.budget.reserve_bytes, stepped=not start)
        if refusal is None:
            return True
        if refusal not in self.refused:
            self.refused.append(refusal)
        if refusal not in self._logged:
            self._logged.add(refusal)
            logger.warning("%s: layout %s refused: %s", self.pool, refusal.plan, refusal.reason)
        return False

    def _budgets(self, largest: int, design: int) -> list[int]:
        """Micro-batch token budgets to rank for one layout: the largest that fits (and, pad-aware,
        1, 2, 4, ... design-length rows below it)."""
        if not self.pad_aware or largest < design:
            return [largest]
        return sorted({design << i for i in range(largest.bit_length()) if design << i < largest} | {largest})

    def _fill(self, rows: int) -> float:
        """Expected real / padded tokens of a micro-batch of `rows` rows (1 when not pad-aware)."""
        if not self.pad_aware or rows <= 1:
            return 1.0
        snap = self._snapshot
        if snap is None or snap.count == 0 or snap.p99 <= 0:
            return self.prior_fill
        return min(1.0, snap.p50 / snap.p99)

    def _infeasible_message(self, design: int) -> str:
        if self.only and not self.layouts(design):  # every pinned layout is one the model or the pool cannot take
            why = [f"{r.plan}: {r.reason}" for r in self.refused if r.reason != "not among selector.plans"]
            pinned = "|".join(sorted(self.only))
            return (f"{self.pool}: no layout of selector.plans={pinned} can run this model on "
                    f"{self.budget.devices} rank(s): {'; '.join(why) or 'none is a layout of this pool'}")
        plan = dataclasses.replace(self.base, micro_batch=1, seq_len=design, dp=self.budget.devices, tp=1, sp=1,
                                   fsdp=False, recompute=self.recomputes[-1], sequence_parallel=False)
        advice = advise(self.shape, plan, self.budget.memory_bytes_per_device, reserve_bytes=self.budget.reserve_bytes,
                        recomputes=self.recomputes, allow_tp=self.allow_tp, allow_sp=self.allow_sp)
        switches = [f"{r.plan}: {r.reason}" for r in self.refused if r.reason.startswith("the switch from")]
        more = f"; refused for their switch: {'; '.join(switches)}" if switches else ""
        return f"{self.pool}: no plan fits one {design}-token sequence: {advice.message}{more}"

