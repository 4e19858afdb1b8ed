"""The memory of a live plan switch on one trainer rank: what `workers.reshard` holds while it moves
parameters and optimizer state from one placement to another.

Owns `predict_switch` (-> `SwitchMemory`), `switch_refusal` (a `Refusal` naming the switch that would
not fit a rank's budget) and `model_layout` (what a plan's parameter placement depends on; two plans
with the same one switch without moving anything). What a step costs is `memory_model`'s; which
plans to weigh and which to adopt is the selector's.

At a step boundary a rank holds its weights and, once the optimizer stepped, its AdamW state (the
gradients were dropped with `zero_grad(set_to_none=True)`), and the policy versions it keeps published
for the rollout pool (`TrainPlan.published_versions` of them, laid out as the old plan published). A switch then
materialises the new model's local shards (all at once), and walks the tensors in the model's order,
`bucket_bytes` of whole tensors at a time: a tensor sharded under the old plan is all-gathered whole
(its old shard freed at once), a replicated one is its own whole; this rank's new piece is copied
out (into the new parameter, or a new optimizer state), and the old tensor and the whole copies go.
`predict_switch` replays that walk over the model's tensors with the per-rank share of each under
either plan (`param_tensors.rank_share`: tp, FSDP over dp x sp, ep) and returns its highest point.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from earl_stream.protocol import plan_name
from earl_stream.supervisor.decisions import Refusal
from earl_stream.supervisor.memory_model import Precision, TrainPlan, published_bytes
from earl_stream.supervisor.model_shape import ModelShape
from earl_stream.supervisor.param_tensors import ParamTensor, plan_tensors, rank_share

MIB = 1 << 20
# Making a sharded tensor whole holds two whole copies at its peak: gloo gathers into a list and
# concatenates (measured on CPU: tests/workers/test_reshard_memory.py), and a shard on dim 1 (row-wise
# tensor parallel) is gathered on dim 0 and re-laid; NCCL's in-place gather of a dim-0 shard needs one,
# so this is the safe side there
GATHER_COPIES = 2


@dataclasses.dataclass(frozen=True)
class SwitchMemory:
    """One rank's bytes during a switch from `old` to `new`: `before` (old weights + optimizer state),
    `after` (new), and `peak` (the highest point of the move; 0 when the switch moves nothing)."""

    old: str
    new: str
    before_bytes: int
    after_bytes: int
    peak_bytes: int
    bucket_bytes: int

    @property
    def moves(self) -> bool:
        return self.peak_bytes > 0


def model_layout(plan: TrainPlan) -> tuple[int, int, int]:
    """What the placement of the parameters depends on (as `workers.mesh.RankPlan.model_layout`):
    FSDP's shard degree (dp x sp; 0 without FSDP), the tp degree and the ep degree."""
    return (plan.dp * plan.sp if plan.fsdp else 0, plan.tp, plan.ep)


def _share(t: ParamTensor, plan: TrainPlan) -> tuple[int, bool]:
    """(elements on the fullest rank, whether the tensor is a DTensor) of `t` under `plan`."""
    return rank_share(t, tp=plan.tp, fsdp_shards=plan.dp * plan.sp if plan.fsdp else 0, ep=plan.ep)


def _bytes(precision: Precision) -> tuple[int, int]:
    """(weight, optimizer state) bytes per element at a step boundary: fp32 master weights under
    autocast (its bf16 copies live only during the step)."""
    w, _, opt, _ = precision.element_bytes
    return (4 if precision is Precision.AUTOCAST_BF16 else w), opt


def predict_switch(shape: ModelShape, old: TrainPlan, new: TrainPlan, bucket_bytes: int, *,
                   stepped: bool = True) -> SwitchMemory:
    """One rank's memory while the trainer switches from plan `old` to plan `new` (same pool, same
    precision), moving `bucket_bytes` of whole tensors at a time; `stepped`: the optimizer holds its
    state (False before the first step: only weights move, the new optimizer starts empty)."""
    w, o = _bytes(old.precision)
    o = o if stepped else 0
    tensors = plan_tensors(shape, old.lora_params)
    olds = [_share(t, old) for t in tensors]
    news = [_share(t, new) for t in tensors]
    before = sum(n * (w + (o if t.trained else 0)) for t, (n, _) in zip(tensors, olds))
    after = sum(n * (w + (o if t.trained else 0)) for t, (n, _) in zip(tensors, news))
    if model_layout(old) == model_layout(new):
        return SwitchMemory(plan_label(old), plan_label(new), before, before, 0, bucket_bytes)
    # (whole bytes, old shard bytes, old is a DTensor, new piece bytes, is a state) per item, moved in order
    items = []
    for t, (old_n, old_split), (new_n, _) in zip(tensors, olds, news):
        items.append((t.numel * w, old_n * w, old_split, new_n * w, False))
        if o and t.trained:
            items.extend([(t.numel * o // 2, old_n * o // 2, old_split, new_n * o // 2, True)] * 2)
    # the new model's shards are materialised first, beside the versions the rank keeps published (old plan's)
    held = before + sum(n for n, _ in news) * w + old.published_versions * published_bytes(shape, old)
    peak = held
    for bucket in _buckets(items, bucket_bytes):
        gathered = 0
        for whole, old_b, split, _, _ in bucket:  # whole copies of the old shards, each freed once gathered
            if split:
                peak = max(peak, held + gathered + GATHER_COPIES * whole)
                gathered += whole
                held -= old_b
        for _, old_b, split, new_b, state in bucket:  # new pieces in; replicated olds out once copied
            held += new_b if state else 0
            peak = max(peak, held + gathered)
            held -= 0 if split else old_b
        # the whole copies go with the bucket
    return SwitchMemory(plan_label(old), plan_label(new), before, after, peak, bucket_bytes)


def _buckets(items: list[tuple[int, int, bool, int, bool]], bucket_bytes: int
             ) -> Iterator[list[tuple[int, int, bool, int, bool]]]:
    bucket: list[tuple[int, int, bool, int, bool]] = []
    size = 0
    for item in items:
        if bucket and size + item[0] > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append(item)
        size += item[0]
    if bucket:
        yield bucket


def plan_label(plan: TrainPlan) -> str:
    """The trainer's name of `plan` (`protocol.plan_name`: dp2, fsdp2, tp2, fsdp2_sp2, ...)."""
    data = plan.dp // plan.ep
    return plan_name(1 if plan.fsdp else data, data if plan.fsdp else 1, plan.tp, plan.sp, plan.ep)


def switch_refusal(shape: ModelShape, old: TrainPlan, new: TrainPlan, bucket_bytes: int, *, budget_bytes: int,
                   reserve_bytes: int = 0, stepped: bool = True) -> Refusal | None:
    """Why the pool cannot switch from `old` to `new` on `budget_bytes` per rank (the switch's peak
    plus the reserve would not fit), or None when it can (or nothing moves)."""
    switch = predict_switch(shape, old, new, bucket_bytes, stepped=stepped)
    if switch.peak_bytes + reserve_bytes <= budget_bytes:
        return None
    state = "weights and AdamW state" if stepped else "weights"
    return Refusal(plan_label(new), f"the switch from {switch.old} would need {switch.peak_bytes / MIB:.1f} MiB per "
                   f"rank ({state}: {switch.before_bytes / MIB:.1f} MiB held under {switch.old}, "
                   f"{switch.after_bytes / MIB:.1f} MiB under {switch.new}, moved in buckets of "
                   f"{bucket_bytes / MIB:g} MiB) + {reserve_bytes / MIB:.1f} MiB reserve, over the "
                   f"{budget_bytes / MIB:.1f} MiB budget")
