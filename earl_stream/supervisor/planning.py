"""The supervisor's planner: context-length statistics from the metadata rows, and the current plan
of each pool from the parallelism selector (`earl_stream.supervisor.selector`).

The trainer receives its plan with each claim (a `protocol.TrainerPlan`) and adopts it at that step
boundary, then reports it (`protocol.PlanAdopted`: `trainer_history`); rollout workers receive theirs
(`protocol.RolloutPlan`) with heartbeats and apply it between engine batches. Plans carry a version
and the reason they were made; both are logged, exported as metrics and shown in the status, with the
layouts the selector refused and why. The current plans, the plans sent and the adoption history are
part of the supervisor's persisted state (`PlannerState`): a restarted supervisor continues their
versions.

The trainer selector ranks plans with a `StepCostModel`: the defaults, a stored calibration
(`selector.cost_model_path`), and, once `selector.cost_model_min_steps` training steps were measured,
a live refit (`StepCostModel.fit_steps`) on the trainer's reported step times (minus the time it
spent pulling shards), each step described by the micro-batches the trainer cut it into under the
plan of that step. A refit replaces the model only if it predicts those steps better; it is logged,
shown in the status ("plans" -> "cost_model") and written to `<run_dir>/cost_model.json`.

A model whose config sets fields the memory model does not interpret (`ModelShape.quirks`) is planned
all the same, with a warning; the first trainer step whose metrics carry `peak_memory_bytes` scales the
trainer selector's predictions by measured / predicted (`TrainerSelector.calibrate_memory`), shown in
the status ("plans" -> "memory_calibration").

Every measured trainer step also teaches the trainer selector the reserve of the layout it ran under
(`TrainerSelector.observe_peak`, `memory_reserve`): its fullest rank's `peak_memory_bytes` against the
prediction for the largest micro-batch any rank cut the step's claim into under that plan. The reserves'
evidence is persisted with the planner's state, shown in the status ("plans" -> "memory_reserves") and
exported (`earl_selector_memory_reserve_bytes{plan}`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections import deque
from pathlib import Path
from typing import Any

import msgspec

from earl_stream import metrics as M
from earl_stream.config import RunConfig
from earl_stream.errors import ConfigError, ModelError
from earl_stream.protocol import WEIGHT_VERSIONS_KEPT, RolloutPlan, TrainerOom, TrainerPlan
from earl_stream.records import images_info
from earl_stream.store.layout import Layout, materialised_tokens, partition
from earl_stream.store.schema import SampleMeta, table_from_ipc
from earl_stream.supervisor.context_stats import ContextStats, Percentile
from earl_stream.supervisor.cost_model import StepCostModel
from earl_stream.supervisor.decisions import DTYPE_PRECISION
from earl_stream.supervisor.memory_model import LOGIT_COPIES_EARL_VOCAB_PARALLEL, Attention, ModelShape, TrainPlan, predict_train_memory
from earl_stream.supervisor.oom_replan import OomAnswer, OomRecovery, replan_after_oom
from earl_stream.supervisor.rollout_selector import RolloutSelector, largest_trainable_seq_len, rollout_selector_for
from earl_stream.supervisor.selector import Infeasible, PlanDecision, PoolBudget, RolloutDecision, Thresholds, TrainerSelector, layout_name
from earl_stream.workers.engines.memory import EngineMemory, host_ram_bytes, host_share

log = logging.getLogger(__name__)
_WARMUP_STEPS = 1  # the first measured steps pay one-off costs (allocator, lazy init): not calibrated on
_ISSUED_KEPT = 32  # trainer plans sent, by version, to name the one a PlanAdopted reports


class PlanAdoption(msgspec.Struct, frozen=True):
    """The trainer pool adopted plan `version` at the boundary of `step` (`protocol.PlanAdopted`);
    `plan` is None only for a version this supervisor never sent."""

    version: int
    step: int
    plan: TrainerPlan | None
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version, "step": self.step, "plan": self.plan.to_dict() if self.plan else None,
                "reason": self.reason}


class PlannerState(msgspec.Struct):
    """What a restarted supervisor keeps of its planner (written ahead with the supervisor's state)."""

    trainer: PlanDecision | None = None
    rollout: RolloutDecision | None = None
    issued: list[TrainerPlan] = []
    trainer_history: list[PlanAdoption] = []
    memory_corrections: dict[str, float] = {}  # layout name -> factor learnt from allocation failures
    memory_reserve_excess: dict[str, list[int]] = {}  # layout name -> measured peak - prediction of its latest steps
    oom_recoveries: list[OomRecovery] = []
    rollout_memory_corrections: dict[str, float] = {}  # engine ("tp1") -> factor learnt from the engines' sheds
    rollout_sheds_seen: dict[str, int] = {}  # rollout worker -> the oom_sheds its heartbeats last reported


def load_cost_model(path: str | os.PathLike[str]) -> StepCostModel:
    """A stored calibration: `StepCostModel.to_dict()` as JSON, or a JSON object holding it under
    "cost_model" (as bench/results/selector.json and `<run_dir>/cost_model.json` do)."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"selector.cost_model_path={str(path)!r}: cannot read a JSON calibration ({exc})") from None
    if isinstance(data, dict) and isinstance(data.get("cost_model"), dict):
        data = data["cost_model"]
    if not isinstance(data, dict):
        raise ConfigError(f"selector.cost_model_path={str(path)!r}: expected a JSON object of cost-model fields")
    return StepCostModel.from_dict(data)


def trainer_device_type(cfg: RunConfig) -> str:
    """"cuda" or "cpu": where the trainer pool computes (`trainer.device`; `auto` is what torch sees on the
    supervisor's host, which launches the trainers or runs beside them)."""
    if cfg.trainer.device in ("cpu", "cuda"):
        return cfg.trainer.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def image_share(row: SampleMeta) -> float:
    """The share of `row`'s tokens that are image tokens (its stored images' spans; 0 without images)."""
    described = images_info(json.loads(row.info_json)) if row.info_json else None
    if described is None or row.total_tokens < 1:
        return 0.0
    return min(1.0, sum(span[1] for span in described[0]) / row.total_tokens)


def _model_config_file(cfg: RunConfig) -> Path | None:
    """The config.json of the run's model on this host (a Hub model's checked snapshot); None when the
    model is the embedded one or cannot be had here (the selector then stays off, as the caller logs)."""
    from earl_stream.errors import ModelError
    from earl_stream.model.hub import local_model_dir

    try:
        found = local_model_dir(cfg.model)
    except ModelError as exc:
        log.warning("%s", exc)
        return None
    return found / "config.json" if found is not None else None


class Planner:
    """Context statistics and the current plans of the trainer and rollout pools of one run.

    `cost_model`: a calibrated `StepCostModel` (e.g. `StepCostModel.calibrate` on measured steps, or
    `StepCostModel.from_dict` of a stored calibration); else the one at `selector.cost_model_path`;
    else the default's GPU-like coefficients. Refit live by `on_trained` (see the module docstring).
    """

    def __init__(self, cfg: RunConfig, *, cost_model: StepCostModel | None = None) -> None:
        s = cfg.selector
        source = "given" if cost_model is not None else s.cost_model_path or "defaults"
        if cost_model is None and s.cost_model_path:
            cost_model = load_cost_model(s.cost_model_path)
        if cost_model is not None and cfg.trainer.nproc > 1 and s.allow_fsdp:
            # a calibration measured on this kind of trainer: on CPUs FSDP2's per-micro-batch gathers overlap
            # nothing (the GPU-like defaults keep them free, as on the GPUs they describe)
            cost_model = cost_model.for_device(trainer_device_type(cfg))
        self.cost_model = cost_model or StepCostModel()
        self.calibration: dict[str, Any] = {"source": source, "cost_model": self.cost_model.to_dict()}
        self._calibration_file = Path(cfg.run_dir) / "cost_model.json"
        self._min_steps = s.cost_model_min_steps
        self._learn_reserve_from = s.learn_reserve  # which measured peaks teach the layouts' reserves
        # A run that promises timing independence (staleness 0, batch-invariant rollout) must not let measured
        # step times pick its plans: the refit is computed and reported, never adopted.
        self._hold_refits = cfg.rollout.invariant_batches(cfg.trainer.max_staleness)
        self._step_plans: dict[int, list[TrainPlan]] = {}  # step -> its micro-batches, until measured
        self._step_lengths: dict[int, list[int]] = {}  # step -> its claim's row lengths, until its peak is reported
        self._samples: deque[tuple[ModelShape, list[TrainPlan], float]] = deque(maxlen=s.cost_model_window)
        self._measured = 0
        self._fit_at = 0
        self.stats = ContextStats(s.context_window)
        # a vision-language model's episodes: the share of each one's tokens that are image tokens, over the window
        self.image_shares: deque[float] = deque(maxlen=s.context_window)
        self.packing = cfg.trainer.packing  # how the trainer cuts a claim into micro-batches (micro_batches)
        self.trainer: TrainerSelector | None = None
        self.rollout: RolloutSelector | None = None
        self.trainer_plan: PlanDecision | None = None
        self.rollout_plan: RolloutDecision | None = None
        self.trainer_wire: TrainerPlan | None = None  # trainer_plan as the trainer receives it
        self.rollout_wire: RolloutPlan | None = None
        self._issued: dict[int, TrainerPlan] = {}
        self.trainer_history: list[PlanAdoption] = []
        self.oom_recoveries: list[OomRecovery] = []  # the trainer's allocation failures and the plans that answered them
        self.rollout_sheds_seen: dict[str, int] = {}  # rollout worker -> its engine's sheds counted so far
        self.last_infeasible = ""
        self._memory_configured = cfg.rollout.memory_bytes > 0
        self._initial_seq_len = cfg.selector.initial_seq_len  # a rollout plan's design length before any decision
        self.max_trainable_tokens = 0  # the longest sequence a trainer plan fits (0: unknown)
        self.rollout_memory: EngineMemory | None = None  # what the rollout plan is sized by, and where it came from
        self.memory_calibration: dict[str, Any] = {}  # a shape with quirks: its memory predictions' measured scale
        config_file = _model_config_file(cfg) if s.enabled else None
        if not s.enabled or config_file is None or not config_file.is_file():
            if s.enabled:
                log.warning("selector off: the supervisor cannot read the model config (model.path=%r)", cfg.model.path)
            return
        raw = json.loads(config_file.read_text())
        if raw.get("vision_config") is not None:
            from earl_stream.model.loading import check_vision_policy  # transformers: only for such a model

            try:  # a vision-language family the workers cannot run: refused here, before any worker loads it
                check_vision_policy(str(raw.get("model_type")), engine=cfg.rollout.engine)
            except ModelError as exc:
                raise ConfigError(f"model.path={cfg.model.path!r}: {exc}") from None
        shape = self.shape = ModelShape.from_hf(raw)
        if shape.calibrate:
            self.memory_calibration = {"quirks": list(shape.quirks), "scale": None,
                                       "pending": "the first measured step's peak_memory_bytes"}
        thresholds = Thresholds(percentile=Percentile(s.percentile), upper_factor=s.upper_factor,
                                lower_factor=s.lower_factor, headroom=s.headroom,
                                min_episodes=s.min_episodes, min_episodes_between=s.min_episodes_between)
        memory = s.trainer_memory_bytes or host_ram_bytes() // 4
        # the trainer runs each plan on a mesh of its ranks: data parallel replicas or FSDP2 shards, tensor
        # and Ulysses sequence parallel, recomputation on/off, in trainer.dtype
        pool = cfg.trainer.nproc > 1
        # trainer.dynamic_sp_tokens keeps the model's sharding fixed (dp or FSDP over every rank) and chooses
        # the sp degree per micro-batch in the trainer: no tp, sp or expert-parallel plan is offered
        dynamic_sp = pool and cfg.trainer.dynamic_sp_tokens > 0
        if dynamic_sp and shape.num_heads % cfg.trainer.nproc:
            raise ConfigError(f"trainer.dynamic_sp_tokens={cfg.trainer.dynamic_sp_tokens} runs long rows at sequence "
                              f"parallelism {cfg.trainer.nproc} (trainer.nproc), which must divide the model's "
                              f"{shape.num_heads} attention heads")
        lora = cfg.model.lora
        self.trainer = TrainerSelector(
            shape, PoolBudget(cfg.trainer.nproc, memory, s.reserve_bytes),
            base=TrainPlan(micro_batch=1, seq_len=s.initial_seq_len, attention=Attention(s.attention),
                           precision=DTYPE_PRECISION[cfg.trainer.dtype], logit_copies=LOGIT_COPIES_EARL_VOCAB_PARALLEL,
                           lora_params=shape.lora_params(lora.rank, lora.target_modules) if lora.enabled else 0,
                           published_versions=WEIGHT_VERSIONS_KEPT, vision_frozen=cfg.model.freeze_vision),
            thresholds=thresholds, cost_model=self.cost_model, allow_tp=pool and s.allow_tp and not dynamic_sp,
            allow_sp=pool and s.allow_sp and not dynamic_sp, allow_fsdp=pool and s.allow_fsdp,
            allow_ep=pool and s.allow_ep and not dynamic_sp,
            step_sequences=cfg.trainer.groups_per_step * cfg.trainer.group_size,
            pad_aware=not cfg.trainer.packing, reshard_bucket_bytes=cfg.trainer.reshard_bucket_bytes,
            only=[name for name in s.plans.split("|") if name], model_scale=s.memory_model_scale,
            dynamic_sp_tokens=cfg.trainer.dynamic_sp_tokens if dynamic_sp else 0)
        self.rollout = self._rollout_selector(cfg, shape, thresholds)
        for selector in (self.trainer, self.rollout):
            result = selector.initial(s.initial_seq_len)
            if isinstance(result, Infeasible) and selector is self.rollout and not self._memory_configured:
                # sized by a guess (this host's RAM share): the workers' own memory may hold it (a GPU)
                log.warning("no rollout plan fits this host's RAM share; waiting for the rollout workers to report "
                            "their memory: %s", result.message)
                self.last_infeasible = result.message
            elif isinstance(result, Infeasible):
                raise ConfigError(f"no {selector.pool} plan fits: {result.message}")
            else:
                self._adopt(result)

    def _rollout_selector(self, cfg: RunConfig, shape: ModelShape, thresholds: Thresholds) -> RolloutSelector:
        """Sized by the engine's own memory (rollout.memory_bytes; until the workers report theirs, this
        host's RAM share per process) in rollout.dtype; episodes bounded by the longest trainer plan."""
        assert self.trainer is not None
        r = cfg.rollout
        self.rollout_memory = (EngineMemory(r.memory_bytes, "rollout.memory_bytes") if r.memory_bytes
                               else host_share(r.workers + cfg.trainer.nproc))
        self.max_trainable_tokens = largest_trainable_seq_len(self.trainer)
        return rollout_selector_for(cfg, shape, self.rollout_memory.bytes, self.rollout_memory.source,
                                    thresholds=thresholds, max_episode_tokens=self.max_trainable_tokens)

    def on_rollout_memory(self, reported: dict[str, int], step: int = 0) -> None:
        """The rollout workers' own memory (worker -> bytes, from their heartbeats): unless rollout.memory_bytes
        is set, the rollout plan is sized by the smallest (a new version when that changes)."""
        if self.rollout is None or not reported or self._memory_configured:
            return
        worker, smallest = min(reported.items(), key=lambda kv: kv[1])
        memory = EngineMemory(smallest, f"reported by {worker}, the smallest of {len(reported)} rollout worker(s)")
        budget = dataclasses.replace(self.rollout.budget, memory_bytes_per_device=max(1, smallest))
        result = self.rollout.resize(budget, memory.source, step=step, design_seq_len=self._initial_seq_len)
        self.rollout_memory = memory if result is not None else self.rollout_memory
        if isinstance(result, Infeasible):
            log.error("rollout: no plan fits the reported engine memory: %s", result.message)
            self.last_infeasible = result.message
        elif result is not None:
            self._adopt(result)
            if self.last_infeasible.startswith(f"{self.rollout.pool}:"):
                self.last_infeasible = ""

    def on_rollout_sheds(self, worker: str, total: int, step: int = 0, *, attempted_bytes: int = 0,
                         in_use_bytes: int = 0) -> None:
        """`worker`'s heartbeat reports `total` allocation failures its engine shed since it started, the latest
        asking `attempted_bytes` with `in_use_bytes` in use (0: unknown): those not counted yet correct the rollout
        memory model (`RolloutSelector.on_sheds`: by what it under-predicted when the bytes are known), and the next
        rollout plan holds fewer sequences and a smaller KV budget. A total below the last one (the engine
        restarted) resets."""
        seen = self.rollout_sheds_seen.get(worker, 0)
        self.rollout_sheds_seen[worker] = total
        if self.rollout is None or total <= seen:
            return
        result = self.rollout.on_sheds(total - seen, worker, step=step, attempted_bytes=attempted_bytes,
                                       in_use_bytes=in_use_bytes)
        for key, factor in self.rollout.memory_corrections.items():
            M.SELECTOR_MEMORY_CORRECTION.labels(f"rollout {key}").set(factor)
        if isinstance(result, Infeasible):
            log.error("rollout: no plan fits after %s's allocation failures: %s", worker, result.message)
            self.last_infeasible = result.message
        elif result is not None:
            self._adopt(result)

    def add(self, rows: list[SampleMeta]) -> None:
        self.stats.add_many(r.total_tokens for r in rows)
        if self.trainer is not None and self.trainer.shape.vision is not None:
            self.image_shares.extend(image_share(r) for r in rows)
            # the most image-heavy episode of the window: a micro-batch may hold nothing else
            self.trainer.observe_image_share(max(self.image_shares, default=0.0))

    def on_step(self, step: int, claim_ipc: bytes | None = None) -> None:
        """At a step boundary (a new claim): re-plan if the context percentiles crossed a threshold.

        `claim_ipc` (the claimed metadata table) lets the cost model be refit on this step's time."""
        snapshot = self.stats.snapshot()
        for selector in (self.trainer, self.rollout):
            if selector is None:
                continue
            result = selector.decide(snapshot, step=step)
            if isinstance(result, Infeasible):
                if result.message != self.last_infeasible:
                    log.error("%s: no plan fits: %s", selector.pool, result.message)
                self.last_infeasible = result.message
            elif result is not None:
                self._adopt(result)
        if claim_ipc and self.trainer_plan is not None and self.trainer is not None:
            lengths = table_from_ipc(claim_ipc).column("total_tokens").to_pylist()
            self._step_lengths[step] = lengths
            if self._min_steps:
                self._step_plans[step] = self.micro_batches(lengths)
            for kept in (self._step_plans, self._step_lengths):
                for old in [k for k in kept if k < step - 64]:  # never reported (e.g. a trainer restart)
                    del kept[old]

    def micro_batches(self, lengths: list[int], *, packing: bool | None = None, dp_rank: int = 0) -> list[TrainPlan]:
        """The micro-batches rank 0 of the trainer runs for a claim of rows of `lengths` tokens under
        the current plan, as `train_step` cuts them (`packing`: `trainer.packing`, by default the
        planner's `packing` attribute, else on). Each is a `TrainPlan` of what it materialises
        (`store.layout.materialised_tokens`): packed, b = 1 and s = the packed length with its
        alignment padding; unpacked, b = its rows and s = the longest row rounded up to sp. `dp_rank`: the
        micro-batches of the ranks of that data-parallel rank instead."""
        decision = self.trainer_plan
        if decision is None:
            return []
        packed = self.packing if packing is None else packing
        plan = decision.plan
        layout = Layout.from_rank(dp_rank * plan.tp * plan.sp, dp=plan.dp, tp=plan.tp, cp=plan.sp)
        part = partition(lengths, layout, micro_batch_tokens=decision.rank_micro_batch_tokens, packed=packed)
        out = []
        for mb in part.micro_batches:
            tokens = materialised_tokens([lengths[i] for i in mb], plan.sp, packed=packed)
            rows = 1 if packed else len(mb)
            out.append(dataclasses.replace(plan, micro_batch=rows, seq_len=max(1, tokens // rows)))
        return out

    def on_trained(self, step: int, metrics: dict[str, float]) -> StepCostModel | None:
        """The trainer measured `step` (its PublishVersion metrics: step_seconds, pull_seconds): keep
        the sample and refit the cost model every `selector.cost_model_min_steps` samples. Returns the
        refit model when one was adopted."""
        self._calibrate_memory(step, metrics)
        self._learn_reserve(step, metrics)
        plans = self._step_plans.pop(step, None)
        if not plans or self.trainer is None or not self._min_steps:
            return None
        self._measured += 1
        seconds = float(metrics.get("step_seconds", 0.0)) - float(metrics.get("pull_seconds", 0.0))
        if self._measured <= _WARMUP_STEPS or seconds <= 0:
            return None
        self._samples.append((self.shape, plans, seconds))
        if len(self._samples) < self._min_steps or self._measured - self._fit_at < self._min_steps:
            return None
        self._fit_at = self._measured
        return self._refit(step)

    def _calibrate_memory(self, step: int, metrics: dict[str, float]) -> None:
        """A shape with quirks the memory model does not interpret: the first step whose trainer metrics carry
        `peak_memory_bytes` (the fullest rank's) scales the trainer selector's predictions (`calibrate_memory`)."""
        if self.trainer is None or not self.shape.calibrate or self.trainer_plan is None:
            return
        measured = int(metrics.get("peak_memory_bytes", 0))
        if measured <= 0 or self.memory_calibration.get("scale"):
            return
        predicted = self.trainer_plan.predicted_peak_bytes
        scale = self.trainer.calibrate_memory(predicted, measured)
        self.memory_calibration = {**self.memory_calibration, "step": step, "measured_peak_bytes": measured,
                                   "predicted_peak_bytes": predicted, "scale": scale}

    def predicted_step_peak(self, lengths: list[int]) -> int:
        """The memory model's peak (bytes per device) for a claim of rows of `lengths` tokens under the current
        trainer plan: its largest micro-batch on any data-parallel rank (0 without a plan)."""
        if self.trainer_plan is None:
            return 0
        return max((predict_train_memory(self.shape, mb).total_bytes
                    for r in range(self.trainer_plan.plan.dp) for mb in self.micro_batches(lengths, dp_rank=r)),
                   default=0)

    def _learn_reserve(self, step: int, metrics: dict[str, float]) -> None:
        """The trainer measured `step`'s peak (the fullest rank's): the layout it ran under learns its reserve.
        The step ran under the current plan: plans change only at claims, and an allocation failure's re-plan
        (before the step's retry) is current too."""
        lengths = self._step_lengths.pop(step, None)
        measured = int(metrics.get("peak_memory_bytes", 0))
        if self.trainer is None or self.trainer_plan is None or not lengths or measured <= 0:
            return
        if self._learn_reserve_from == "never" or (self._learn_reserve_from == "auto"
                                                    and not metrics.get("peak_memory_allocated")):
            return  # (auto: a CPU rank's resident peak is not in the units the model predicts)
        layout = self.trainer_plan.plan
        reserve = self.trainer.observe_peak(layout, self.predicted_step_peak(lengths), measured)
        M.SELECTOR_MEMORY_RESERVE.labels(layout_name(layout)).set(reserve)

    def _refit(self, step: int) -> StepCostModel | None:
        samples = list(self._samples)
        fitted = StepCostModel.fit_steps(samples, prior=self.cost_model, relative=True)
        before, after = self.cost_model.relative_error(samples), fitted.relative_error(samples)
        adopted = after <= before and not self._hold_refits
        self.calibration = {"source": "live" if adopted else self.calibration["source"], "step": step,
                            "steps": len(samples), "relative_error": min(after, before) if adopted else before,
                            "previous_relative_error": before, "refit_relative_error": after, "adopted": adopted,
                            "cost_model": (fitted if adopted else self.cost_model).to_dict()}
        if self._hold_refits:
            self.calibration["held"] = ("trainer.max_staleness=0 with a batch-invariant rollout: plans must not "
                                        "depend on measured step times (rollout.batch_invariant)")
        log.info("cost model refit on %d measured steps at step %d: mean relative error %.3f -> %.3f (%s): %s",
                 len(samples), step, before, after, "adopted" if adopted else "kept the previous",
                 fitted.to_dict())
        if not adopted:
            return None
        self.cost_model = fitted
        if self.trainer is not None:
            self.trainer.cost_model = fitted
        try:
            self._calibration_file.parent.mkdir(parents=True, exist_ok=True)
            self._calibration_file.write_text(json.dumps(self.calibration, indent=1))
        except OSError as exc:
            log.warning("cannot write the cost model calibration to %s: %s", self._calibration_file, exc)
        return fitted

    def on_oom(self, msg: TrainerOom, lengths: list[int]) -> OomAnswer:
        """The trainer abandoned `msg.step` (claimed rows of `lengths` tokens) on an allocation failure: the
        plan to retry it under and the rows no plan holds, to refuse (`oom_replan.replan_after_oom`)."""
        answer = replan_after_oom(self, msg, lengths)
        if answer.plan is not None and msg.step in self._step_plans:  # measured under the plan it retries with
            kept = [n for n in lengths if answer.refuse_longer_than is None or n <= answer.refuse_longer_than]
            if kept:  # the step's peak is then predicted for the rows that still train (the learnt reserve)
                self._step_plans[msg.step] = self.micro_batches(kept)
                self._step_lengths[msg.step] = kept
            else:  # every row refused: the step's next claim is a new batch (on_step sizes it)
                del self._step_plans[msg.step]
                self._step_lengths.pop(msg.step, None)
        return answer

    def adopt(self, decision: PlanDecision | RolloutDecision) -> None:
        """Make `decision` the pool's current plan (what claims and heartbeats carry from now on)."""
        self._adopt(decision)

    def _adopt(self, decision: PlanDecision | RolloutDecision) -> None:
        if isinstance(decision, PlanDecision):
            self.trainer_plan, wire = decision, decision.to_wire()
            self.trainer_wire = self._issued[wire.version] = wire
            for old in sorted(self._issued)[:-_ISSUED_KEPT]:
                del self._issued[old]
            log.info("trainer plan v%d: %s (%s), micro-batch %d tokens, design length %d (%s)", decision.version,
                     wire.name, decision.plan.describe(), decision.micro_batch_tokens, decision.design_seq_len,
                     decision.reason)
        else:
            self.rollout_plan, self.rollout_wire = decision, decision.to_wire()
            log.info("rollout plan v%d: %d concurrent sequences, KV budget %d tokens, design length %d (%s)",
                     decision.version, decision.max_concurrent_sequences, decision.kv_budget_tokens,
                     decision.design_seq_len, decision.reason)
        M.SUP_PLAN_VERSION.labels(decision.pool).set(decision.version)
        M.SUP_PLAN_DESIGN_LENGTH.labels(decision.pool).set(decision.design_seq_len)
        M.SUP_MEMORY_PREDICTED.labels(decision.pool).set(decision.predicted_peak_bytes)

    def on_adopted(self, version: int, step: int) -> None:
        """The trainer pool adopted plan `version` at the boundary of `step` (its PlanAdopted)."""
        if any(h.version == version and h.step == step for h in self.trainer_history[-4:]):
            return  # the same report again (a retry across a supervisor restart)
        plan = self._issued.get(version)
        self.trainer_history.append(PlanAdoption(version, step, plan, plan.reason if plan else ""))
        self._note_running(plan)
        log.info("trainer pool adopted plan v%d (%s) at step %d", version, plan.name if plan else "not sent by us", step)

    def _note_running(self, plan: TrainerPlan | None) -> None:
        """The layout the trainer pool holds now: the selector weighs each plan's switch from it."""
        if self.trainer is not None and plan is not None:
            self.trainer.running = dataclasses.replace(self.trainer.base, dp=plan.dp * plan.fsdp * plan.ep,
                                                       fsdp=plan.fsdp > 1, tp=plan.tp, sp=plan.sp, ep=plan.ep)

    def snapshot(self) -> PlannerState:
        return PlannerState(trainer=self.trainer_plan, rollout=self.rollout_plan, issued=list(self._issued.values()),
                            trainer_history=list(self.trainer_history),
                            memory_corrections=dict(self.trainer.memory_corrections) if self.trainer else {},
                            memory_reserve_excess=self.trainer.reserves.excess() if self.trainer else {},
                            oom_recoveries=list(self.oom_recoveries),
                            rollout_memory_corrections=dict(self.rollout.memory_corrections) if self.rollout else {},
                            rollout_sheds_seen=dict(self.rollout_sheds_seen))

    def restore(self, state: PlannerState) -> None:
        """Continue a restarted supervisor's plans: versions go on from the persisted ones."""
        self.trainer_history = list(state.trainer_history)
        self._note_running(self.trainer_history[-1].plan if self.trainer_history else None)
        self._issued.update({p.version: p for p in state.issued})
        self.oom_recoveries = list(state.oom_recoveries)
        if self.trainer is not None:  # before the resume: whether the saved plan still fits depends on them
            self.trainer.memory_corrections.update(state.memory_corrections)
            for name, factor in state.memory_corrections.items():
                M.SELECTOR_MEMORY_CORRECTION.labels(name).set(factor)
            self.trainer.reserves.restore(state.memory_reserve_excess)
            for name in state.memory_reserve_excess:
                M.SELECTOR_MEMORY_RESERVE.labels(name).set(self.trainer.reserves.bytes(name))
        self.rollout_sheds_seen = dict(state.rollout_sheds_seen)
        if self.rollout is not None:  # before the resume, as the trainer's
            self.rollout.memory_corrections.update(state.rollout_memory_corrections)
        if self.trainer is not None and state.trainer is not None:
            self._adopt(self.trainer.resume(state.trainer))
        if self.rollout is not None and state.rollout is not None:
            self._adopt(self.rollout.resume(state.rollout))

    def status(self) -> dict[str, Any]:
        d, wire = self.trainer_plan, self.trainer_wire
        trainer = {**wire.to_dict(), "predicted_tokens_per_s": d.predicted_tokens_per_s} if d and wire else None
        return {"trainer": trainer, "rollout": self.rollout_plan.to_dict() if self.rollout_plan else None,
                "trainer_history": [h.to_dict() for h in self.trainer_history],
                "refused": [r.to_dict() for r in self.trainer.refused] if self.trainer else [],
                "infeasible": self.last_infeasible or None, "cost_model": self.calibration,
                "max_trainable_tokens": self.max_trainable_tokens or None,
                "memory_calibration": self.memory_calibration or None,
                "memory_corrections": dict(self.trainer.memory_corrections) if self.trainer else {},
                "memory_reserves": self.trainer.reserves.status() if self.trainer else {},
                "rollout_memory_corrections": dict(self.rollout.memory_corrections) if self.rollout else {},
                "oom_recoveries": [msgspec.structs.asdict(r) for r in self.oom_recoveries],
                "rollout_memory": dataclasses.asdict(self.rollout_memory) if self.rollout_memory else None}
