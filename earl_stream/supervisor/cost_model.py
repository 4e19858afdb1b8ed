"""Cost model of one training step: compute + communication per plan, calibrated from measured times.

Owns: the features of a plan (`plan_features`: FLOPs per device, bytes moved per device, s x s
score elements of eager attention), the linear time model over them (`StepCostModel`), its
least-squares calibration from measured step times (`StepCostModel.calibrate` on single
micro-batches, as EARL profiles tokens/GPU/s per setting and length range; `fit_steps` on whole
training steps, as the supervisor refits it live from the trainer's reports), and ranking of the plans that fit (`rank_plans`).
Which plans fit is `memory_model`'s answer; when to reselect is the selector's.

Per micro-batch on one device (n = b s / sp tokens outside attention, N = matrix parameters):
* compute: 6 N n / tp for the matrices (+ 2 N n / tp once more under full recomputation) and
  6 L b s^2 a d / (tp sp) for the attention matmuls (causal half of 12; + a third again when the
  attention core is recomputed, i.e. selective or full);
* tensor parallel: 4 all-reduces (or all-gather + reduce-scatter with sequence parallelism) of
  n h e bytes per layer, ring cost 2 (tp-1)/tp each; Ulysses sp: 8 all-to-alls of n h e bytes per
  layer, (sp-1)/sp each; FSDP: weights gathered twice and grads reduce-scattered, 3 P (dp sp - 1)/(dp sp)
  bytes, counted once per step in `comm_bytes`: FSDP2 (as `workers.sharding` applies it) really repeats them
  for every micro-batch; on GPUs the repeats overlap the compute (prefetch), so only their per-call cost
  (`seconds_per_collective`, 3 per layer and micro-batch) is on the critical path and their bytes
  (`fsdp_repeat_bytes`) are priced at `seconds_per_fsdp_repeat_byte` = 0; on CPUs (gloo) nothing overlaps
  and `StepCostModel.for_device("cpu")` prices them as any other byte; DDP: one all-reduce
  of the grads per step over the dp x sp ranks that hold a replica (sp ranks train different tokens of
  the same weights), 2 P (dp sp - 1)/(dp sp) bytes; both spread over the step's micro-batches;
* eager attention also pays memory-bound passes over the a s^2 b scores (softmax, mask, grads);
* a vision-language model's tower and connector compute per image token (`VisionTower.flops_per_token`) for
  the device's image tokens (`memory_model.vision_tokens_per_device`), x 3 when the tower trains (+1 under full
  recomputation), once when it is frozen;
* mixture-of-experts models compute with their *active* parameters (the top_k experts a token goes
  through, `ModelShape.layer_matrix_params(active=True)`), whatever the plan; under expert parallel
  (ep) each MoE layer sends its n top_k hidden rows to the experts' owners and back, forward and
  backward: 4 all-to-alls of n k h e bytes, (ep-1)/ep of them leaving the device (+2 under full
  recomputation), 6 collective calls per MoE layer (the counts and expert ids exchanged too); the
  experts' gradients are all-reduced over the dp/ep ranks that hold the same experts only, and FSDP
  neither gathers nor reduce-scatters them.
Time of a micro-batch = seconds_per_flop * flops + seconds_per_byte * bytes + seconds_per_score * scores
+ fixed_seconds; a step adds step_fixed_seconds once (optimizer step, gradient clipping, per-step
Python), which only steps with different numbers of micro-batches can tell apart from fixed_seconds,
and every collective costs seconds_per_collective beyond its bytes (launch and latency; on CPU, gloo
and DTensor dispatch make tensor parallelism's 4 collectives per layer cost more than their bytes):
tp 4 per layer, Ulysses 8 per layer (each +50% under full recomputation), FSDP2 3 per layer and
micro-batch, DDP one per parameter tensor and step.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import numpy as np

from earl_stream.errors import ConfigError
from earl_stream.supervisor.fitting import FitCheck
from earl_stream.supervisor.memory_model import Attention, ModelShape, Recompute, TrainPlan, expert_params, vision_tokens_per_device

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PlanFeatures:
    """Per device, per micro-batch step; communication bytes include a step's share of states sync."""

    flops: float
    comm_bytes: float
    score_elements: float
    tokens: float  # tokens of the whole pool in one micro-batch step: dp * micro_batch * seq_len
    collectives: float = 0.0  # collective calls per device (DDP's per-step ones spread like its bytes)
    # FSDP2's gathers and reduce-scatters of every micro-batch after a step's first (comm_bytes counts them once
    # per step): overlapped with compute on GPUs, on the critical path on CPUs
    fsdp_repeat_bytes: float = 0.0


def plan_features(shape: ModelShape, plan: TrainPlan, *, accumulation_steps: int = 1) -> PlanFeatures:
    """Features of one micro-batch step; states sync (FSDP/DDP) is spread over `accumulation_steps`."""
    b, s, t, p = plan.micro_batch, plan.seq_len, plan.tp, plan.sp
    L, h, a, d = shape.num_layers, shape.hidden_size, shape.num_heads, shape.head_dim
    n = b * s / p
    matrices = L * shape.layer_matrix_params(active=True) + shape.vocab_size * h  # the lm_head matmul too
    # forward + backward (x2; x1 under LoRA: a frozen weight needs no weight gradient) (+ recomputed forward)
    forward_factor = (2 if plan.lora_params else 3) + (1 if plan.recompute is Recompute.FULL else 0)
    attn_factor = 4 if plan.recompute is not Recompute.NONE else 3
    flops = 2 * matrices * n / t * forward_factor + 2 * L * b * s * s * a * d / (t * p) * attn_factor
    flops += _vision_flops(shape, plan)
    w_bytes, g_bytes, _, e = plan.precision.element_bytes
    comm = 0.0
    if t > 1:
        comm += L * 4 * n * h * e * 2 * (t - 1) / t
    if p > 1:
        comm += L * 8 * n * h * e * (p - 1) / p
    experts = expert_params(shape) if plan.ep > 1 else 0  # ep: synced apart, over dp / ep replicas
    if experts:
        again = 1.5 if plan.recompute is Recompute.FULL else 1.0
        comm += shape.moe_layers * 4 * again * n * shape.top_k * h * e * (plan.ep - 1) / plan.ep
        expert_replicas = plan.dp // plan.ep
        if expert_replicas > 1:
            comm += experts / plan.ep * g_bytes * 2 * (expert_replicas - 1) / expert_replicas / accumulation_steps
    params, replicas = shape.num_params() / t - experts, plan.dp * p
    trained = plan.lora_params or params  # LoRA: only the adapters' gradients are reduced
    repeats = 0.0
    if plan.fsdp and replicas > 1:  # once per step in comm; the other micro-batches' repeats apart
        states = (params * 2 * w_bytes + trained * g_bytes) * (replicas - 1) / replicas
        comm += states / accumulation_steps
        repeats = states * (accumulation_steps - 1) / accumulation_steps
    elif replicas > 1:
        comm += trained * g_bytes * 2 * (replicas - 1) / replicas / accumulation_steps
    scores = b * a * s * s / (t * p) if plan.attention is Attention.EAGER else 0.0
    return PlanFeatures(flops=flops, comm_bytes=comm, score_elements=scores, tokens=plan.dp * b * s,
                        collectives=_collectives(L, plan, accumulation_steps, moe_layers=shape.moe_layers),
                        fsdp_repeat_bytes=repeats)


def _vision_flops(shape: ModelShape, plan: TrainPlan) -> float:
    """A vision-language model's tower and connector on one device: its image tokens (`vision_tokens_per_device`)
    x the forward FLOPs per token, x 3 when the tower trains (+1 under full recomputation), x 1 when frozen (its
    output needs no gradient: no backward runs through it)."""
    tower = shape.vision
    if tower is None:
        return 0.0
    factor = 1 if plan.vision_frozen else 3 + (1 if plan.recompute is Recompute.FULL else 0)
    return vision_tokens_per_device(shape, plan) * tower.flops_per_token(shape.hidden_size) * factor


def _collectives(layers: int, plan: TrainPlan, accumulation_steps: int, *, moe_layers: int = 0) -> float:
    """Collective calls per device in one micro-batch (the `seconds_per_collective` feature)."""
    again = 1.5 if plan.recompute is Recompute.FULL else 1.0  # a recomputed forward repeats its collectives
    calls = 0.0
    if plan.tp > 1:
        calls += 4 * layers * again + 4  # + the vocab-parallel log-prob reductions
    if plan.sp > 1:
        calls += 8 * layers * again
    if plan.ep > 1:  # forward: counts, expert ids, rows out, rows back; backward: rows both ways
        calls += 6 * moe_layers * again
    replicas = plan.dp * plan.sp
    if plan.fsdp and replicas > 1:
        calls += 3 * (layers + 1)  # per layer group and the root: gather, re-gather, reduce-scatter
    elif replicas > 1:
        calls += (10 * layers + 3) / accumulation_steps  # one all-reduce per parameter tensor, once per step
    return calls


@dataclasses.dataclass(frozen=True)
class StepCostModel:
    """Seconds of one micro-batch step from `PlanFeatures`. Defaults: a rough modern GPU node."""

    seconds_per_flop: float = 1 / 300e12
    seconds_per_byte: float = 1 / 100e9
    seconds_per_score: float = 1 / 200e9
    fixed_seconds: float = 0.0  # per micro-batch
    step_fixed_seconds: float = 0.0  # once per training step
    seconds_per_collective: float = 0.0  # beyond its bytes: launch, latency, dispatch
    seconds_per_fsdp_repeat_byte: float = 0.0  # GPUs: FSDP2's per-micro-batch repeats overlap compute

    def for_device(self, device_type: str) -> StepCostModel:
        """These coefficients on trainers of `device_type` ("cuda", "cpu"): on CPUs FSDP2's repeated gathers
        overlap nothing, so where no calibration priced them they cost what any byte costs."""
        if device_type == "cpu" and self.seconds_per_fsdp_repeat_byte == 0.0:
            return dataclasses.replace(self, seconds_per_fsdp_repeat_byte=self.seconds_per_byte)
        return self

    def step_seconds(self, shape: ModelShape, plan: TrainPlan, *, accumulation_steps: int = 1) -> float:
        """Seconds of one micro-batch of a step of `accumulation_steps`, with its share of the step's cost."""
        f = plan_features(shape, plan, accumulation_steps=accumulation_steps)
        return (self.seconds_per_flop * f.flops + self.seconds_per_byte * f.comm_bytes
                + self.seconds_per_score * f.score_elements + self.fixed_seconds
                + self.step_fixed_seconds / max(1, accumulation_steps) + self.seconds_per_collective * f.collectives
                + self.seconds_per_fsdp_repeat_byte * f.fsdp_repeat_bytes)

    def tokens_per_second(self, shape: ModelShape, plan: TrainPlan, *, accumulation_steps: int = 1) -> float:
        """Training tokens per second of the whole pool under `plan`."""
        f = plan_features(shape, plan, accumulation_steps=accumulation_steps)
        return f.tokens / self.step_seconds(shape, plan, accumulation_steps=accumulation_steps)

    def to_dict(self) -> dict[str, float]:
        """The calibration, to store (JSON) and reload with `from_dict`."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, float]) -> StepCostModel:
        """A stored calibration; ConfigError names unknown fields."""
        known = {f.name for f in dataclasses.fields(cls)}
        if unknown := sorted(set(d) - known):
            raise ConfigError(f"unknown cost-model fields {unknown}; known: {sorted(known)}")
        return cls(**{k: float(v) for k, v in d.items()})

    @classmethod
    def calibrate(cls, samples: Sequence[tuple[ModelShape, TrainPlan, float]]) -> StepCostModel:
        """Non-negative least squares of measured one-micro-batch step seconds on the features.

        Features that no sample exercises (e.g. no communication on one process) keep the default
        coefficient; the constant goes to `step_fixed_seconds` (one micro-batch per step cannot
        separate it from `fixed_seconds`). Needs at least two samples.
        """
        if len(samples) < 2:
            raise ConfigError(f"cost model calibration needs >= 2 measured steps, got {len(samples)}")
        model = cls.fit_steps([(shape, [plan], sec) for shape, plan, sec in samples])
        logger.info("calibrated step cost model from %d samples: %s", len(samples), model)
        return model

    @classmethod
    def fit_steps(cls, samples: Sequence[tuple[ModelShape, Sequence[TrainPlan], float]],
                  *, prior: StepCostModel | None = None, relative: bool = False) -> StepCostModel:
        """Non-negative least squares of measured *training step* seconds, each step being the
        micro-batches it ran (`TrainPlan`s with their rows and padded length) and its seconds.

        A step's features are the sums over its micro-batches (DDP's sync counted once per step),
        `fixed_seconds` is paid per micro-batch and `step_fixed_seconds` once per step; where every
        step ran the same number of micro-batches the two cannot be told apart and the constant goes to
        `step_fixed_seconds` (`fixed_seconds` keeps `prior`'s). Coefficients of features no sample
        exercises keep `prior`'s (the defaults without one).
        `relative`: minimise squared *relative* errors (each step weighted by 1 / its seconds), so
        that short steps count as much as long ones. Needs at least two samples with >= 1
        micro-batch each.
        """
        rows = [(shape, list(plans), float(sec)) for shape, plans, sec in samples if plans]
        if len(rows) < 2:
            raise ConfigError(f"cost model calibration needs >= 2 measured steps, got {len(rows)}")
        x = np.array([_step_row(shape, plans) for shape, plans, _ in rows], dtype=np.float64)
        y = np.array([sec for _, _, sec in rows], dtype=np.float64)
        if relative:
            if (y <= 0).any():
                raise ConfigError("relative cost-model fit needs measured step seconds > 0")
            x, y = x / y[:, None], np.ones_like(y)
        base = prior or cls()
        coef = np.array([base.seconds_per_flop, base.seconds_per_byte, base.seconds_per_score, base.fixed_seconds,
                         base.step_fixed_seconds, base.seconds_per_collective, base.seconds_per_fsdp_repeat_byte])
        active = _separable_columns(x)
        while active:
            scale = x[:, active].max(axis=0)  # columns differ by ~1e12: scale for a stable solve
            sol, *_ = np.linalg.lstsq(x[:, active] / scale, y, rcond=None)
            sol = sol / scale
            if (sol >= 0).all():
                coef[active] = sol
                break
            active = [j for j, c in zip(active, sol) if c > 0]  # drop negative terms, refit
        return cls(*(float(c) for c in coef))

    def predict_step(self, shape: ModelShape, micro_batches: Sequence[TrainPlan]) -> float:
        """Seconds of one training step made of `micro_batches` (as in `fit_steps`)."""
        row = _step_row(shape, micro_batches)
        return (self.seconds_per_flop * row[0] + self.seconds_per_byte * row[1]
                + self.seconds_per_score * row[2] + self.fixed_seconds * row[3] + self.step_fixed_seconds * row[4]
                + self.seconds_per_collective * row[5] + self.seconds_per_fsdp_repeat_byte * row[6])

    def relative_error(self, samples: Sequence[tuple[ModelShape, Sequence[TrainPlan], float]]) -> float:
        """Mean |predicted - measured| / measured over steps (`fit_steps`' samples); 0.0 without any."""
        errs = [abs(self.predict_step(shape, plans) - sec) / sec for shape, plans, sec in samples if plans and sec > 0]
        return float(np.mean(errs)) if errs else 0.0


# the order in which fit_steps takes features when samples cannot tell some apart: compute, bytes and
# score passes first, then a step's constant before a micro-batch's, the per-collective cost, FSDP2's repeated
# bytes last (they move with the micro-batch count: only steps of several micro-batches under FSDP tell them apart)
_FIT_ORDER = (0, 1, 2, 4, 3, 5, 6)


def _separable_columns(x: np.ndarray) -> list[int]:
    """Columns of the step matrix `x` that the samples exercise and can tell apart, in `_FIT_ORDER`: a
    column that adds no rank to those already taken (e.g. collectives that are a multiple of the
    micro-batch count when every step ran one layout) is left at its prior."""
    scaled = x / np.maximum(x.max(axis=0), 1e-300)
    taken: list[int] = []
    for j in _FIT_ORDER:
        if np.any(x[:, j] > 0) and np.linalg.matrix_rank(scaled[:, taken + [j]], tol=1e-9) == len(taken) + 1:
            taken.append(j)
    return sorted(taken)


def _step_row(shape: ModelShape, micro_batches: Sequence[TrainPlan]) -> list[float]:
    """[flops, comm bytes, score elements, micro-batches, 1, collectives, FSDP repeat bytes] of one step,
    summed over its micro-batches."""
    acc = max(1, len(micro_batches))
    feats = [plan_features(shape, plan, accumulation_steps=acc) for plan in micro_batches]
    return [sum(f.flops for f in feats), sum(f.comm_bytes for f in feats),
            sum(f.score_elements for f in feats), float(len(feats)), 1.0, sum(f.collectives for f in feats),
            sum(f.fsdp_repeat_bytes for f in feats)]


@dataclasses.dataclass(frozen=True)
class RankedPlan:
    check: FitCheck
    step_seconds: float
    tokens_per_second: float


def rank_plans(shape: ModelShape, fits: Sequence[FitCheck], model: StepCostModel, *,
               accumulation_steps: int = 1) -> list[RankedPlan]:
    """The plans that fit, fastest (pool tokens per second) first; ties prefer more headroom."""
    ranked = [RankedPlan(fc, model.step_seconds(shape, fc.plan, accumulation_steps=accumulation_steps),
                         model.tokens_per_second(shape, fc.plan, accumulation_steps=accumulation_steps))
              for fc in fits if fc.fits]
    ranked.sort(key=lambda r: (-r.tokens_per_second, -r.check.headroom_bytes))
    return ranked
