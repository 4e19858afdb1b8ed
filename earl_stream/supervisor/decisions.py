"""The versioned decisions of the parallelism selector, as they travel and are stored.

Owns `PlanDecision` (a trainer pool's plan), `RolloutDecision` (a rollout engine's capacity),
`Infeasible` (nothing fits; says what would be needed), `Refusal` (a layout the model or the pool
cannot take), the JSON form of a `TrainPlan` (`plan_to_dict` / `plan_from_dict`), and the one place
where a decision becomes the typed plan that travels to the workers (`to_wire`: `protocol.TrainerPlan`,
`protocol.RolloutPlan`). Making the decisions is `selector`'s job.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from earl_stream.errors import ConfigError
from earl_stream.protocol import RolloutPlan, TrainerPlan
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
# the trainer's dtype (trainer.dtype) -> the memory model's precision the selector sizes plans with: bf16
# compute under autocast with fp32 parameters, gradients and optimizer state (FSDP2's mixed-precision
# policy under FSDP); a plan sized for the ZeRO paper's mixed precision (16 bytes per parameter) also
# runs as trainer dtype bf16
DTYPE_PRECISION = {"fp32": Precision.FP32, "bf16": Precision.AUTOCAST_BF16}
_WIRE_DTYPE = {Precision.FP32: "fp32", Precision.AUTOCAST_BF16: "bf16", Precision.MIXED_BF16: "bf16"}


@dataclasses.dataclass(frozen=True)
class Refusal:
    """A layout the selector did not consider: `plan` (a `TrainerPlan.name`-style string) and why."""

    plan: str
    reason: str

    def to_dict(self) -> dict[str, str]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class PlanDecision:
    """A trainer pool's plan, version `version`, sized for `design_seq_len`-token episodes.

    `micro_batch_tokens` bounds the tokens one micro-batch materialises (`store.layout.materialised_tokens`:
    packed, its rows' lengths summed and rounded up to a multiple of sp; padded, rows x longest row), i.e.
    the memory model's b x s. `plan` is the representative micro-batch
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

    def to_wire(self) -> TrainerPlan:
        """The plan as the trainer pool receives it. The memory model's dp counts every data rank and
        `fsdp` shards the states over all of them (and sp): dp replicas, or one FSDP group of dp ranks."""
        p = self.plan
        if p.fsdp and p.dp // p.ep == 1:
            raise ConfigError(f"plan v{self.version} ({p.describe()}): FSDP over the sequence-parallel ranks alone (or the "
                              "expert-parallel ones) is not a trainer plan (fsdp needs >= 2 data ranks per ep group)")
        dtype = _WIRE_DTYPE.get(p.precision)
        if dtype is None or p.recompute is Recompute.SELECTIVE:
            raise ConfigError(f"plan v{self.version}: precision {p.precision.value} / recompute {p.recompute.value} "
                              f"is not something the trainer runs (dtype {list(DTYPE_PRECISION)}, recompute none/full)")
        data = p.dp // p.ep  # ep ranks are data ranks: the trainer's dp x fsdp x ep = the memory model's dp
        return TrainerPlan(version=self.version, dp=1 if p.fsdp else data, fsdp=data if p.fsdp else 1, tp=p.tp,
                           sp=p.sp, micro_batch_tokens=self.micro_batch_tokens, recompute=p.recompute is Recompute.FULL,
                           dtype=dtype, design_seq_len=self.design_seq_len,
                           predicted_peak_bytes=self.predicted_peak_bytes, reason=self.reason, step=self.step, ep=p.ep)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PlanDecision:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{**{k: v for k, v in d.items() if k in names}, "plan": plan_from_dict(d["plan"])})


@dataclasses.dataclass(frozen=True)
class RolloutDecision:
    """A rollout engine's capacity, version `version`, sized for `design_seq_len`-token episodes.

    Per engine (of `engine_tp` devices; `replicas` engines fill the budget's devices): at most
    `max_concurrent_sequences` sequences and `kv_budget_tokens` tokens of KV cache at once; episodes
    stop at `max_episode_tokens` (0 = no bound). `memory_bytes` is the per-device memory it was sized
    for and `sizing` says, in words, what it admits and why.
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
    max_episode_tokens: int = 0
    memory_bytes: int = 0
    sizing: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_wire(self) -> RolloutPlan:
        return RolloutPlan(version=self.version, max_concurrent_sequences=self.max_concurrent_sequences,
                           kv_budget_tokens=self.kv_budget_tokens, design_seq_len=self.design_seq_len,
                           engine_tp=self.engine_tp, replicas=self.replicas, reason=self.reason, step=self.step,
                           max_episode_tokens=self.max_episode_tokens, memory_bytes=self.memory_bytes,
                           sizing=self.sizing)

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
