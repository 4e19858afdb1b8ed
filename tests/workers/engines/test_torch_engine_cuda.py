"""The built-in engine on a CUDA device (`rollout.device=cuda`): greedy, seeded-sampled, shared-prefix and
multi-turn (kept KV) generation give the same tokens as on CPU with log-probs close, and the trainer's CPU
weights load in place.

Needs a CUDA GPU (marker `gpu`); skipped where torch sees none."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from earl_stream.devices import resolve_device
from earl_stream.errors import ConfigError
from earl_stream.model import load_model
from earl_stream.workers.engines import GenerateRequest, GenerateResult, TorchEngine

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

BOARDS = ["X O 3\n4 X 6\n7 8 O", "1 2 3\n4 5 6\n7 8 9", "O X O\n4 5 6\nX 8 9"]


def _play(engine: TorchEngine, tok: Any) -> list[GenerateResult]:
    """Greedy rows, a seeded group of 4 on one prompt (prefilled once), then a second turn on kept KV."""
    ids = [tok.encode(b, add_special_tokens=False) for b in BOARDS]
    greedy = [GenerateRequest(prompt_ids=p, max_new_tokens=16, temperature=0.0) for p in ids]
    group = [GenerateRequest(prompt_ids=ids[1], max_new_tokens=16, temperature=1.0, seed=s) for s in range(4)]
    turn1 = GenerateRequest(prompt_ids=ids[0], max_new_tokens=8, temperature=0.0, cache_key="episode")
    out = engine.generate(greedy + group + [turn1])
    turn2 = GenerateRequest(prompt_ids=ids[0] + out[-1].token_ids + ids[2], max_new_tokens=8, temperature=0.0,
                            cache_key="episode")
    out += engine.generate([turn2])
    engine.release("episode")
    return out


def _check_same(want: list[GenerateResult], got: list[GenerateResult]) -> None:
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    for a, b in zip(want, got):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-3


def test_cuda_engine_matches_cpu_and_loads_cpu_weights(tiny_model_dir: Path) -> None:
    cpu_model, tok = load_model(tiny_model_dir)
    gpu_model, _ = load_model(tiny_model_dir)
    gpu_model.to(resolve_device("cuda", key="rollout.device"))  # type: ignore[arg-type]
    cpu, gpu = TorchEngine(cpu_model), TorchEngine(gpu_model)
    _check_same(_play(cpu, tok), _play(gpu, tok))
    assert gpu.stats.shared_prefix_tokens == cpu.stats.shared_prefix_tokens > 0
    assert gpu.stats.reused_tokens == cpu.stats.reused_tokens > 0  # the second turn ran on kept KV
    state = {k: v.detach().clone() * 0.5 for k, v in cpu_model.state_dict().items()}  # CPU tensors, as pulled
    cpu.load_state_dict(state, 1)
    gpu.load_state_dict(state, 1)
    assert next(gpu_model.parameters()).device.type == "cuda" and gpu.policy_version == 1
    _check_same(_play(cpu, tok), _play(gpu, tok))


def test_resolve_device_names_the_key() -> None:
    assert resolve_device("auto", key="rollout.device").type == "cuda"
    with pytest.raises(ConfigError, match=r"rollout\.device: 'tpu' is not allowed"):
        resolve_device("tpu", key="rollout.device")
