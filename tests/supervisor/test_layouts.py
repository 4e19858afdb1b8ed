"""The layouts a trainer pool can run a model under, and the refusals: a tensor/sequence-parallel size
the model cannot take, or a pool size that is not a multiple of it, is excluded by the selector with a
reason (logged once, listed in `TrainerSelector.refused`), never offered to a rank."""

from __future__ import annotations

import logging

import pytest

from earl_stream.supervisor.decisions import PlanDecision, Refusal
from earl_stream.supervisor.fitting import fitting_plans
from earl_stream.supervisor.layouts import pool_layouts
from earl_stream.supervisor.memory_model import Attention, ModelShape, Recompute, TrainPlan
from earl_stream.supervisor.selector import MIB, PoolBudget, TrainerSelector

# divisible every way up to 4 (heads 8, kv 4, vocab/intermediate/hidden even)
EVEN = {"model_type": "llama", "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 8,
        "num_key_value_heads": 4, "intermediate_size": 512, "vocab_size": 1024}
# HuggingFaceTB/SmolLM2-135M's shape (FACTS.md): 9 heads, 3 kv heads
SMOLLM2 = {"model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
           "num_key_value_heads": 3, "intermediate_size": 1536, "vocab_size": 49152, "tie_word_embeddings": True}
BASE = TrainPlan(1, 1, attention=Attention.EAGER)
BOTH = (Recompute.NONE, Recompute.FULL)


def _names(plans: list[TrainPlan]) -> set[str]:
    out = set()
    for p in plans:
        data = {"dp": 1 if p.fsdp else p.dp, "fsdp": p.dp if p.fsdp else 1, "tp": p.tp, "sp": p.sp}
        out.add("_".join(f"{k}{v}" for k, v in data.items() if v > 1) or "dp1")
    return out


def test_layout_problems_name_every_dimension_that_does_not_divide() -> None:
    shape = ModelShape.from_hf(SMOLLM2)
    assert shape.layout_problems(1, 1) == [] and shape.layout_problems(1, 3) == []
    assert shape.layout_problems(2) == ["num_attention_heads=9 is not divisible by tp*sp=2",
                                        "num_key_value_heads=3 is not divisible by tp=2"]
    # (transformers itself refuses a hidden size that the heads do not divide)
    odd = ModelShape.from_hf({**EVEN, "vocab_size": 1023, "intermediate_size": 514})
    assert odd.layout_problems(2) == ["vocab_size=1023 is not divisible by tp=2"]
    assert odd.layout_problems(4) == ["vocab_size=1023 is not divisible by tp=4", "intermediate_size=514 is not "
                                      "divisible by tp=4"]
    assert ModelShape.from_hf(EVEN).layout_problems(2, 4) == []  # Ulysses repeats kv heads it cannot split


def test_four_ranks_consider_every_combination_the_plan_can_express() -> None:
    plans, refused = pool_layouts(ModelShape.from_hf(EVEN), BASE, 4, 1024, recomputes=BOTH)
    assert refused == []
    assert _names(plans) == {"dp4", "fsdp4", "dp2_sp2", "fsdp2_sp2", "dp2_tp2", "fsdp2_tp2", "tp2_sp2", "sp4", "tp4"}
    assert all(p.devices == 4 and p.micro_batch == 1 and p.seq_len == 1024 for p in plans)
    assert not any(p.fsdp and p.dp == 1 for p in plans)  # FSDP over the sp ranks alone is no trainer plan
    assert len(plans) == 2 * len(_names(plans))  # each with and without recomputation
    only_dp, _ = pool_layouts(ModelShape.from_hf(EVEN), BASE, 4, 1024, recomputes=BOTH, allow_tp=False,
                              allow_sp=False, allow_fsdp=False)
    assert _names(only_dp) == {"dp4"}


def test_a_model_that_cannot_be_split_is_refused_with_the_reason() -> None:
    plans, refused = pool_layouts(ModelShape.from_hf(SMOLLM2), BASE, 4, 1024, recomputes=BOTH)
    assert _names(plans) == {"dp4", "fsdp4"}
    assert refused == [
        Refusal("sp2", "num_attention_heads=9 is not divisible by tp*sp=2"),
        Refusal("sp4", "num_attention_heads=9 is not divisible by tp*sp=4"),
        Refusal("tp2", "num_attention_heads=9 is not divisible by tp*sp=2; num_key_value_heads=3 is not divisible by tp=2"),
        Refusal("tp2_sp2", "num_attention_heads=9 is not divisible by tp*sp=4; num_key_value_heads=3 is not divisible "
                           "by tp=2"),
        Refusal("tp4", "num_attention_heads=9 is not divisible by tp*sp=4; num_key_value_heads=3 is not divisible by tp=4"),
    ]


def test_a_pool_size_the_plan_does_not_fit_is_refused() -> None:
    plans, refused = pool_layouts(ModelShape.from_hf(EVEN), BASE, 6, 1024, recomputes=(Recompute.NONE,))
    assert _names(plans) == {"dp6", "fsdp6", "dp3_sp2", "fsdp3_sp2", "dp3_tp2", "fsdp3_tp2"}
    assert [r.plan for r in refused] == ["sp4", "tp2_sp2", "tp4"]
    assert all(r.reason == "a pool of 6 ranks is not a multiple of tp*sp=4" for r in refused)


def test_the_selector_never_picks_a_refused_layout_and_logs_it_once(caplog: pytest.LogCaptureFixture) -> None:
    shape = ModelShape.from_hf(SMOLLM2)
    sel = TrainerSelector(shape, PoolBudget(2, 4096 * MIB), base=BASE)
    caplog.set_level(logging.INFO, logger="earl_stream.supervisor.selector")
    decisions = [sel.plan_for(n) for n in (256, 512, 1024, 2048)]
    for d in decisions:
        assert isinstance(d, PlanDecision) and d.plan.tp == 1 and d.plan.sp == 1
    assert [r.plan for r in sel.refused] == ["sp2", "tp2"]
    refusals = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert refusals == ["trainer: layout sp2 refused: num_attention_heads=9 is not divisible by tp*sp=2",
                        "trainer: layout tp2 refused: num_attention_heads=9 is not divisible by tp*sp=2; "
                        "num_key_value_heads=3 is not divisible by tp=2"]


def test_advice_names_only_layouts_the_trainer_can_run() -> None:
    smol, even = ModelShape.from_hf(SMOLLM2), ModelShape.from_hf(EVEN)
    fits = fitting_plans(smol, TrainPlan(1, 1024), 4, 1 << 40)
    assert fits and all(f.plan.tp == 1 and f.plan.sp == 1 for f in fits)
    fits = fitting_plans(even, TrainPlan(1, 1024), 4, 1 << 40)
    assert {(f.plan.tp, f.plan.sp) for f in fits} == {(1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (4, 1)}
    assert not any(f.plan.fsdp and f.plan.dp == 1 for f in fits)
