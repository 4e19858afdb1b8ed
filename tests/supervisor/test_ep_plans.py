"""Expert parallelism as a plan dimension of the selector: the ep layouts of a mixture-of-experts model
(and only of one), their names (`ep2`, `fsdp2_ep2`, as the trainer and `selector.plans` name them), the
refusal of ep degrees the expert count does not divide, what the memory model counts (E/ep experts per
device, the dispatch buffers) and the cost model (active parameters for compute, the all-to-alls), the
wire plan the trainer receives, and `selector.plans` / `selector.allow_ep` at config load."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from earl_stream.errors import ConfigError
from earl_stream.supervisor.cost_model import plan_features
from earl_stream.supervisor.decisions import PlanDecision, Refusal
from earl_stream.supervisor.layouts import pool_layouts
from earl_stream.supervisor.memory_model import Attention, ModelShape, Phase, Recompute, TrainPlan, expert_params, predict_train_memory
from earl_stream.supervisor.selector import MIB, PoolBudget, TrainerSelector, layout_name
from earl_stream.workers.mesh import RankPlan

MOE = {"model_type": "qwen3_moe", "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8,
       "num_key_value_heads": 4, "head_dim": 32, "intermediate_size": 512, "moe_intermediate_size": 128,
       "num_experts": 8, "num_experts_per_tok": 2, "vocab_size": 1024, "norm_topk_prob": True}
DENSE = {"model_type": "llama", "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 8,
         "num_key_value_heads": 4, "intermediate_size": 512, "vocab_size": 1024}
BASE = TrainPlan(1, 1, attention=Attention.EAGER)
BOTH = (Recompute.NONE, Recompute.FULL)


def test_ep_layouts_of_a_moe_model_and_their_names() -> None:
    plans, refused = pool_layouts(ModelShape.from_hf(MOE), BASE, 4, 1024, recomputes=BOTH, allow_ep=True)
    names = {layout_name(p) for p in plans}
    assert {"ep4", "dp2_ep2", "fsdp2_ep2", "dp2_ep2+rc", "ep4+rc", "dp4", "fsdp4"} <= names, names
    assert "fsdp1_ep4" not in names and not any("ep" in n and ("tp" in n or "sp" in n) for n in names)
    assert all(r.plan.startswith(("tp", "sp")) for r in refused)  # expert blocks: tp / sp refused, ep not
    without, _ = pool_layouts(ModelShape.from_hf(MOE), BASE, 4, 1024, recomputes=BOTH, allow_ep=False)
    assert not any(p.ep > 1 for p in without)
    dense, refused = pool_layouts(ModelShape.from_hf(DENSE), BASE, 4, 1024, recomputes=BOTH, allow_ep=True)
    assert not any(p.ep > 1 for p in dense) and not any("ep" in r.plan for r in refused)


def test_an_ep_degree_the_experts_do_not_divide_is_refused_with_the_reason() -> None:
    plans, refused = pool_layouts(ModelShape.from_hf({**MOE, "num_experts": 6}), BASE, 4, 1024, recomputes=BOTH,
                                  allow_ep=True)
    assert Refusal("ep4", "ep=4 does not divide the 6 experts per layer") in refused
    assert {p.ep for p in plans} == {1, 2}
    with pytest.raises(ConfigError, match="ep=4 needs a mixture-of-experts model"):
        predict_train_memory(ModelShape.from_hf({**MOE, "num_experts": 6}), dataclasses.replace(BASE, dp=4, ep=4))


def test_memory_model_counts_experts_per_rank_and_dispatch_buffers() -> None:
    shape = ModelShape.from_hf(MOE)
    plan = dataclasses.replace(BASE, micro_batch=1, seq_len=512, dp=2, attention=Attention.FLASH)
    dp2, ep2 = predict_train_memory(shape, plan), predict_train_memory(shape, dataclasses.replace(plan, ep=2))
    experts = expert_params(shape)
    assert experts == 4 * 8 * 3 * 256 * 128
    assert dp2.weights_bytes - ep2.weights_bytes == pytest.approx(experts / 2 * 4, abs=2)  # fp32: E/ep per rank
    assert dp2.optimizer_bytes - ep2.optimizer_bytes == pytest.approx(experts / 2 * 8, abs=2)
    # the dispatch buffers (tokens x top_k x hidden, sent, received, computed, returned) of the layer backward
    small_vocab = ModelShape.from_hf({**MOE, "vocab_size": 64})  # the layer backward is the peak, not the loss
    long = dataclasses.replace(plan, seq_len=4096, attention=Attention.EAGER)
    dp2_b, ep2_b = (predict_train_memory(small_vocab, dataclasses.replace(long, ep=ep)) for ep in (1, 2))
    assert ep2_b.peak_phase is Phase.LAYER_BACKWARD and dp2_b.peak_phase is Phase.LAYER_BACKWARD
    assert ep2_b.transient_bytes - dp2_b.transient_bytes == pytest.approx(4 * 4 * 4096 * 2 * 256, abs=2)
    # FSDP shards the rest over every data rank and leaves the experts to ep
    fsdp, fsdp_ep = (predict_train_memory(shape, dataclasses.replace(plan, dp=4, fsdp=True, ep=ep)) for ep in (1, 2))
    assert fsdp_ep.weights_bytes - fsdp.weights_bytes == pytest.approx((experts / 2 - experts / 4) * 4, abs=4)


def test_cost_model_computes_with_active_experts_and_pays_the_all_to_alls() -> None:
    shape = ModelShape.from_hf(MOE)
    plan = dataclasses.replace(BASE, micro_batch=1, seq_len=1024, dp=2)
    dp2, ep2 = plan_features(shape, plan), plan_features(shape, dataclasses.replace(plan, ep=2))
    assert dp2.flops == ep2.flops  # the same tokens through the same (active) experts
    total = shape.num_layers * shape.layer_matrix_params() + shape.vocab_size * shape.hidden_size
    active = shape.num_layers * shape.layer_matrix_params(active=True) + shape.vocab_size * shape.hidden_size
    assert active < total and dp2.flops < 2 * total * 1024 * 3  # compute follows the top_k experts, not all 8
    a2a = 4 * 4 * 1024 * 2 * 256 * 4 * (1 / 2)  # 4 MoE layers x 4 all-to-alls x n k h e x (ep-1)/ep
    sync_saved = expert_params(shape) * 4 * 2 * (1 / 2)  # the experts' grads are not all-reduced (one copy each)
    assert ep2.comm_bytes - dp2.comm_bytes == pytest.approx(a2a - sync_saved, rel=1e-9)
    assert ep2.collectives - dp2.collectives == 6 * 4


def test_the_wire_plan_and_the_trainer_name_ep_layouts_alike() -> None:
    for plan, name, world in ((dataclasses.replace(BASE, dp=2, ep=2), "ep2", 2),
                              (dataclasses.replace(BASE, dp=4, ep=2, fsdp=True), "fsdp2_ep2", 4),
                              (dataclasses.replace(BASE, dp=4, ep=2), "dp2_ep2", 4)):
        wire = PlanDecision(version=1, pool="trainer", plan=plan, micro_batch_tokens=64, design_seq_len=64,
                            predicted_peak_bytes=1, predicted_tokens_per_s=1.0, reason="t").to_wire()
        rank = RankPlan.from_wire(wire)
        assert layout_name(plan) == wire.name == rank.name == name
        assert wire.world == rank.world == world and rank.data_ranks == world and rank.ep == 2


def test_the_selector_chooses_ep_when_allowed_and_only_for_moe(tmp_path: Path) -> None:
    shape = ModelShape.from_hf(MOE)
    budget = PoolBudget(devices=2, memory_bytes_per_device=4000 * MIB)
    sel = TrainerSelector(shape, budget, base=BASE, allow_ep=True, only=["ep2"])
    d = sel.initial(512)
    assert isinstance(d, PlanDecision) and d.plan.ep == 2 and d.to_wire().name == "ep2"
    assert Refusal("dp2", "not among selector.plans") in sel.refused


def test_selector_plans_with_ep_are_checked_at_config_load(tmp_path: Path) -> None:
    from earl_stream.config import load_config

    moe = tmp_path / "moe"
    moe.mkdir()
    (moe / "config.json").write_text(json.dumps({**MOE, "num_experts": 6}))
    assert load_config(None, [f"model.path={moe}", "selector.plans=ep2|fsdp2_ep2|dp2"]).selector.allow_ep
    with pytest.raises(ConfigError, match="ep4 does not divide the 6 experts"):
        load_config(None, [f"model.path={moe}", "selector.plans=ep4|ep2"])
    with pytest.raises(ConfigError, match="embedded default model is dense"):
        load_config(None, ["selector.plans=ep2"])
    dense = tmp_path / "dense"
    dense.mkdir()
    (dense / "config.json").write_text(json.dumps(DENSE))
    with pytest.raises(ConfigError, match="is dense"):
        load_config(None, [f"model.path={dense}", "selector.plans=fsdp2_ep2"])
    with pytest.raises(ConfigError, match="not layout names"):
        load_config(None, [f"model.path={moe}", "selector.plans=ep"])
