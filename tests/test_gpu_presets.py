"""The GPU presets (configs/gpu_single.yaml, configs/gpu_node.yaml) checked without a GPU and without the
network: every field exists and validates, the model is a well-formed Hub id, trainer and engine say cuda
and bf16, the environment builds and poses a question, and the memory budgets hold a first plan for the
model's real shape (its config.json values written here; no weights). scripts/gpu-check.sh refuses a
machine without CUDA. What no CPU can check (a run on the GPU) is scripts/gpu-check.sh's.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from earl_stream.config import RunConfig, load_config, replace
from earl_stream.env.registry import resolve_env
from earl_stream.model.hub import is_hub_id
from earl_stream.model.tiny_families import init_family_model
from earl_stream.supervisor.planning import Planner

ROOT = Path(__file__).resolve().parents[1]
# the Hub config.json values that size memory (Qwen/Qwen3-1.7B, Qwen/Qwen3-8B)
SHAPES: dict[str, dict[str, Any]] = {
    "Qwen/Qwen3-1.7B": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                            num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "Qwen/Qwen3-8B": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                          num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False),
}
PRESETS = {"gpu_single": ("Qwen/Qwen3-1.7B", 1), "gpu_node": ("Qwen/Qwen3-8B", 4)}


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a preset that needed the network to validate would fail here


def _preset(name: str) -> Path:
    return ROOT / "configs" / f"{name}.yaml"


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_validates_as_written(name: str) -> None:
    cfg = load_config(_preset(name))
    model, nproc = PRESETS[name]
    assert cfg.model.path == model and is_hub_id(cfg.model.path)
    assert (cfg.trainer.device, cfg.trainer.dtype) == ("cuda", "bf16")
    assert (cfg.rollout.device, cfg.rollout.dtype, cfg.rollout.engine) == ("cuda", "bf16", "torch")
    assert cfg.trainer.nproc == nproc and cfg.selector.enabled and cfg.selector.attention == "flash"
    assert cfg.selector.trainer_memory_bytes > 0, "the default (host RAM / 4) knows nothing of the GPU"


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_validates_with_a_local_model(name: str, tmp_path: Path) -> None:
    """The model-dependent checks pass with a local Qwen3 in place of the Hub id (as scripts/gpu-check.sh runs)."""
    tiny = init_family_model(tmp_path / "qwen3", family="qwen3")
    cfg = load_config(_preset(name), [f"model.path={tiny}"])
    assert cfg.model.path == str(tiny)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_environment_poses_a_question(name: str) -> None:
    cfg = load_config(_preset(name))
    for spec in cfg.envs:
        env = resolve_env(spec.spec)(**spec.params)
        obs = asyncio.run(env.reset(seed=3))
        assert obs, f"{spec.display_name}: an empty first observation"


def _planner(cfg: RunConfig, tmp_path: Path) -> Planner:
    folder = tmp_path / "shape"
    folder.mkdir()
    transformers.Qwen3Config(max_position_embeddings=40960, **SHAPES[cfg.model.path]).to_json_file(
        folder / "config.json")
    return Planner(replace(cfg, f"model.path={folder}"))


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_budgets_hold_a_first_plan(name: str, tmp_path: Path) -> None:
    """The trainer and rollout budgets of the preset fit the real model's shape at the initial design length
    (the memory model's verdict; the GPU itself is scripts/gpu-check.sh's)."""
    cfg = load_config(_preset(name))
    planner = _planner(cfg, tmp_path)
    assert planner.trainer_plan is not None and planner.rollout_plan is not None
    assert planner.trainer_plan.micro_batch_tokens >= cfg.selector.initial_seq_len
    assert planner.max_trainable_tokens > max(e.params["max_turn_tokens"] for e in cfg.envs)
    assert planner.rollout_plan.max_concurrent_sequences >= cfg.trainer.group_size


def test_gpu_check_refuses_a_machine_without_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present: this tests the refusal where there is none")
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-check.sh")], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PY": sys.executable})
    assert done.returncode == 2, done.stderr
    assert "sees no CUDA GPU" in done.stderr
