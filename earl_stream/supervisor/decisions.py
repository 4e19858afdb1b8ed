"""The versioned decisions of the parallelism selector, as they travel and are stored.

Owns `PlanDecision` (a trainer pool's plan), `RolloutDecision` (a rollout engine's capacity),
`Infeasible` (nothing fits; says what would be needed) and the JSON form of a `TrainPlan`
(`plan_to_dict` / `plan_from_dict`). Making the decisions is `selector`'s job.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from earl_stream.errors import ConfigError
from earl_stream.supervisor.memory_model import Attention, Precision, Recompute, TrainPlan


def plan_to_dict(plan: TrainPlan) -> dict[str, Any]:
    return {f.name: (v.value if isinstance(v := getattr(plan, f.name), enum.Enum) else v)
            for f in dataclasses.fields(plan)}


def plan_from_dict(d: dict[str, Any]) -> TrainPlan:
    """The inverse of `plan_to_dict`; ConfigError names unknown fields."""
    known = {f.name for f in dataclasses.fields(TrainPlan)}
    if unknown := sorted(set(d) - known):
        raise ConfigError(f"unknown training-plan fields {unknown}; known: {sorted(known)}")
    fields: dict[str, Any] = {k: (_PLAN_ENUMS[k](v) if k in _PLAN_ENUMS else v) for k, v in d.items()}
    return TrainPlan(**fields)


_PLAN_ENUMS: dict[str, type[enum.Enum]] = {"recompute": Recompute, "attention": Attention, "precision": Precision}


@dataclasses.dataclass(frozen=True)
class PlanDecision:
    """A trainer pool's plan, version `version`, sized for `design_seq_len`-token episodes.

    `micro_batch_tokens` bounds one micro-batch: summed *full* sequence lengths, padding included
    (rows x longest row), i.e. the memory model's b x s. `plan` is the representative micro-batch
    (micro_batch = micro_batch_tokens // design_seq_len rows of design length). `predicted_peak_bytes`
    is the memory model's per-device peak for a single packed sequence of `micro_batch_tokens`
    tokens, the worst micro-batch under that bound (reserve not included).
    """

    version: int
    pool: str
    plan: TrainPlan
    micro_batch_tokens: int
    design_seq_len: int
    predicted_peak_bytes: int
    predicted_tokens_per_s: float
    reason: str
    step: int = 0

    @property
    def rank_micro_batch_tokens(self) -> int:
        """The budget in `store.layout.partition`'s units, which counts ceil(length / sp) per row."""
        return self.micro_batch_tokens // self.plan.sp

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "plan": plan_to_dict(self.plan),
                "rank_micro_batch_tokens": self.rank_micro_batch_tokens}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PlanDecision:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{**{k: v for k, v in d.items() if k in names}, "plan": plan_from_dict(d["plan"])})


@dataclasses.dataclass(frozen=True)
class RolloutDecision:
    """A rollout engine's capacity, version `version`, sized for `design_seq_len`-token episodes.

    Per engine (of `engine_tp` devices; `replicas` engines fill the budget's devices): at most
    `max_concurrent_sequences` sequences and `kv_budget_tokens` tokens of KV cache at once.
    """

    version: int
    max_concurrent_sequences: int
    kv_budget_tokens: int
    design_seq_len: int
    reason: str
    engine_tp: int = 1
    replicas: int = 1
    predicted_peak_bytes: int = 0  # per device: weights + a full KV budget
    pool: str = "rollout"
    step: int = 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RolloutDecision:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclasses.dataclass(frozen=True)
class Infeasible:
    """Nothing fits `design_seq_len` on the pool's budget; `message` says what would be needed.
    The pool keeps its current plan; the supervisor reports this before contexts get there."""

    message: str
    pool: str = ""
    design_seq_len: int = 0
    reason: str = ""
    step: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"infeasible": True, **dataclasses.asdict(self)}
