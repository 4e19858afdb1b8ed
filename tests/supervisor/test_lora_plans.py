"""The memory and cost models know LoRA (a frozen base: weights only; adapters: weights, gradients and
AdamW state), the selector's plans for a LoRA run follow from that, and it excludes tp for LoRA runs
with the reason in `plans.refused`."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from earl_stream.config import LoraConfig, ModelConfig, RunConfig, SelectorConfig, TrainerConfig
from earl_stream.supervisor.cost_model import StepCostModel
from earl_stream.supervisor.memory_model import ModelShape, TrainPlan, predict_train_memory
from earl_stream.supervisor.planning import Planner

# SmolLM2-135M's shape
SMOL = {"model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
        "num_key_value_heads": 3, "intermediate_size": 1536, "vocab_size": 49152, "tie_word_embeddings": True}
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MIB = 1 << 20


def test_lora_memory_has_no_gradients_or_adam_state_for_the_base() -> None:
    shape = ModelShape.from_hf(SMOL)
    adapters = shape.lora_params(16, TARGETS)
    # per layer: r x (in + out) for q, k, v, o, gate, up, down = 16 x (1152 + 768 + 768 + 1152 + 3 x 2112)
    assert adapters == 30 * 16 * (1152 + 768 + 768 + 1152 + 3 * 2112)
    full = TrainPlan(micro_batch=1, seq_len=512)
    lora = dataclasses.replace(full, lora_params=adapters)
    f, lo = predict_train_memory(shape, full), predict_train_memory(shape, lora)
    assert lo.gradients_bytes == adapters * 4 and lo.optimizer_bytes == adapters * 8
    assert lo.weights_bytes == f.weights_bytes + adapters * 4  # the frozen base is still held, in full
    assert f.static_bytes - lo.static_bytes > 0.7 * shape.num_params() * 12  # no grads + AdamW for the base
    assert lo.total_bytes < f.total_bytes
    cost = StepCostModel()
    assert cost.step_seconds(shape, lora) < cost.step_seconds(shape, full)  # no weight gradients to compute


def _planner(tmp_path: Path, *, lora: bool, memory: int) -> Planner:
    (tmp_path / "config.json").write_text(json.dumps(SMOL))
    cfg = RunConfig(model=ModelConfig(path=str(tmp_path), lora=LoraConfig(enabled=lora, rank=16)),
                    trainer=TrainerConfig(nproc=2, groups_per_step=2, group_size=4),
                    selector=SelectorConfig(context_window=16, initial_seq_len=256, trainer_memory_bytes=memory,
                                            reserve_bytes=0, min_episodes_between=0))
    return Planner(cfg)


def test_selector_excludes_tp_for_lora_runs_and_says_why(tmp_path: Path) -> None:
    planner = _planner(tmp_path, lora=True, memory=8 << 30)
    refused = planner.status()["refused"]
    assert any(r["plan"].startswith("tp") and "LoRA" in r["reason"] for r in refused), refused
    assert planner.trainer_plan is not None and planner.trainer_plan.plan.tp == 1
    assert planner.trainer_plan.plan.lora_params > 0
    full = _planner(tmp_path, lora=False, memory=8 << 30)
    assert not any("LoRA" in r["reason"] for r in full.status()["refused"])


def test_a_lora_run_takes_plans_a_full_fine_tune_cannot(tmp_path: Path) -> None:
    # 1.4 GiB a rank: a replicated full fine-tune of 135M parameters (16 B each with AdamW) does not fit,
    # the frozen base (4 B each) plus adapters does
    shape = ModelShape.from_hf(SMOL)
    budget = 1400 * MIB
    plan = TrainPlan(micro_batch=1, seq_len=256)
    assert predict_train_memory(shape, plan).total_bytes > budget
    lora = dataclasses.replace(plan, lora_params=shape.lora_params(16, TARGETS))
    assert predict_train_memory(shape, lora).total_bytes < budget
    chosen = _planner(tmp_path, lora=True, memory=budget).trainer_plan
    assert chosen is not None and not chosen.plan.fsdp  # replicated: no need to shard a frozen base


def test_a_lora_switch_moves_adam_state_of_the_adapters_only() -> None:
    from earl_stream.supervisor.switch_memory import predict_switch

    shape = ModelShape.from_hf(SMOL)
    dp2, fsdp2 = TrainPlan(micro_batch=1, seq_len=256, dp=2), TrainPlan(micro_batch=1, seq_len=256, dp=2, fsdp=True)
    adapters = shape.lora_params(16, TARGETS)
    full = predict_switch(shape, dp2, fsdp2, 64 * MIB)
    lora = predict_switch(shape, *(dataclasses.replace(p, lora_params=adapters) for p in (dp2, fsdp2)), 64 * MIB)
    # before: the whole model with AdamW (12 B a parameter) against the base (4 B) + adapters (12 B)
    assert full.before_bytes == shape.num_params() * 12
    assert lora.before_bytes == shape.num_params() * 4 + adapters * 12
    assert lora.peak_bytes < full.peak_bytes / 2
