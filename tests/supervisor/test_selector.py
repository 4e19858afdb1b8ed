"""The parallelism selector: re-plans as contexts grow, hysteresis, plans that fit, infeasible budgets,
rollout capacity, serialisation and determinism."""

from __future__ import annotations

import dataclasses
import json
import random
import re
from collections.abc import Iterable

import pytest

from earl_stream.errors import ConfigError
from earl_stream.supervisor.context_stats import ContextStats, Percentile
from earl_stream.supervisor.fitting import advise, check_fit
from earl_stream.supervisor.memory_model import Attention, ModelShape, Precision, Recompute, TrainPlan, predict_train_memory
from earl_stream.supervisor.rollout_selector import RolloutSelector
from earl_stream.supervisor.selector import (
    MIB,
    Infeasible,
    PlanDecision,
    PoolBudget,
    RolloutDecision,
    Thresholds,
    TrainerSelector,
    micro_batch_tokens,
)

# The embedded default model's shape (Qwen2, h128, 4 layers, vocab 512, tied embeddings).
TINY = {"model_type": "qwen2", "hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 512, "vocab_size": 512, "tie_word_embeddings": True}
LLAMA_8B = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256}
EAGER = TrainPlan(1, 1, attention=Attention.EAGER)
FLASH = TrainPlan(1, 1)
FAST = Thresholds(min_episodes=8, min_episodes_between=32)


@pytest.fixture(scope="module")
def tiny() -> ModelShape:
    return ModelShape.from_hf(TINY)


def feed(selector: TrainerSelector | RolloutSelector, lengths: Iterable[int], window: int = 64,
         stats: ContextStats | None = None) -> list[PlanDecision | RolloutDecision | Infeasible]:
    """One episode per step; every decision the selector makes along the way."""
    stats = ContextStats(window) if stats is None else stats
    out = []
    for n in lengths:
        stats.add(n)
        d = selector.decide(stats.snapshot(), step=stats.total)
        if d is not None:
            out.append(d)
    return out


def growing(start: int, end: int, episodes: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [int(start * (end / start) ** (i / episodes) * rng.uniform(0.85, 1.0)) for i in range(episodes)]


def assert_fits(shape: ModelShape, d: PlanDecision, budget: PoolBudget) -> None:
    """The representative plan and the worst micro-batch of its token budget both fit; one more
    Ulysses quantum of tokens would not (the budget is the largest that fits, or the cap)."""
    kw = dict(reserve_bytes=budget.reserve_bytes)
    assert check_fit(shape, d.plan, budget.memory_bytes_per_device, **kw).fits
    bound = dataclasses.replace(d.plan, micro_batch=1, seq_len=d.micro_batch_tokens)
    assert check_fit(shape, bound, budget.memory_bytes_per_device, **kw).fits
    assert predict_train_memory(shape, bound).total_bytes == d.predicted_peak_bytes
    assert d.plan.devices == budget.devices and d.plan.recompute is not Recompute.SELECTIVE
    assert d.design_seq_len <= d.micro_batch_tokens and d.plan.seq_len == d.design_seq_len
    assert 1 <= d.plan.micro_batch <= d.micro_batch_tokens // d.design_seq_len


def test_growing_context_replans_up_with_reasons(tiny: ModelShape) -> None:
    budget = PoolBudget(devices=2, memory_bytes_per_device=2000 * MIB, reserve_bytes=50 * MIB)
    sel = TrainerSelector(tiny, budget, base=EAGER, thresholds=FAST)
    decisions = feed(sel, growing(512, 4096, 600))
    assert all(isinstance(d, PlanDecision) for d in decisions)
    plans = [d for d in decisions if isinstance(d, PlanDecision)]
    assert [d.version for d in plans] == list(range(1, len(plans) + 1))
    designs = [d.design_seq_len for d in plans]
    # powers of two, except where a faster layout holds the headroom (1.25 x p99) but not the power of two
    assert designs == sorted(designs) and designs[0] == 1024 and len(set(designs)) == 4
    assert designs[-1] >= 1.25 * 0.85 * 4096 * (4096 / 512) ** (-1 / 600) * 0.9
    assert plans[0].reason.startswith("first plan: p99 context")
    for prev, d in zip(plans, plans[1:]):
        pow2 = int(re.search(r"-> design length (\d+)", d.reason).group(1))
        assert f"> 0.9 x {prev.design_seq_len} design length -> design length {pow2}" in d.reason
        assert pow2 & (pow2 - 1) == 0 and d.design_seq_len <= pow2
        assert (d.design_seq_len == pow2) == ("holds" not in d.reason)
        assert d.reason.startswith("p99 context ")
    for d in plans:
        assert_fits(tiny, d, budget)
    # Memory pressure moves the plan: recomputation or model parallelism appears at the long end.
    last = plans[-1].plan
    assert last.recompute is Recompute.FULL or last.sp > 1 or last.tp > 1
    assert plans[0].plan.recompute is Recompute.NONE
    assert sel.current is plans[-1] and sel.version == len(plans)


def test_noise_around_a_threshold_does_not_flap(tiny: ModelShape) -> None:
    budget = PoolBudget(1, 4096 * MIB)
    sel = TrainerSelector(tiny, budget, base=EAGER, thresholds=Thresholds(min_episodes=8, min_episodes_between=0))
    first = sel.initial(2048)
    assert isinstance(first, PlanDecision) and first.version == 1
    rng = random.Random(3)
    # p99 straddles 0.9 x 2048 = 1843: one re-plan up, then it sits inside the new band for good.
    decisions = feed(sel, [int(1843 * rng.uniform(0.9, 1.08)) for _ in range(2000)])
    assert len(decisions) == 1 and decisions[0].design_seq_len == 4096
    # Noise straddling 0.4 x 4096 = 1638 with p99 above it (the window's top keeps p99 high): stays.
    decisions = feed(sel, [int(1638 * rng.uniform(0.8, 1.12)) for _ in range(2000)])
    assert decisions == []
    assert sel.version == 2


def test_shrinking_context_replans_down_only_below_the_lower_factor(tiny: ModelShape) -> None:
    budget = PoolBudget(2, 2048 * MIB)
    th = Thresholds(min_episodes=8, min_episodes_between=200)
    sel = TrainerSelector(tiny, budget, base=EAGER, thresholds=th)
    assert isinstance(sel.initial(4096), PlanDecision)
    stats = ContextStats(32)
    assert feed(sel, [1700] * 500, stats=stats) == []  # 1700 > 0.4 x 4096 = 1638: keep the big plan
    down = feed(sel, [1000] * 300, stats=stats)
    assert len(down) == 1
    d = down[0]
    assert isinstance(d, PlanDecision) and d.design_seq_len == 2048 and d.version == 2
    assert re.fullmatch(r"p99 context 1\d\d\d(\.\d)? < 0.4 x 4096 design length -> design length 2048", d.reason)
    # The drop is seen once p99 of the turning window falls below 1638; the cool-down had passed.
    assert 500 < d.step <= 500 + 32


def test_cool_down_delays_replans_unless_the_design_length_is_exceeded(tiny: ModelShape) -> None:
    budget = PoolBudget(1, 4096 * MIB)
    sel = TrainerSelector(tiny, budget, base=EAGER, thresholds=Thresholds(min_episodes=8, min_episodes_between=100))
    assert isinstance(sel.initial(1024), PlanDecision)  # at step 0, episode total 0
    stats = ContextStats(16)
    up = feed(sel, [950] * 120, stats=stats)  # 950 > 0.9 x 1024 but < 1024: waits for the cool-down
    assert len(up) == 1 and up[0].step == 100 and up[0].design_seq_len == 2048
    # Past the 2048 design length: at once (p99 of 16 crosses 2048 with the second long episode).
    urgent = feed(sel, [2100] * 20, stats=stats)
    assert len(urgent) == 1 and urgent[0].step == 122 and urgent[0].design_seq_len == 4096
    assert "p99 context 2100 > 0.9 x 2048" in urgent[0].reason


def test_max_percentile_and_clamped_design(tiny: ModelShape) -> None:
    th = Thresholds(percentile=Percentile.MAX, min_episodes=1, min_episodes_between=0, max_design_seq_len=2048)
    sel = TrainerSelector(tiny, PoolBudget(1, 4096 * MIB), base=EAGER, thresholds=th)
    d = feed(sel, [100] * 10 + [1500])
    assert [x.design_seq_len for x in d] == [256, 2048]
    assert d[1].reason.startswith("max context 1500 > 0.9 x 256")
    assert feed(sel, [3000] * 5) == []  # already at the clamp: nothing to change


def test_infeasible_budget_reports_what_would_be_needed(tiny: ModelShape) -> None:
    budget = PoolBudget(1, 200 * MIB, reserve_bytes=16 * MIB)
    sel = TrainerSelector(tiny, budget, base=EAGER, thresholds=FAST)
    bad = sel.initial(2048)
    assert isinstance(bad, Infeasible) and sel.current is None
    expect = advise(tiny, dataclasses.replace(EAGER, seq_len=2048, recompute=Recompute.FULL),
                    budget.memory_bytes_per_device, reserve_bytes=budget.reserve_bytes,
                    recomputes=(Recompute.NONE, Recompute.FULL))
    assert expect.message in bad.message and "nothing fits on 1 device(s)" in bad.message
    assert "needs >= 2 devices (e.g. dp=1 tp=1 sp=2" in bad.message and "or a budget of >= 0.24 GiB" in bad.message
    assert bad.to_dict()["infeasible"] is True and bad.design_seq_len == 2048
    # During a run, a headroom design that fits nothing gives way to the longest design that fits above
    # the observed length (1500 -> 2048 does not fit; 1728 is the longest multiple of 64 that does), once.
    assert isinstance(sel.initial(1024), PlanDecision)
    stats = ContextStats(64)
    out = feed(sel, [1500] * 50, stats=stats)
    assert len(out) == 1 and isinstance(out[0], PlanDecision) and out[0].design_seq_len == 1728
    assert "p99 context 1500 > 0.9 x 1024" in out[0].reason and "sized for the longest design length that fits" \
        in out[0].reason and "2048" in out[0].reason
    assert_fits(tiny, out[0], budget)
    assert isinstance(sel.plan_for(1792), Infeasible)  # 1728 is the longest that fits
    # Past what any plan fits: reported once per unreachable design length, the current plan stays.
    out = feed(sel, [1900] * 80, stats=stats)
    assert len(out) == 1 and isinstance(out[0], Infeasible) and out[0].design_seq_len == 4096
    assert "p99 context 1900 > 0.9 x 1728" in out[0].reason
    assert sel.version == 2 and sel.to_dict()["last_infeasible"]["design_seq_len"] == 4096


def test_micro_batch_tokens_is_the_largest_budget_that_fits(tiny: ModelShape) -> None:
    budget = PoolBudget(1, 700 * MIB, reserve_bytes=20 * MIB)
    for plan in (EAGER, dataclasses.replace(EAGER, recompute=Recompute.FULL), dataclasses.replace(EAGER, sp=4)):
        tokens = micro_batch_tokens(tiny, plan, budget)
        assert tokens > 0 and tokens % plan.sp == 0

        def fits(n: int, plan: TrainPlan = plan) -> bool:
            p = dataclasses.replace(plan, micro_batch=1, seq_len=n)
            return check_fit(tiny, p, budget.memory_bytes_per_device, reserve_bytes=budget.reserve_bytes).fits

        assert fits(tokens) and not fits(tokens + plan.sp)
    assert micro_batch_tokens(tiny, EAGER, PoolBudget(1, 4096 * MIB), max_tokens=1000) == 1000
    assert micro_batch_tokens(tiny, EAGER, PoolBudget(1, 1 * MIB)) == 0


def test_llama8b_on_eight_gpus_from_4k_to_32k() -> None:
    shape = ModelShape.from_hf(LLAMA_8B)
    budget = PoolBudget(8, 80 << 30, reserve_bytes=6 << 30)
    base = TrainPlan(1, 1, precision=Precision.MIXED_BF16, attention=Attention.FLASH)
    sel = TrainerSelector(shape, budget, base=base, thresholds=FAST, step_sequences=64)
    plans = [d for d in feed(sel, growing(3000, 26000, 400, seed=5)) if isinstance(d, PlanDecision)]
    # the powers of two 4K..32K, or (where the fastest layout holds the headroom but not the power of two)
    # the longest length that layout holds: fsdp8 keeps 7,232 tokens rather than give way to sp at 8K (FSDP2's
    # root keeps the unsharded 128K-vocabulary embedding and LM head from its forward to the end of the backward),
    # and the contexts outgrowing it re-plan to the power of two
    pow2s = [int(re.search(r"-> design length (\d+)", d.reason).group(1)) for d in plans]
    assert pow2s == [4096, 8192, 8192, 16384, 16384, 32768]
    p99s = [float(re.search(r"p99 context ([\d.]+)", d.reason).group(1)) for d in plans]
    assert all(1.25 * x <= d.design_seq_len <= p for d, x, p in zip(plans, p99s, pow2s))
    for d in plans:
        assert_fits(shape, d, budget)
    # Fully sharded data parallel first; sequence parallelism (then recomputation) takes over as contexts
    # grow (EARL's story). FSDP always shards over >= 2 data ranks: the trainer's plan has an fsdp degree.
    assert [d.to_wire().name for d in plans][0] == "fsdp8"
    assert [d.plan.sp for d in plans] == sorted(d.plan.sp for d in plans) and plans[-2].plan.sp > 1
    assert all(d.plan.dp > 1 for d in plans if d.plan.fsdp)
    assert plans[-1].plan.recompute is Recompute.FULL or plans[-1].plan.sp >= 4
    speeds = [d.predicted_tokens_per_s for d in plans]
    assert speeds == sorted(speeds, reverse=True)


def test_rollout_selector_lowers_concurrency_as_contexts_grow(tiny: ModelShape) -> None:
    budget = PoolBudget(1, 64 * MIB, reserve_bytes=8 * MIB)
    sel = RolloutSelector(tiny, budget, thresholds=FAST, dtype_bytes=4)
    decisions = [d for d in feed(sel, growing(512, 4096, 600)) if isinstance(d, RolloutDecision)]
    assert [d.design_seq_len for d in decisions] == [1024, 2048, 4096, 8192]
    conc = [d.max_concurrent_sequences for d in decisions]
    assert conc == sorted(conc, reverse=True) and conc[0] > conc[-1] >= 1
    per_token = 2 * tiny.num_layers * tiny.num_kv_heads * tiny.head_dim * 4
    for d in decisions:
        assert d.max_concurrent_sequences * d.design_seq_len <= d.kv_budget_tokens
        assert d.kv_budget_tokens == sel.kv_capacity_tokens()
        assert d.predicted_peak_bytes + budget.reserve_bytes <= budget.memory_bytes_per_device
        assert d.max_concurrent_sequences == d.kv_budget_tokens // d.design_seq_len
        assert (d.kv_budget_tokens + 1) * per_token > budget.memory_bytes_per_device - budget.reserve_bytes - (
            tiny.num_params() * 4)
    capped = RolloutSelector(tiny, budget, dtype_bytes=4, max_sequences=3).plan_for(1024)
    assert isinstance(capped, RolloutDecision) and capped.max_concurrent_sequences == 3


def test_rollout_infeasible_and_engine_tensor_parallelism() -> None:
    shape = ModelShape.from_hf(LLAMA_8B)
    one = RolloutSelector(shape, PoolBudget(1, 18 << 30), dtype_bytes=2).initial(32768)
    assert isinstance(one, Infeasible)
    assert "one 32768-token sequence does not fit" in one.message and "tensor-parallel size of >= 2" in one.message
    # With 4 devices the KV of long sequences fits once heads are split; the engine size chosen
    # holds (within 10%, else the smaller engine) the most sequences over all engines: weights
    # replicated per engine cost KV room.
    sel = RolloutSelector(shape, PoolBudget(4, 18 << 30), dtype_bytes=2)
    four = sel.initial(32768)
    assert isinstance(four, RolloutDecision) and four.engine_tp >= 2 and four.replicas == 4 // four.engine_tp
    totals = {tp: (4 // tp) * (sel.kv_capacity_tokens(tp) // 32768) for tp in (1, 2, 4)}
    assert four.replicas * four.max_concurrent_sequences * 1.1 >= max(totals.values())
    assert all(totals[tp] * 1.1 < max(totals.values()) for tp in totals if tp < four.engine_tp)
    # A small model's weights cost little: one engine per device holds more sequences in all.
    tiny = RolloutSelector(ModelShape.from_hf(TINY), PoolBudget(4, 64 * MIB), dtype_bytes=4).initial(1024)
    assert isinstance(tiny, RolloutDecision) and tiny.engine_tp == 1 and tiny.replicas == 4
    one_dev = RolloutSelector(ModelShape.from_hf(TINY), PoolBudget(4, 64 * MIB), dtype_bytes=4, allow_tp=False)
    assert one_dev.plan_for(1024, reason=tiny.reason) == tiny


def test_decisions_serialise_and_are_deterministic(tiny: ModelShape) -> None:
    budget = PoolBudget(4, 900 * MIB, reserve_bytes=30 * MIB)
    runs = []
    for _ in range(2):
        sel = TrainerSelector(tiny, budget, base=EAGER, thresholds=FAST)
        runs.append([d.to_dict() for d in feed(sel, growing(400, 3000, 300, seed=9))])
    assert runs[0] == runs[1] and len(runs[0]) >= 3
    for d in runs[0]:
        again = PlanDecision.from_dict(json.loads(json.dumps(d)))
        assert again.to_dict() == d
    json.dumps(sel.to_dict())
    restored = TrainerSelector(tiny, budget, base=EAGER, thresholds=FAST)
    restored.restore(PlanDecision.from_dict(runs[0][-1]))
    assert restored.version == len(runs[0])
    rd = RolloutSelector(tiny, PoolBudget(1, 64 * MIB)).plan_for(1024)
    assert isinstance(rd, RolloutDecision) and RolloutDecision.from_dict(json.loads(json.dumps(rd.to_dict()))) == rd


def test_bad_thresholds_and_budgets_are_refused(tiny: ModelShape) -> None:
    with pytest.raises(ConfigError, match="re-plans down at once"):
        Thresholds(lower_factor=0.45)
    with pytest.raises(ConfigError, match="re-plans up at once"):
        Thresholds(upper_factor=0.7)
    with pytest.raises(ConfigError, match="lower_factor"):
        Thresholds(lower_factor=0.95)
    assert Thresholds(percentile="max").percentile is Percentile.MAX  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="choose one of"):
        Thresholds(percentile="p95")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="devices"):
        PoolBudget(0, 1 << 30)
    with pytest.raises(ConfigError, match="selective"):
        TrainerSelector(tiny, PoolBudget(1, 1 << 30), base=EAGER, recomputes=(Recompute.SELECTIVE,))


def test_selector_plans_allow_list_pins_layouts_and_recomputation(tiny: ModelShape) -> None:
    """`selector.plans` (TrainerSelector `only`): the selector chooses among the named layouts alone, the
    others are refused with the reason, and `+rc` pins full recomputation."""
    from earl_stream.supervisor.selector import layout_name

    budget = PoolBudget(devices=2, memory_bytes_per_device=2000 * MIB, reserve_bytes=50 * MIB)
    free = TrainerSelector(tiny, budget, base=EAGER, thresholds=FAST)
    pinned = TrainerSelector(tiny, budget, base=EAGER, thresholds=FAST, only=["fsdp2+rc"])
    d = pinned.initial(512)
    assert isinstance(d, PlanDecision) and layout_name(d.plan) == "fsdp2+rc" and d.to_wire().name == "fsdp2"
    assert {layout_name(p) for p in pinned.layouts(512)} == {"fsdp2+rc"}
    assert any(r.reason == "not among selector.plans" and r.plan == "dp2" for r in pinned.refused)
    assert isinstance(free.initial(512), PlanDecision) and len(free.layouts(512)) > 1
    # a pinned layout the model cannot take (SmolLM2's 9 heads on tp2) says why, not what some other plan needs
    nine = dataclasses.replace(tiny, num_heads=9, num_kv_heads=3)
    bad = TrainerSelector(nine, budget, base=EAGER, thresholds=FAST, only=["tp2", "tp2+rc"]).initial(512)
    assert isinstance(bad, Infeasible)
    assert "selector.plans=tp2|tp2+rc" in bad.message and "tp2:" in bad.message and "head" in bad.message, bad.message


def test_a_faster_layout_that_holds_the_headroom_but_not_the_power_of_two_is_taken(tiny: ModelShape) -> None:
    """EARL's hysteresis rounds the design length up to a power of two; a layout that holds 1.25 x p99
    (the headroom) but not that power of two is still ranked, at the longest length it holds, and wins
    when it is the fastest. Micro-batch budgets are ranked at the rows a step really gives a rank."""
    base = dataclasses.replace(EAGER, attention=Attention.FLASH)
    probe = TrainerSelector(tiny, PoolBudget(2, 4000 * MIB), base=base, thresholds=FAST, step_sequences=2)
    layouts = {p.fsdp: p for p in probe.layouts(4096) if p.recompute is Recompute.NONE and p.tp == p.sp == 1}
    need = {fsdp: predict_train_memory(tiny, dataclasses.replace(p, seq_len=3008)).total_bytes
            for fsdp, p in layouts.items()}
    assert need[True] < need[False]
    # dp2 holds 3008 tokens but not 4096; fsdp2 would hold more, dp2 is faster (no gathers)
    budget = PoolBudget(2, need[False] + 1 * MIB)
    sel = TrainerSelector(tiny, budget, base=base, thresholds=FAST, step_sequences=2,
                          recomputes=(Recompute.NONE,), allow_tp=False, allow_sp=False)
    assert micro_batch_tokens(tiny, layouts[False], budget) < 4096
    decisions = feed(sel, [2400] * 20)  # p99 2400 -> headroom 3000, power of two 4096
    d = decisions[-1]
    assert isinstance(d, PlanDecision) and not d.plan.fsdp, d.reason
    assert 3008 <= d.design_seq_len < 4096 and "holds" in d.reason
    assert d.plan.micro_batch == 1  # 2 sequences a step over 2 data ranks: one row each, whatever the budget
    # with the headroom itself out of dp2's reach, fsdp2 is the plan
    tight = TrainerSelector(tiny, PoolBudget(2, (need[False] + need[True]) // 2), base=base, thresholds=FAST,
                            step_sequences=2, recomputes=(Recompute.NONE,), allow_tp=False, allow_sp=False)
    d2 = feed(tight, [2400] * 20)[-1]
    assert isinstance(d2, PlanDecision) and d2.plan.fsdp and d2.design_seq_len >= 3008


def test_an_oom_replan_keeps_a_design_the_layout_holds_although_it_is_no_multiple_of_64(
        tiny: ModelShape, monkeypatch: pytest.MonkeyPatch) -> None:
    # every layout holds at most 216 tokens in one micro-batch: the design (1024) is rounded down to 192, below the
    # step's longest row (200) that the layouts do hold; the re-plan must keep 200, not refuse the rows
    import earl_stream.supervisor.selector as selector_module

    sel = TrainerSelector(tiny, PoolBudget(1, 4096 * MIB), base=EAGER, thresholds=FAST)
    first = sel.initial(1024)
    assert isinstance(first, PlanDecision) and first.design_seq_len == 1024
    monkeypatch.setattr(selector_module, "micro_batch_tokens", lambda *a, max_tokens, **k: min(216, max_tokens))
    d = sel.replan_after_oom(200, step=3, reason="oom")
    assert isinstance(d, PlanDecision), d
    assert d.design_seq_len == 200 and d.micro_batch_tokens >= 200


def test_dynamic_sp_plans_hold_rows_as_shared_micro_batches(tiny: ModelShape) -> None:
    """Under trainer.dynamic_sp_tokens a dp/FSDP layout holds a row that does not fit one rank, as long as it fits
    split over the data ranks (sp = 2) and every row up to the threshold fits one rank; its predicted peak is the
    shared row's when that is the larger."""
    budget = PoolBudget(2, 60 * MIB)  # under flash attention, what one rank holds grows linearly with the row
    only_dp = dict(allow_tp=False, allow_sp=False)
    assert isinstance(TrainerSelector(tiny, budget, base=FLASH, **only_dp).initial(4096), Infeasible)
    sel = TrainerSelector(tiny, budget, base=FLASH, dynamic_sp_tokens=512, **only_dp)
    d = sel.initial(4096)
    assert isinstance(d, PlanDecision) and d.design_seq_len == 4096
    assert d.plan.sp == d.plan.tp == 1 and d.plan.dp == 2 and d.micro_batch_tokens < 4096
    shared = dataclasses.replace(d.plan, dp=1, sp=2, micro_batch=1, seq_len=4096)
    assert check_fit(tiny, shared, budget.memory_bytes_per_device).fits
    bound = dataclasses.replace(d.plan, micro_batch=1, seq_len=d.micro_batch_tokens)
    assert d.predicted_peak_bytes == max(predict_train_memory(tiny, p).total_bytes for p in (shared, bound))
    one_rank = dataclasses.replace(d.plan, micro_batch=1, seq_len=512)  # the longest row trained on one rank
    assert check_fit(tiny, one_rank, budget.memory_bytes_per_device).fits
    # a threshold above what one rank holds: the rows between would not fit there, so nothing is shared
    too_high = TrainerSelector(tiny, budget, base=FLASH, dynamic_sp_tokens=3000, **only_dp)
    assert isinstance(too_high.initial(4096), Infeasible)


def test_plans_are_ranked_by_the_whole_step_they_run_not_by_one_full_micro_batch() -> None:
    """A step of 8 sequences under a budget of 7 rows runs a micro-batch of 7 and one of 1, paying the
    per-micro-batch costs twice: scored per micro-batch (as if both were full) sp2 beat tp2 on the 8-head real-scale
    model at 128 tokens, which the calibration measured 1.5x slower (bench/results/cost_model_heads8.json)."""
    from earl_stream.supervisor.cost_model import StepCostModel

    heads8 = ModelShape.from_hf({"model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30,
                                 "num_attention_heads": 8, "num_key_value_heads": 4, "intermediate_size": 1536,
                                 "vocab_size": 49152, "tie_word_embeddings": True, "head_dim": 72})
    cpu = StepCostModel(seconds_per_flop=1.294e-11, seconds_per_byte=2.156e-9, seconds_per_score=5e-12,
                        fixed_seconds=0.7036, step_fixed_seconds=1.1303, seconds_per_collective=0.0,
                        seconds_per_fsdp_repeat_byte=3.871e-9)
    from earl_stream.supervisor.memory_model import LOGIT_COPIES_EARL_VOCAB_PARALLEL

    base = TrainPlan(1, 128, logit_copies=LOGIT_COPIES_EARL_VOCAB_PARALLEL, published_versions=2)  # as planning's
    sel = TrainerSelector(heads8, PoolBudget(2, 4608 * MIB, 717 * MIB), base=base, cost_model=cpu, step_sequences=8)
    d = sel.initial(128)
    assert isinstance(d, PlanDecision)
    micro_batches = -(-8 // (d.plan.dp * d.plan.micro_batch))
    full, rest = divmod(-(-8 // d.plan.dp), d.plan.micro_batch)
    runs = [d.plan] * full + ([dataclasses.replace(d.plan, micro_batch=rest)] if rest else [])
    assert len(runs) == micro_batches
    step_tokens = d.plan.dp * -(-8 // d.plan.dp) * 128
    assert d.predicted_tokens_per_s == pytest.approx(step_tokens / cpu.predict_step(heads8, runs) * sel._fill(d.plan.micro_batch))
    assert (d.plan.tp, d.plan.sp) == (2, 1) and d.plan.micro_batch == 8  # one micro-batch of the whole step
