"""The trainer selector's memory reserve, learnt per layout from the ranks' reported step peaks
(`supervisor/memory_reserve.py`, `TrainerSelector.observe_peak`, `Planner` on `PublishVersion`): it grows
with under-prediction and no other layout's does, an outlier ages out only after newer evidence, a plan
that fit under the constant reserve is re-planned once the peaks show it does not, and the evidence is in
the status, the Prometheus gauge and survives a supervisor restart."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import pytest

from earl_stream import metrics as M
from earl_stream import protocol as P
from earl_stream.config import load_config
from earl_stream.store.schema import SCHEMA_VERSION, SampleMeta
from earl_stream.supervisor.context_stats import ContextStats
from earl_stream.supervisor.fitting import check_fit
from earl_stream.supervisor.memory_model import ModelShape, Recompute, TrainPlan
from earl_stream.supervisor.memory_reserve import RESERVE_WINDOW_STEPS, LearntReserve
from earl_stream.supervisor.selector import MIB, PlanDecision, PoolBudget, Thresholds, TrainerSelector, layout_name
from earl_stream.supervisor.server import Supervisor

SMALL = {"model_type": "qwen2", "hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8,
         "num_key_value_heads": 2, "intermediate_size": 1536, "vocab_size": 32000}
PRIOR = 64 * MIB


@pytest.fixture(scope="module")
def small() -> ModelShape:
    return ModelShape.from_hf(SMALL)


def _selector(shape: ModelShape, memory: int = 1024 * MIB) -> TrainerSelector:
    return TrainerSelector(shape, PoolBudget(2, memory, PRIOR), base=TrainPlan(1, 256),
                           thresholds=Thresholds(min_episodes=8, min_episodes_between=1000), step_sequences=8)


def _fits(sel: TrainerSelector, d: PlanDecision) -> bool:
    bound = dataclasses.replace(d.plan, micro_batch=1, seq_len=d.micro_batch_tokens)
    budget = sel.budget_of(d.plan)
    return check_fit(sel.shape, bound, budget.memory_bytes_per_device, reserve_bytes=budget.reserve_bytes).fits


def test_the_reserve_grows_with_under_prediction_of_its_layout_alone(small: ModelShape) -> None:
    sel = _selector(small)
    dp2, fsdp2_rc = (dataclasses.replace(TrainPlan(1, 256), dp=2, fsdp=f, recompute=r)
                     for f, r in ((False, Recompute.NONE), (True, Recompute.FULL)))
    assert sel.budget_of(dp2).reserve_bytes == PRIOR  # the constant is the prior before any measured step
    assert sel.observe_peak(dp2, 500 * MIB, 450 * MIB) == PRIOR  # over-predicted: the prior is also the floor
    assert sel.observe_peak(dp2, 500 * MIB, 600 * MIB) == PRIOR + 100 * MIB
    assert sel.observe_peak(dp2, 500 * MIB, 520 * MIB) == PRIOR + 100 * MIB  # the largest recent excess rules
    budget = sel.budget_of(dp2)
    assert budget.reserve_bytes == PRIOR + 100 * MIB
    assert budget.memory_bytes_per_device - budget.reserve_bytes == 1024 * MIB - PRIOR - 100 * MIB
    assert sel.budget_of(fsdp2_rc) == sel.budget  # per layout: fsdp2+rc measured nothing, keeps the prior
    assert sel.reserves.status() == {"dp2": {"reserve_bytes": PRIOR + 100 * MIB, "max_excess_bytes": 100 * MIB,
                                             "steps": 3, "prior_bytes": PRIOR}}


def test_an_outlier_ages_out_only_after_a_window_of_newer_steps_of_its_layout() -> None:
    r = LearntReserve(PRIOR)
    r.observe("dp2", 0, 300 * MIB)  # one step far past its prediction
    for _ in range(RESERVE_WINDOW_STEPS - 1):
        r.observe("fsdp2", 0, 0)  # other layouts' steps are no evidence about dp2
        r.observe("dp2", 100 * MIB, 110 * MIB)
    assert r.bytes("dp2") == PRIOR + 300 * MIB  # not forgotten: fewer than a window of newer dp2 steps
    r.observe("dp2", 100 * MIB, 110 * MIB)
    assert r.bytes("dp2") == PRIOR + 10 * MIB  # replaced by a window of newer evidence
    again = LearntReserve(PRIOR)
    again.restore(r.excess())
    assert again.bytes("dp2") == r.bytes("dp2") and again.excess() == r.excess()


def test_a_plan_that_fit_under_the_constant_reserve_is_re_planned_once_peaks_show_it_does_not(
        small: ModelShape) -> None:
    sel = _selector(small)
    stats = ContextStats(64)
    for _ in range(16):
        stats.add(200)
    first = sel.decide(stats.snapshot(), step=1)
    assert isinstance(first, PlanDecision) and _fits(sel, first)
    assert sel.decide(stats.snapshot(), step=2) is None  # the thresholds hold it
    one = dataclasses.replace(first.plan, micro_batch=1, seq_len=first.design_seq_len)
    headroom = check_fit(small, one, sel.budget.memory_bytes_per_device, reserve_bytes=PRIOR).headroom_bytes
    assert headroom > 0  # under the constant reserve the layout holds a design-length sequence with room to spare
    # a step's peak went past its prediction by more than that room: the layout no longer holds the design
    sel.observe_peak(first.plan, first.predicted_peak_bytes, first.predicted_peak_bytes + headroom + 8 * MIB)
    assert not _fits(sel, first)
    second = sel.decide(stats.snapshot(), step=3)
    assert isinstance(second, PlanDecision), second
    assert second.version == first.version + 1 and "learnt reserve" in second.reason
    assert second.design_seq_len == first.design_seq_len  # the thresholds, not the reserve, set the design
    assert layout_name(second.plan) != layout_name(first.plan)
    assert _fits(sel, second) and second.micro_batch_tokens >= 200
    assert sel.decide(stats.snapshot(), step=4) is None  # it fits now: no flapping
    # the same excess on another layout would not have moved the plan: the reserve is the measured layout's
    other = _selector(small)
    assert other.decide(stats.snapshot(), step=1) == first
    twin = dataclasses.replace(first.plan, recompute=Recompute.FULL if first.plan.recompute is Recompute.NONE
                               else Recompute.NONE)
    other.observe_peak(twin, first.predicted_peak_bytes, first.predicted_peak_bytes + headroom + 8 * MIB)
    assert other.decide(stats.snapshot(), step=3) is None


def _wire(sup: Supervisor, msg: P.Msg) -> Any:
    return P.decode(P.encode(sup.handle(P.decode(P.encode(msg)), time.monotonic())))


def _claimed_and_measured(tmp_path: Path, *, allocated: bool, learn: str = "auto") -> tuple[Supervisor, str]:
    """A supervisor whose trainer claimed step 0 (8 rows of 200 tokens) and published its peak, 300 MiB over the
    prediction: measured by CUDA's allocator (`allocated`) or as a CPU rank's resident high-water mark."""
    (tmp_path / "config.json").write_text(json.dumps(SMALL))
    sup = Supervisor(load_config(None, [f"model.path={tmp_path}", f"run_dir={tmp_path / 'run'}", "trainer.nproc=1",
                                        "trainer.groups_per_step=4", "trainer.group_size=2",
                                        "selector.initial_seq_len=256", f"selector.reserve_bytes={PRIOR}",
                                        f"selector.trainer_memory_bytes={4096 * MIB}", f"selector.learn_reserve={learn}"]))
    rollout = _wire(sup, P.Register(role=P.Role.ROLLOUT, host="h", pid=1, shard_address="127.0.0.1:1")).worker_id
    trainer = _wire(sup, P.Register(role=P.Role.TRAINER, host="h", pid=2, rank=0)).worker_id
    for prompt in _wire(sup, P.RequestPrompts(worker_id=rollout, max_groups=4)).prompts:
        rows = [SampleMeta(schema_version=SCHEMA_VERSION, sample_id=f"{prompt.group_id}-{i}",
                           prompt_ordinal=prompt.prompt_ordinal, episode_id=str(i), group_id=prompt.group_id,
                           env=prompt.env, turns=1, prompt_tokens=3, response_tokens=197, total_tokens=200,
                           reward=float(i), advantage=None, policy_version_min=0, policy_version_max=0, producer_id="w",
                           producer_address="127.0.0.1:1", checksum=0, created_at=time.time(), info_json="{}")
                for i in range(prompt.group_size)]
        _wire(sup, P.PutMeta(worker_id=rollout, rows=rows))
    assert _wire(sup, P.Claim(worker_id=trainer, step=0, num_groups=4)).ready
    planner = sup.planner
    assert planner.trainer is not None and planner.trainer_plan is not None
    name = layout_name(planner.trainer_plan.plan)
    predicted = planner.predicted_step_peak([200] * 8)
    assert predicted > 0
    _wire(sup, P.PublishVersion(worker_id=trainer, version=1,
                                metrics={"loss": 0.1, "peak_memory_bytes": float(predicted + 300 * MIB),
                                         "peak_memory_allocated": float(allocated)}))
    return sup, name


def test_reported_peaks_teach_the_planner_and_survive_a_restart(tmp_path: Path) -> None:
    sup, name = _claimed_and_measured(tmp_path, allocated=True)
    planner = sup.planner
    assert planner.trainer is not None and planner.trainer_plan is not None
    assert planner.trainer.reserves.bytes(name) == PRIOR + 300 * MIB
    assert M.SELECTOR_MEMORY_RESERVE.labels(name)._value.get() == PRIOR + 300 * MIB
    status = json.loads(_wire(sup, P.StatusRequest()).status_json)["plans"]
    assert status["memory_reserves"][name]["reserve_bytes"] == PRIOR + 300 * MIB

    restarted = Supervisor(sup.cfg)
    restarted.restore(sup.snapshot(), time.monotonic())
    assert restarted.planner.trainer is not None
    assert restarted.planner.trainer.reserves.bytes(name) == PRIOR + 300 * MIB
    assert restarted.planner.trainer.budget_of(planner.trainer_plan.plan).reserve_bytes == PRIOR + 300 * MIB


@pytest.mark.parametrize(("learn", "allocated", "learns"), [("auto", False, False), ("always", False, True),
                                                            ("never", True, False)])
def test_which_measured_peaks_teach_the_reserve(tmp_path: Path, learn: str, allocated: bool, learns: bool) -> None:
    """selector.learn_reserve=auto learns from CUDA's allocated peaks only: a CPU rank's resident high-water mark
    also holds the interpreter's and the C allocator's growth, which the memory model never predicts; always
    learns from either, never from none."""
    sup, name = _claimed_and_measured(tmp_path, allocated=allocated, learn=learn)
    assert sup.planner.trainer is not None
    assert sup.planner.trainer.reserves.bytes(name) == PRIOR + (300 * MIB if learns else 0)
