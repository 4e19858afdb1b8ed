"""The models users start from, trained for real by `earl-stream up` with the selector on (its default).

Each named dense family trains a few steps: Llama 3 (its rope scaling), Qwen3 (q/k norms,
free head_dim), Mistral, Gemma 3 text (sliding windows, the Hugging Face forward in the engine), Phi-3 (fused
projections), SmolLM3 (layers without rotary embeddings); Qwen2.5 is the architecture of the default tiny model
(Qwen2ForCausalLM), which every other run of `up` trains; of the mixtures of experts Mixtral trains
here (Qwen3-MoE with routing replay is tests/test_moe_live.py's).
A model type no code of earl_stream names (GLM-4, built here from its transformers config) trains
under both plans, dp2 and fsdp2. The math of every family under
every plan is tests/test_families_parallel.py's; the engine's output per family is
tests/workers/engines/test_families.py's; the memory model's per family is
tests/supervisor/test_model_families.py's.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.live]


def _up(tmp_path: Path, model_dir: Path, *extra: str) -> tuple[dict, str]:
    summary = tmp_path / "s.json"
    cmd = [sys.executable, "-m", "earl_stream", "up", "--steps", "2", "--summary", str(summary),
           f"model.path={model_dir}", f"run_dir={tmp_path / 'run'}", "trainer.groups_per_step=2",
           "trainer.group_size=4", "rollout.groups_in_flight=2", "rollout.workers=1", "supervisor.heartbeat_s=0.2",
           *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    logs = tmp_path / "run" / "logs"
    supervisor_log = (logs / "supervisor.log").read_text() if (logs / "supervisor.log").exists() else ""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + supervisor_log[-3000:]
    return json.loads(summary.read_text()), supervisor_log


def _trained(summary: dict) -> None:
    assert summary["policy_version"] >= 2 and summary["samples_trained"] >= 2 * 2 * 4, summary
    assert summary["samples_lost"] == 0, summary


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral", "gemma3_text", "phi3", "smollm3"])
def test_a_family_trains_with_the_selector_on(tmp_path: Path, family: str) -> None:
    from earl_stream.model.tiny_families import init_family_model

    model_dir = init_family_model(tmp_path / family, family=family)
    summary, log = _up(tmp_path, model_dir)
    _trained(summary)
    assert "selector off" not in log, log[-3000:]
    assert "trainer pool adopted plan" in log, log[-3000:]
    rollout = "".join(p.read_text() for p in (tmp_path / "run" / "logs").glob("rollout-*.log"))
    path = "the Hugging Face forward" if family == "gemma3_text" else "the fast decoder"
    assert f"engine: {family} uses {path}" in rollout, rollout[-3000:]


@pytest.fixture(scope="module")
def unnamed_model_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """A GLM-4 (model_type glm4: fused gate-up MLP, post-attention and post-MLP norms, partial rotary
    embeddings), a type no module of earl_stream names, with the tiny model's tokenizer."""
    import torch
    from transformers import AutoTokenizer, Glm4Config, Glm4ForCausalLM

    out = tmp_path_factory.mktemp("glm4") / "model"
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    config = Glm4Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                        tie_word_embeddings=False, initializer_range=0.1, pad_token_id=tokenizer.pad_token_id,
                        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, dtype="float32")
    torch.manual_seed(0)
    model = Glm4ForCausalLM(config)
    model.generation_config.eos_token_id = [tokenizer.convert_tokens_to_ids("<|end|>"), tokenizer.eos_token_id]
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    package = Path(__file__).resolve().parents[1] / "earl_stream"
    assert "glm4" not in "".join(p.read_text() for p in package.rglob("*.py")).lower()
    return out


@pytest.mark.parametrize("plan", ["dp2", "fsdp2"])
def test_a_model_type_no_code_names_trains_under_dp2_and_fsdp2(tmp_path: Path, unnamed_model_dir: Path,
                                                                 plan: str) -> None:
    summary, log = _up(tmp_path, unnamed_model_dir, "trainer.nproc=2", f"selector.plans={plan}")
    _trained(summary)
    assert f"trainer pool adopted plan v1 ({plan})" in log, log[-3000:]


def test_a_mixtral_trains_with_the_selector_on(tmp_path: Path) -> None:
    """The second mixture-of-experts family (Qwen3-MoE's run with routing replay is tests/test_moe_live.py's)."""
    from earl_stream.model.tiny_moe import init_moe_model

    model_dir = init_moe_model(tmp_path / "mixtral", family="mixtral", experts=4, top_k=2)
    summary, log = _up(tmp_path, model_dir)
    _trained(summary)
    assert "trainer pool adopted plan" in log, log[-3000:]
