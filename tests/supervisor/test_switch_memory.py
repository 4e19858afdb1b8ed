"""The memory of a live plan switch (`supervisor.switch_memory`) and the selector refusing a plan whose
switch would not fit a rank's budget. The prediction against a measured switch is in
tests/workers/test_reshard_memory.py."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from earl_stream.supervisor.decisions import PlanDecision
from earl_stream.supervisor.memory_model import Attention, ModelShape, Recompute, TrainPlan
from earl_stream.supervisor.selector import MIB, Infeasible, PoolBudget, TrainerSelector
from earl_stream.supervisor.switch_memory import GATHER_COPIES, plan_label, predict_switch

WIDE = {"model_type": "qwen2", "hidden_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8,
        "num_key_value_heads": 4, "intermediate_size": 4096, "vocab_size": 8192}
BASE = TrainPlan(1, 1, attention=Attention.EAGER, logit_copies=6)


@pytest.fixture(scope="module")
def shape() -> ModelShape:
    return ModelShape.from_hf(WIDE)


def plan(dp: int = 2, fsdp: bool = False, tp: int = 1, sp: int = 1, **kw: object) -> TrainPlan:
    return dataclasses.replace(BASE, dp=dp, fsdp=fsdp, tp=tp, sp=sp, **kw)  # type: ignore[arg-type]


def test_a_switch_is_bounded_by_old_and_new_shards_and_one_bucket(shape: ModelShape) -> None:
    replica = shape.num_params() * 4
    largest = shape.intermediate_size * shape.hidden_size * 4  # one MLP weight
    for old, new in ((plan(), plan(fsdp=True)), (plan(fsdp=True), plan(dp=1, tp=2)),
                     (plan(dp=1, tp=2), plan(fsdp=True)), (plan(fsdp=True), plan()), (plan(dp=1, tp=2), plan())):
        for bucket in (MIB, 4 * MIB, 64 * MIB):
            s = predict_switch(shape, old, new, bucket)
            assert s.moves and s.peak_bytes >= max(s.before_bytes, s.after_bytes)
            new_weights = s.after_bytes // 3  # fp32 weights: 4 of 12 bytes per parameter
            assert s.peak_bytes <= s.before_bytes + s.after_bytes + GATHER_COPIES * max(bucket, largest), (old, new)
            if old.fsdp or old.tp > 1:  # from a sharded plan: never a replica on top of what is held
                assert s.peak_bytes < s.before_bytes + new_weights + replica, (old, new, bucket)
    # a larger bucket holds more whole tensors at once
    small = predict_switch(shape, plan(fsdp=True), plan(dp=1, tp=2), 4 * MIB).peak_bytes
    assert predict_switch(shape, plan(fsdp=True), plan(dp=1, tp=2), 1 << 30).peak_bytes > small


def test_plans_of_one_model_layout_switch_without_moving(shape: ModelShape) -> None:
    same = predict_switch(shape, plan(), plan(dp=1, sp=2, recompute=Recompute.FULL), 4 * MIB)
    assert not same.moves and same.before_bytes == same.after_bytes
    assert predict_switch(shape, plan(), plan(dp=2, fsdp=True), 4 * MIB, stepped=False).before_bytes * 3 == \
        predict_switch(shape, plan(), plan(dp=2, fsdp=True), 4 * MIB).before_bytes  # weights only, no AdamW yet
    assert plan_label(plan(fsdp=True, sp=1)) == "fsdp2" and plan_label(plan(dp=1, tp=2)) == "tp2"


def _selector(shape: ModelShape, bucket: int, budget: int = 600 * MIB) -> TrainerSelector:
    selector = TrainerSelector(shape, PoolBudget(2, budget), base=BASE, allow_sp=False, reshard_bucket_bytes=bucket)
    selector.running = plan(fsdp=True)  # what the pool holds now
    return selector


def test_the_selector_refuses_a_plan_whose_switch_would_not_fit(shape: ModelShape,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    # fsdp2 at 1,024 tokens: tp2 + recompute (394 MiB a step) is the fastest that fits 620 MiB (fsdp2 + recompute
    # needs 603 MiB), and its switch from fsdp2 in 4 MiB buckets peaks at ~312 MiB; in 1 GiB buckets at ~630 MiB
    fine = _selector(shape, 4 * MIB, budget=620 * MIB).plan_for(1024)
    assert isinstance(fine, PlanDecision) and plan_label(fine.plan) == "tp2"
    big = _selector(shape, 1 << 30, budget=620 * MIB)
    with caplog.at_level(logging.WARNING, logger="earl_stream.supervisor.selector"):
        chosen = big.plan_for(1024)
    assert isinstance(chosen, PlanDecision) and plan_label(chosen.plan) == "fsdp2"  # no switch at all
    refusal = next(r for r in big.refused if r.plan == "tp2")
    assert refusal.reason.startswith("the switch from fsdp2 would need 630.")
    assert "over the 620.0 MiB budget" in refusal.reason and "buckets of 1024 MiB" in refusal.reason
    assert any("layout tp2 refused: the switch from fsdp2" in r.getMessage() for r in caplog.records)
    assert big.to_dict()  # still serialisable


def test_nothing_fits_says_which_switches_were_refused(shape: ModelShape) -> None:
    # 320 MiB at 256 tokens: only tp2 + recompute fits a step (308 MiB) and its switch in 64 MiB buckets does not
    result = _selector(shape, 64 * MIB, budget=320 * MIB).plan_for(256)
    assert isinstance(result, Infeasible)
    assert "refused for their switch: tp2: the switch from fsdp2 would need 328." in result.message
    assert isinstance(_selector(shape, 4 * MIB, budget=320 * MIB).plan_for(256), PlanDecision)


def test_the_first_plan_switches_from_the_start_up_replicas(shape: ModelShape) -> None:
    selector = TrainerSelector(shape, PoolBudget(2, 600 * MIB), base=BASE, allow_sp=False)
    first = selector.initial(1024)
    assert isinstance(first, PlanDecision)
    # from replicas without optimizer state: what the rank already holds plus the new shards
    s = predict_switch(shape, plan(), first.plan, 64 * MIB, stepped=False)
    assert s.peak_bytes <= 600 * MIB and not [r for r in selector.refused if "switch" in r.reason]


def test_the_bucket_is_a_config_field_of_at_least_one_mib() -> None:
    from earl_stream.config import load_config
    from earl_stream.errors import ConfigError

    assert load_config().trainer.reshard_bucket_bytes == 64 * MIB
    assert load_config(overrides=["trainer.reshard_bucket_bytes=2097152"]).trainer.reshard_bucket_bytes == 2 * MIB
    with pytest.raises(ConfigError, match="reshard_bucket_bytes"):
        load_config(overrides=["trainer.reshard_bucket_bytes=4096"])
