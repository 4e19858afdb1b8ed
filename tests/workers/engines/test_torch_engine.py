"""TorchEngine against the Hugging Face model itself: greedy generate, full-forward log-probs,
stop conditions, seeding, weight loads, and KV caches kept between turns."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from earl_stream.errors import EngineError
from earl_stream.workers.engines import EngineCapacity, FinishReason, GenerateRequest, TorchEngine

torch.set_num_threads(1)


def tiny_model(seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        tie_word_embeddings=False,
    )
    return Qwen2ForCausalLM(config).eval()


@pytest.fixture(scope="module")
def model() -> Qwen2ForCausalLM:
    return tiny_model(0)


def prompts(lengths: list[int], seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]


def hf_greedy(model: Qwen2ForCausalLM, prompt: list[int], new: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=new,
        min_new_tokens=new,
        pad_token_id=0,
        eos_token_id=None,
    )
    return out[0, len(prompt) :].tolist()


def full_logprobs(
    model: Qwen2ForCausalLM, prompt: list[int], generated: list[int], temperature: float = 1.0
) -> torch.Tensor:
    """log_softmax(logits / T) [len(generated), V] at the positions that predicted `generated`."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + generated])).logits[0]
    return torch.log_softmax(logits[len(prompt) - 1 : -1] / temperature, dim=-1)


def test_greedy_equals_hf_generate_batched_and_alone(model: Qwen2ForCausalLM) -> None:
    ps = prompts([1, 5, 12, 30, 47])
    engine = TorchEngine(model, max_batch_size=8)
    batched = engine.generate([GenerateRequest(p, 10, temperature=0.0) for p in ps])
    small = TorchEngine(model, max_batch_size=2).generate([GenerateRequest(p, 10, temperature=0.0) for p in ps])
    for p, res, res_small in zip(ps, batched, small):
        alone = engine.generate([GenerateRequest(p, 10, temperature=0.0)])[0]
        assert res.token_ids == hf_greedy(model, p, 10)
        assert res.token_ids == alone.token_ids == res_small.token_ids
        assert res.logprobs == pytest.approx(alone.logprobs, abs=1e-5)
        assert res.finish_reason is FinishReason.LENGTH and len(res.logprobs) == 10


def test_logprobs_equal_full_forward(model: Qwen2ForCausalLM) -> None:
    ps = prompts([4, 20, 9, 33], seed=2)
    reqs = [GenerateRequest(p, 12, seed=i, temperature=0.0 if i == 2 else 1.0) for i, p in enumerate(ps)]
    for p, res in zip(ps, TorchEngine(model).generate(reqs)):
        ref = full_logprobs(model, p, res.token_ids)
        expected = ref.gather(1, torch.tensor(res.token_ids)[:, None]).squeeze(1)
        torch.testing.assert_close(torch.tensor(res.logprobs), expected, atol=1e-4, rtol=0)


def test_top_k_and_top_p_logprobs_are_renormalised(model: Qwen2ForCausalLM) -> None:
    (p,) = prompts([15], seed=3)
    res = TorchEngine(model).generate([GenerateRequest(p, 16, temperature=0.7, top_k=5, seed=3)])[0]
    scaled = full_logprobs(model, p, res.token_ids, temperature=0.7)
    top = scaled.topk(5, dim=-1)
    for j, tok in enumerate(res.token_ids):
        assert tok in top.indices[j].tolist()
        renorm = torch.log_softmax(top.values[j], dim=-1)[top.indices[j].tolist().index(tok)]
        assert res.logprobs[j] == pytest.approx(float(renorm), abs=1e-4)
    nucleus = TorchEngine(model).generate([GenerateRequest(p, 6, top_p=1e-6, seed=4)])[0]
    assert nucleus.token_ids == hf_greedy(model, p, 6)
    assert nucleus.logprobs == pytest.approx([0.0] * 6, abs=1e-6)


def test_stop_token_ends_row_and_length_limit(model: Qwen2ForCausalLM) -> None:
    ps = prompts([6, 11], seed=4)
    engine = TorchEngine(model)
    free = [r.token_ids for r in engine.generate([GenerateRequest(p, 12, temperature=0.0) for p in ps])]
    stop = free[0][3]
    res = engine.generate(
        [GenerateRequest(p, 12, temperature=0.0, stop_token_ids=frozenset({stop})) for p in ps]
        + [GenerateRequest(ps[1], 4, temperature=0.0)]
    )
    cut = free[0].index(stop) + 1
    assert res[0].token_ids == free[0][:cut] and res[0].finish_reason is FinishReason.STOP
    assert len(res[0].logprobs) == cut
    expected_1 = free[1][: free[1].index(stop) + 1] if stop in free[1] else free[1]
    assert res[1].token_ids == expected_1
    assert res[2].token_ids == free[1][:4] and res[2].finish_reason is FinishReason.LENGTH


def test_same_seed_same_tokens_whatever_the_batch(model: Qwen2ForCausalLM) -> None:
    (p, q, r) = prompts([8, 25, 3], seed=5)
    req = GenerateRequest(p, 16, seed=7)
    alone = TorchEngine(model, seed=1).generate([req])[0]
    mixed = TorchEngine(model, seed=2).generate([GenerateRequest(q, 30), req, GenerateRequest(r, 5, seed=8)])[1]
    other = TorchEngine(model).generate([GenerateRequest(p, 16, seed=8)])[0]
    assert alone.token_ids == mixed.token_ids
    assert alone.logprobs == pytest.approx(mixed.logprobs, abs=1e-5)
    assert alone.token_ids != other.token_ids


def test_load_state_dict_changes_outputs_and_is_strict() -> None:
    model, donor = tiny_model(0), tiny_model(1)
    ps = prompts([7, 19], seed=6)
    reqs = [GenerateRequest(p, 8, temperature=0.0) for p in ps]
    engine = TorchEngine(model)
    before = engine.generate(reqs)
    assert engine.policy_version == 0
    engine.load_state_dict(donor.state_dict(), version=3)
    after = engine.generate(reqs)
    assert engine.policy_version == 3
    assert {r.policy_version for r in before} == {0} and {r.policy_version for r in after} == {3}
    assert [r.token_ids for r in after] != [r.token_ids for r in before]
    assert [r.token_ids for r in after] == [hf_greedy(donor, p, 8) for p in ps]

    bad = dict(donor.state_dict())
    bad["model.not_a_layer.weight"] = bad.pop("model.norm.weight")
    with pytest.raises(EngineError, match=r"not_a_layer.*model\.norm\.weight"):
        engine.load_state_dict(bad, version=4)
    wrong_shape = dict(donor.state_dict(), **{"model.norm.weight": torch.zeros(3)})
    with pytest.raises(EngineError, match="model.norm.weight has shape"):
        engine.load_state_dict(wrong_shape, version=5)
    assert engine.policy_version == 3
    assert [r.token_ids for r in engine.generate(reqs)] == [r.token_ids for r in after]


def test_invalid_requests_raise_engine_error(model: Qwen2ForCausalLM) -> None:
    engine = TorchEngine(model)
    for req in (
        GenerateRequest([], 4),
        GenerateRequest([1, 2], 0),
        GenerateRequest([1, 2], 4, top_p=0.0),
        GenerateRequest([1, 2], 4, temperature=-1.0),
        GenerateRequest([1, 256], 4),
    ):
        with pytest.raises(EngineError, match="request 0"):
            engine.generate([req])
    with pytest.raises(EngineError):
        engine.set_capacity(EngineCapacity(0, 10))


def play_turns(engine: TorchEngine, starts: list[list[int]], turns: int, keys: bool) -> list[list]:
    """Three-turn episodes: each turn appends the reply and a 3-token observation to the context."""
    contexts = [list(s) for s in starts]
    history = []
    for turn in range(turns):
        reqs = [
            GenerateRequest(c, 2 + i, seed=100 * turn + i, cache_key=f"ep{i}" if keys else None)
            for i, c in enumerate(contexts)
        ]
        results = engine.generate(reqs)
        history.append(results)
        contexts = [c + r.token_ids + [turn + 1, 2, 3] for c, r in zip(contexts, results)]
    return history


def test_kept_kv_cache_gives_the_same_turns_with_less_prefill(model: Qwen2ForCausalLM) -> None:
    starts = prompts([5, 14, 9, 22], seed=7)
    cached, plain = TorchEngine(model), TorchEngine(model)
    with_keys = play_turns(cached, starts, 3, keys=True)
    without = play_turns(plain, starts, 3, keys=False)
    for a_turn, b_turn in zip(with_keys, without):
        for a, b in zip(a_turn, b_turn):
            assert a.token_ids == b.token_ids
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    assert cached.stats.reused_tokens > 0
    assert cached.stats.prefill_tokens < plain.stats.prefill_tokens
    # A context that does not extend the kept one (edited history) is recomputed correctly.
    edited = [9] + starts[1][1:]
    a = cached.generate([GenerateRequest(edited, 4, seed=1, cache_key="ep1")])[0]
    b = plain.generate([GenerateRequest(edited, 4, seed=1)])[0]
    assert a.token_ids == b.token_ids


def test_kept_caches_are_bounded_released_and_dropped_on_load(model: Qwen2ForCausalLM) -> None:
    # a finished row's KV is copied while the batch still holds it: kept only if both fit the budget
    engine = TorchEngine(model, kv_budget_tokens=300)
    play_turns(engine, prompts([30, 30, 30, 30], seed=8), 2, keys=True)
    assert 0 < engine.stats.kept_cache_tokens <= 300
    engine.set_capacity(EngineCapacity(64, 2000))
    play_turns(engine, prompts([90, 90, 90, 90], seed=8), 2, keys=True)
    kept = engine.stats.kept_cache_tokens
    assert kept > 300
    engine.release("ep0")
    assert engine.stats.kept_cache_tokens < kept
    engine.load_state_dict(model.state_dict(), version=1)
    assert engine.stats.kept_cache_tokens == 0


def test_capacity_splits_batches(model: Qwen2ForCausalLM) -> None:
    engine = TorchEngine(model)
    engine.set_capacity(EngineCapacity(max_concurrent_sequences=2, kv_budget_tokens=4096))
    engine.generate([GenerateRequest(p, 2) for p in prompts([3] * 5)])
    assert engine.stats.batches == 3
    assert engine.capacity == EngineCapacity(2, 4096)
