"""vLLM-specific behaviour of VllmEngine (run by `make test-vllm`; skipped where vllm is absent):
the train-inference log-prob mismatch against the Hugging Face forward, multi-turn episodes through
vLLM's prefix cache, start-up limits, and weight reloads of a model with tied embeddings."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from engine_skip import require_engine
from transformers import PreTrainedModel, Qwen2Config, Qwen2ForCausalLM

from earl_stream.errors import EngineError
from earl_stream.model import load_model
from earl_stream.workers.engines import EngineCapacity, FinishReason, GenerateRequest

pytestmark = pytest.mark.vllm
require_engine("vllm")

from earl_stream.workers.engines.vllm_engine import VllmEngine  # noqa: E402  (after the skip: needs vllm)

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def sharp(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, PreTrainedModel]:
    """The tiny model with an 8x output head: peaked next-token distributions, like a trained model's."""
    model, _ = load_model(tiny_model_dir)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    out = tmp_path_factory.mktemp("sharp")
    model.save_pretrained(out)
    return out, model


@pytest.fixture(scope="module")
def engine(sharp: tuple[Path, PreTrainedModel]) -> Iterator[VllmEngine]:
    with VllmEngine(sharp[0], max_batch_size=8, kv_budget_tokens=4096, seed=0) as eng:
        yield eng


def prompts(lengths: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(6, 500, (n,), generator=gen).tolist() for n in lengths]


def full_logprobs(model: PreTrainedModel, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """The trainer's view: log_softmax of one full forward [len(generated), V] at the generating positions."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + generated])).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1 : len(prompt) - 1 + len(generated)], dim=-1)


def greedy_gap(model: PreTrainedModel, prompt: list[int], tokens: list[int]) -> float:
    """Largest shortfall of a generated token's log-prob below the argmax's (0 for exact greedy)."""
    ref = full_logprobs(model, prompt, tokens)
    chosen = ref.gather(1, torch.tensor(tokens)[:, None]).squeeze(1)
    return float((ref.max(dim=-1).values - chosen).max())


def test_train_inference_logprob_mismatch_is_tiny(
    engine: VllmEngine, sharp: tuple[Path, PreTrainedModel], record_property: pytest.RecordProperty
) -> None:
    """At temperature 1 without filters, vLLM's log-probs must equal the trainer's recomputation."""
    model = sharp[1]
    ps = prompts([4, 9, 16, 25, 36, 49, 64, 100], seed=21)
    results = engine.generate([GenerateRequest(p, 32, temperature=1.0, seed=i) for i, p in enumerate(ps)])
    diffs = []
    for p, res in zip(ps, results):
        ref = full_logprobs(model, p, res.token_ids).gather(1, torch.tensor(res.token_ids)[:, None]).squeeze(1)
        diffs.append((torch.tensor(res.logprobs) - ref).abs())
    diff = torch.cat(diffs)
    mean_lp = sum(sum(r.logprobs) for r in results) / diff.numel()
    record_property("vllm_vs_hf_max_abs_logprob_diff", float(diff.max()))
    record_property("vllm_vs_hf_mean_abs_logprob_diff", float(diff.mean()))
    print(f"\nvLLM vs HF log-probs over {diff.numel()} sampled tokens (mean log-prob {mean_lp:.3f}): "
          f"max |diff| {float(diff.max()):.2e}, mean |diff| {float(diff.mean()):.2e}")
    assert float(diff.max()) < 1e-3


def test_an_episode_grows_turn_by_turn_through_the_prefix_cache(
    engine: VllmEngine, sharp: tuple[Path, PreTrainedModel]
) -> None:
    """Each turn's prompt is the whole episode so far; results stay exact while vLLM reuses the prefix."""
    model = sharp[1]
    contexts = prompts([30, 45, 12], seed=22)
    observations = prompts([5, 7, 3, 6, 4, 9], seed=23)
    for turn in range(2):
        reqs = [GenerateRequest(c, 8, temperature=0.0, cache_key=f"ep{i}") for i, c in enumerate(contexts)]
        for c, res in zip(contexts, engine.generate(reqs)):
            assert greedy_gap(model, c, res.token_ids) < 1e-4
            c.extend(res.token_ids + observations[turn * 3 + contexts.index(c)])
    for i in range(len(contexts)):
        engine.release(f"ep{i}")


def test_start_up_limits_are_enforced(engine: VllmEngine) -> None:
    with pytest.raises(EngineError, match="context of 4096"):
        engine.generate([GenerateRequest(list(range(6, 506)) * 8, 200)])
    engine.set_capacity(EngineCapacity(64, 10**6))  # above the start-up values: clamped, not an error
    assert engine.capacity == EngineCapacity(8, 4096)
    res = engine.generate([GenerateRequest([7, 8, 9], 3, temperature=0.0)])[0]
    assert res.finish_reason is FinishReason.LENGTH and len(res.token_ids) == 3


def test_tied_embeddings_reload_reaches_the_output_head(tmp_path: Path) -> None:
    """vLLM on CPU keeps a stale output head after a reload of a tied model; the engine starts untied."""
    torch.manual_seed(5)
    config = Qwen2Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=True)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(5.0)  # peaked distributions: fewer near-ties in greedy
    model.save_pretrained(tmp_path)
    ps = prompts([3, 11, 20], seed=24)
    with VllmEngine(tmp_path, max_batch_size=4, kv_budget_tokens=1024, seed=0) as eng:
        for p, res in zip(ps, eng.generate([GenerateRequest(p, 6, temperature=0.0) for p in ps])):
            assert greedy_gap(model, p, res.token_ids) < 1e-4
        with torch.no_grad():
            model.model.embed_tokens.weight.add_(torch.randn_like(model.model.embed_tokens.weight))
        eng.load_state_dict(model.state_dict(), 1)
        for p, res in zip(ps, eng.generate([GenerateRequest(p, 6, temperature=0.0) for p in ps])):
            assert res.policy_version == 1
            assert greedy_gap(model, p, res.token_ids) < 1e-4
        state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}  # as a checkpoint has it
        eng.load_state_dict(state, 2)
        res = eng.generate([GenerateRequest(ps[0], 6, temperature=0.0)])[0]
        assert greedy_gap(model, ps[0], res.token_ids) < 1e-4
