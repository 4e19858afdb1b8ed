"""The supervisor's planner: context-length statistics from the metadata rows, and the current plan
of each pool from the parallelism selector (`earl_stream.supervisor.selector`).

The trainer receives its plan with each claim and adopts it at that step boundary; rollout workers
receive theirs with heartbeats and apply it between engine batches. Plans carry a version and the
reason they were made; both are logged, exported as metrics and shown in the status.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from earl_stream import metrics as M
from earl_stream.config import RunConfig
from earl_stream.errors import ConfigError
from earl_stream.store.schema import SampleMeta
from earl_stream.supervisor.context_stats import ContextStats, Percentile
from earl_stream.supervisor.cost_model import StepCostModel
from earl_stream.supervisor.memory_model import LOGIT_COPIES_EARL_GRPO, Attention, ModelShape, TrainPlan
from earl_stream.supervisor.selector import (
    Infeasible, PlanDecision, PoolBudget, RolloutDecision, RolloutSelector, Thresholds, TrainerSelector,
)

log = logging.getLogger(__name__)


def _ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class Planner:
    """Context statistics and the current plans of the trainer and rollout pools of one run.

    `cost_model`: a calibrated `StepCostModel` (e.g. `StepCostModel.calibrate` on measured steps, or
    `StepCostModel.from_dict` of a stored calibration); the default's GPU-like coefficients otherwise.
    """

    def __init__(self, cfg: RunConfig, *, cost_model: StepCostModel | None = None) -> None:
        s = cfg.selector
        self.stats = ContextStats(s.context_window)
        self.trainer: TrainerSelector | None = None
        self.rollout: RolloutSelector | None = None
        self.trainer_plan: PlanDecision | None = None
        self.rollout_plan: RolloutDecision | None = None
        self.last_infeasible = ""
        config_file = Path(cfg.model.path) / "config.json" if cfg.model.path else None
        if not s.enabled or config_file is None or not config_file.is_file():
            if s.enabled:
                log.warning("selector off: the supervisor cannot read the model config (model.path=%r)", cfg.model.path)
            return
        shape = ModelShape.from_hf(json.loads(config_file.read_text()))
        thresholds = Thresholds(percentile=Percentile(s.percentile), upper_factor=s.upper_factor,
                                lower_factor=s.lower_factor, headroom=s.headroom,
                                min_episodes_between=s.min_episodes_between)
        memory = s.trainer_memory_bytes or _ram_bytes() // 4
        # what the trainer implements: data parallel (DDP-style) and Ulysses sequence parallel over its
        # ranks (`workers.parallel`), recomputation on/off; no tensor parallel or FSDP
        self.trainer = TrainerSelector(
            shape, PoolBudget(cfg.trainer.nproc, memory, s.reserve_bytes),
            base=TrainPlan(micro_batch=1, seq_len=s.initial_seq_len, attention=Attention.EAGER,
                           logit_copies=LOGIT_COPIES_EARL_GRPO),
            thresholds=thresholds, cost_model=cost_model, allow_tp=False, allow_sp=cfg.trainer.nproc > 1,
            allow_fsdp=False, step_sequences=cfg.trainer.groups_per_step * cfg.trainer.group_size, pad_aware=True)
        self.rollout = RolloutSelector(shape, PoolBudget(1, memory, s.reserve_bytes), thresholds=thresholds,
                                       dtype_bytes=4, max_sequences=cfg.rollout.max_batch_size, allow_tp=False)
        for selector in (self.trainer, self.rollout):
            result = selector.initial(s.initial_seq_len)
            if isinstance(result, Infeasible):
                raise ConfigError(f"no {selector.pool} plan fits: {result.message}")
            self._adopt(result)

    def add(self, rows: list[SampleMeta]) -> None:
        self.stats.add_many(r.total_tokens for r in rows)

    def on_step(self, step: int) -> None:
        """At a step boundary (a new claim): re-plan if the context percentiles crossed a threshold."""
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

    def _adopt(self, decision: PlanDecision | RolloutDecision) -> None:
        if isinstance(decision, PlanDecision):
            self.trainer_plan = decision
            log.info("trainer plan v%d: %s, micro-batch %d tokens, design length %d (%s)", decision.version,
                     decision.plan.describe(), decision.micro_batch_tokens, decision.design_seq_len, decision.reason)
        else:
            self.rollout_plan = decision
            log.info("rollout plan v%d: %d concurrent sequences, KV budget %d tokens, design length %d (%s)",
                     decision.version, decision.max_concurrent_sequences, decision.kv_budget_tokens,
                     decision.design_seq_len, decision.reason)
        M.SUP_PLAN_VERSION.labels(decision.pool).set(decision.version)
        M.SUP_PLAN_DESIGN_LENGTH.labels(decision.pool).set(decision.design_seq_len)
        M.SUP_MEMORY_PREDICTED.labels(decision.pool).set(decision.predicted_peak_bytes)

    def trainer_plan_json(self) -> str:
        return json.dumps(self.trainer_plan.to_dict()) if self.trainer_plan else ""

    def rollout_plan_json(self) -> str:
        return json.dumps(self.rollout_plan.to_dict()) if self.rollout_plan else ""

    def status(self) -> dict[str, Any]:
        return {"trainer": self.trainer_plan.to_dict() if self.trainer_plan else None,
                "rollout": self.rollout_plan.to_dict() if self.rollout_plan else None,
                "infeasible": self.last_infeasible or None}
