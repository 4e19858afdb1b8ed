"""`rollout.dtype=bf16`: the built-in engine generates in bf16 on CPU, takes the trainer's fp32 weights (cast
on load), and its log-probs stay close to an fp32 engine's on the same tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from earl_stream.config import load_config
from earl_stream.errors import ConfigError
from earl_stream.model import load_model, torch_dtype
from earl_stream.workers.engines import GenerateRequest, TorchEngine

torch.set_num_threads(1)


def test_config_accepts_bf16_only_among_half_types() -> None:
    assert load_config(None, ["rollout.dtype=bf16"]).rollout.dtype == "bf16"
    assert load_config().rollout.dtype == "fp32"
    with pytest.raises(ConfigError, match=r"rollout\.dtype: 'fp16' is not allowed; choose one of fp32, bf16"):
        load_config(None, ["rollout.dtype=fp16"])


def test_bf16_engine_generates_and_loads_fp32_weights(tiny_model_dir: Path) -> None:
    full, tok = load_model(tiny_model_dir)
    half, _ = load_model(tiny_model_dir, dtype=torch_dtype("bf16"))
    assert next(half.parameters()).dtype == torch.bfloat16
    prompt = tok.encode("X O 3\n4 X 6\n7 8 O", add_special_tokens=False)
    request = GenerateRequest(prompt_ids=prompt, max_new_tokens=12, temperature=0.0)
    bf16, fp32 = TorchEngine(half), TorchEngine(full)
    out = bf16.generate([request])[0]
    assert len(out.token_ids) == 12 and all(lp <= 0 for lp in out.logprobs)
    # the fp32 engine's log-probs of the very tokens the bf16 engine chose: close, not equal
    forced = [GenerateRequest(prompt_ids=prompt + out.token_ids[:i], max_new_tokens=1, temperature=0.0)
              for i in range(len(out.token_ids))]
    reference = [r.logprobs[0] for r in fp32.generate(forced)]
    same = [i for i, r in enumerate(fp32.generate(forced)) if r.token_ids[0] == out.token_ids[i]]
    assert len(same) >= 10
    assert max(abs(out.logprobs[i] - reference[i]) for i in same) < 0.1
    state = {k: v.detach().clone() * 0.5 for k, v in full.state_dict().items()}  # the trainer's fp32 weights
    bf16.load_state_dict(state, 1)
    assert bf16.policy_version == 1 and next(half.parameters()).dtype == torch.bfloat16
    torch.testing.assert_close(half.get_input_embeddings().weight.float(), state["model.embed_tokens.weight"],
                               atol=1e-2, rtol=1e-2)
    assert len(bf16.generate([request])[0].token_ids) >= 1
