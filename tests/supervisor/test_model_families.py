"""The model's shape read from the model itself: every tiny family of `model.tiny_families` and
`model.tiny_moe` gets a shape whose parameters are the real model's, exactly; the memory model predicts one
real CPU training step of each within 5% (measured as bench/memory_model.py (b) does, in one fresh process,
`family_step_peak.py`); a model type no code names gets a shape and trainer plans; layouts the trainer
cannot lay a family out in are refused with the reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from earl_stream.model.tiny_families import FAMILIES, init_family_model
from earl_stream.model.tiny_moe import MOE_FAMILIES, init_moe_model
from earl_stream.supervisor.decisions import PlanDecision
from earl_stream.supervisor.memory_model import Attention, Precision, TrainPlan, predict_train_memory
from earl_stream.supervisor.model_shape import ModelShape
from earl_stream.supervisor.selector import PoolBudget, TrainerSelector, layout_name

ALL = (*FAMILIES, *MOE_FAMILIES)
SEQ_LEN, MICRO_BATCH = 512, 2
SIZES = dict(hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2)
MIB = 1 << 20


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    out = {}
    for family in ALL:
        if family in MOE_FAMILIES:
            out[family] = init_moe_model(root / family, family=family, expert_size=256, **SIZES)
        else:
            out[family] = init_family_model(root / family, family=family, intermediate_size=512, **SIZES)
    return out


@pytest.fixture(scope="module")
def measured(model_dirs: dict[str, Path]) -> dict[str, dict[str, Any]]:
    """One real training step of every family, one after the other in one fresh process."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
    script = Path(__file__).with_name("family_step_peak.py")
    res = subprocess.run([sys.executable, str(script), str(SEQ_LEN), str(MICRO_BATCH),
                          *[str(model_dirs[f]) for f in ALL]], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    return {f: r for f, r in zip(ALL, rows, strict=True)}


def _shape(model_dir: Path) -> ModelShape:
    return ModelShape.from_hf(json.loads((model_dir / "config.json").read_text()))


@pytest.mark.parametrize("family", ALL)
def test_shape_counts_the_real_parameters_and_states_exactly(family: str, model_dirs: dict[str, Path],
                                                             measured: dict[str, dict[str, Any]]) -> None:
    from transformers import AutoConfig

    shape = _shape(model_dirs[family])
    real = measured[family]
    assert shape.num_params() == real["num_parameters"]
    assert ModelShape.from_hf(AutoConfig.from_pretrained(model_dirs[family])) == shape  # a config object: the same
    fp32 = predict_train_memory(shape, TrainPlan(1, 16, precision=Precision.FP32))
    assert (fp32.weights_bytes, fp32.gradients_bytes, fp32.optimizer_bytes) == (
        real["weights_bytes"], real["gradients_bytes"], real["optimizer_bytes"])


@pytest.mark.parametrize("family", ALL)
def test_one_training_step_is_predicted_within_5_percent(family: str, model_dirs: dict[str, Path],
                                                         measured: dict[str, dict[str, Any]]) -> None:
    shape, real = _shape(model_dirs[family]), measured[family]
    predicted = predict_train_memory(shape, TrainPlan(MICRO_BATCH, SEQ_LEN, attention=Attention.EAGER))
    states = real["weights_bytes"] + real["gradients_bytes"] + real["optimizer_bytes"]
    peak = states + real["step_bytes"]
    assert abs(predicted.total_bytes - peak) / peak < 0.05, (predicted, real)
    # the step alone (activations, logits, transients) too, though RSS adds ~1.5 MiB of its own
    assert abs(predicted.dynamic_bytes - real["step_bytes"]) / real["step_bytes"] < 0.05, (predicted, real)


def test_family_quirks_are_read_as_data(model_dirs: dict[str, Path]) -> None:
    gemma, phi3, olmo2, qwen3 = (_shape(model_dirs[f]) for f in ("gemma3_text", "phi3", "olmo2", "qwen3"))
    assert (gemma.sliding_window, gemma.sliding_layers, gemma.pre_norms, gemma.post_norms) == (16, 1, 2, 2)
    assert gemma.qk_norm and gemma.head_dim == 32 and gemma.num_heads * gemma.head_dim != gemma.hidden_size
    assert phi3.fused_qkv and phi3.fused_gate_up and phi3.intermediate_size == 512
    assert (olmo2.pre_norms, olmo2.post_norms) == (0, 2) and olmo2.qk_norm
    assert qwen3.head_dim == 48 and qwen3.qk_norm
    for family in FAMILIES:  # the tiny families set nothing the memory model does not interpret
        shape = _shape(model_dirs[family])
        assert not shape.calibrate, (family, shape.quirks)
        assert shape.layout_problems(2) == [] and shape.layout_problems(1, 2) == [], family


def test_lora_params_follow_the_modules_names(model_dirs: dict[str, Path]) -> None:
    llama, phi3 = _shape(model_dirs["llama"]), _shape(model_dirs["phi3"])
    h, q, kv = 256, 256, 128
    assert llama.lora_params(8, ["q_proj", "v_proj"]) == 2 * 8 * ((h + q) + (h + kv))
    assert phi3.lora_params(8, ["q_proj"]) == 0 and phi3.lora_params(8, ["qkv_proj"]) == 2 * 8 * (h + q + 2 * kv)


def test_a_family_without_a_tensor_parallel_plan_is_refused_tp_with_the_reason() -> None:
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256)
    config.base_model_tp_plan = None
    shape = ModelShape.from_hf(config)
    assert any("no tensor-parallel plan" in p for p in shape.layout_problems(2))
    assert shape.layout_problems(1, 2) == []


@pytest.mark.parametrize("config_class", ["Olmo3Config", "Exaone4Config", "Glm4Config"])
def test_a_model_type_no_code_names_gets_a_shape_and_plans(config_class: str, tmp_path: Path) -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    config = getattr(transformers, config_class)(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                 num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                                 pad_token_id=0, bos_token_id=1, eos_token_id=2)
    config.save_pretrained(tmp_path)
    shape = _shape(tmp_path)
    with torch.device("meta"):
        real = AutoModelForCausalLM.from_config(config)
    assert shape.num_params() == real.num_parameters() and shape.num_layers == 2
    base = TrainPlan(1, 512, attention=Attention.EAGER)
    selector = TrainerSelector(shape, PoolBudget(2, 4096 * MIB), base=base, allow_tp=False, allow_sp=False)
    names = {layout_name(p) for p in selector.layouts(512)}
    assert {"dp2", "fsdp2"} <= names
    assert isinstance(selector.initial(512), PlanDecision)


def test_a_shape_with_quirks_is_calibrated_from_the_first_measured_step() -> None:
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, attention_dropout=0.1)
    shape = ModelShape.from_hf(config)
    assert shape.calibrate and any("attention_dropout" in q for q in shape.quirks)
    selector = TrainerSelector(shape, PoolBudget(1, 1000 * MIB, 100 * MIB), base=TrainPlan(1, 512))
    assert selector.calibrate_memory(1000, 1500) == 1.5
    assert selector.budget.memory_bytes_per_device == 100 * MIB + int(900 * MIB / 1.5)
    assert selector.calibrate_memory(1000, 3000) == 1.5  # once
