"""The built-in engine's own forward (`FastDecoder`) against the Hugging Face forward: logits with
left padding and an incremental cache, the engine's two paths giving the same tokens and log-probs
over multi-turn requests, weight changes picked up by the fused projections, and the fallback for
models it does not support."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from earl_stream.workers.engines import GenerateRequest, TorchEngine
from earl_stream.workers.engines.decode_path import DecodePath
from earl_stream.workers.engines.fast_decoder import FastDecoder

torch.set_num_threads(1)


def qwen2(seed: int = 0, **overrides: object) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, tie_word_embeddings=False, **overrides)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # non-zero q/k/v biases, so the fused bias is exercised
        for layer in model.model.layers:
            for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                lin.bias.normal_(0, 0.1)
    return model


def padded_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 256, (3, 24), generator=gen)
    mask = torch.ones(3, 24, dtype=torch.long)
    mask[0, :7] = 0
    mask[2, :15] = 0
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_logits_equal_hf_forward_with_padding_and_cache(family: str) -> None:
    if family == "qwen2":
        model = qwen2()
    else:
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                             num_key_value_heads=1, intermediate_size=128)).eval()
    assert FastDecoder.supports(model)
    fast = FastDecoder(model)
    ids, mask, pos = padded_batch(0)
    with torch.inference_mode():
        ref = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        cache = fast.new_cache(3, 8)  # too small on purpose: the cache grows
        prefill = fast.forward(ids[:, :16], pos[:, :16], mask[:, :16], cache, last_only=False)
        for b in range(3):
            real = mask[b, :16].bool()
            torch.testing.assert_close(prefill[b, real], ref[b, :16][real], atol=1e-5, rtol=1e-5)
        for t in range(16, 24):
            step = fast.forward(ids[:, t : t + 1], pos[:, t : t + 1], mask[:, : t + 1], cache)
            torch.testing.assert_close(step, ref[:, t], atol=1e-5, rtol=1e-5)
    assert cache.length == 24 and cache.capacity >= 24


def multi_turn(engine: TorchEngine, temperature: float) -> list[tuple[list[int], list[float]]]:
    """Three episodes of three turns each, batched, with kept caches; returns every turn's result."""
    gen = torch.Generator().manual_seed(3)
    contexts = [torch.randint(1, 256, (n,), generator=gen).tolist() for n in (5, 17, 30)]
    out = []
    for turn in range(3):
        reqs = [GenerateRequest(ctx, 6, temperature=temperature, seed=100 * e + turn, cache_key=f"e{e}")
                for e, ctx in enumerate(contexts)]
        for e, res in enumerate(engine.generate(reqs)):
            out.append((res.token_ids, res.logprobs))
            contexts[e] = contexts[e] + res.token_ids + torch.randint(1, 256, (4,), generator=gen).tolist()
    return out


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_engine_paths_agree_over_multi_turn_episodes(temperature: float) -> None:
    model = qwen2(1)
    fast_engine, hf_engine = TorchEngine(model), TorchEngine(model, fast_forward=False)
    assert fast_engine._fast is not None and hf_engine._fast is None
    for (tok_f, lp_f), (tok_h, lp_h) in zip(multi_turn(fast_engine, temperature), multi_turn(hf_engine, temperature)):
        assert tok_f == tok_h
        assert lp_f == pytest.approx(lp_h, abs=1e-5)
    assert fast_engine.stats.reused_tokens == hf_engine.stats.reused_tokens > 0


def test_weight_changes_reach_the_fused_projections() -> None:
    model, other = qwen2(2), qwen2(3)
    engine = TorchEngine(model)
    prompt = list(range(1, 20))
    before = engine.generate([GenerateRequest(prompt, 5, temperature=0.0)])[0]
    engine.load_state_dict(other.state_dict(), version=1)
    after = engine.generate([GenerateRequest(prompt, 5, temperature=0.0)])[0]
    expected = TorchEngine(other, fast_forward=False).generate([GenerateRequest(prompt, 5, temperature=0.0)])[0]
    assert after.token_ids == expected.token_ids and after.token_ids != before.token_ids
    assert after.logprobs == pytest.approx(expected.logprobs, abs=1e-5)
    with torch.no_grad():  # an in-place change outside load_state_dict is seen too
        model.model.layers[0].mlp.up_proj.weight.mul_(3.0)
    changed = engine.generate([GenerateRequest(prompt, 5, temperature=0.0)])[0]
    hf = TorchEngine(model, fast_forward=False).generate([GenerateRequest(prompt, 5, temperature=0.0)])[0]
    assert changed.logprobs == pytest.approx(hf.logprobs, abs=1e-5)


@pytest.mark.parametrize(("overrides", "reason"), [
    ({"hidden_act": "laplace"}, "activation 'laplace' not in the fast decoder"),
    ({"use_sliding_window": True, "sliding_window": 8}, "sliding-window layers"),
], ids=["unknown-activation", "sliding-window"])
def test_unsupported_models_fall_back_to_the_hf_forward(overrides: dict[str, object], reason: str) -> None:
    model = qwen2(4, **overrides)
    assert not FastDecoder.supports(model)
    engine = TorchEngine(model)
    assert engine._fast is None and engine.decode_path.path is DecodePath.HF_FORWARD
    assert reason in engine.decode_path.reason
    res = engine.generate([GenerateRequest(list(range(1, 10)), 4, temperature=0.0)])[0]
    assert len(res.token_ids) == 4


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_mixtures_of_experts_run_in_the_fast_decoder(family: str, tmp_path) -> None:  # noqa: ANN001
    """Qwen3-MoE (q/k norms) and Mixtral: logits equal the HF forward (padding, growing cache); the engine
    batches them continuously, its greedy tokens are `model.generate`'s, and it records the same routing
    (and log-probs) as the HF path over multi-turn requests with kept caches."""
    from earl_stream.model import load_model
    from earl_stream.model.tiny_moe import init_moe_model

    model, _ = load_model(init_moe_model(tmp_path / family, family=family, experts=8, top_k=2))
    model.eval()
    assert FastDecoder.supports(model)
    fast = FastDecoder(model)
    ids, mask, pos = padded_batch(5)
    with torch.inference_mode():
        ref = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        cache = fast.new_cache(3, 8)
        prefill = fast.forward(ids[:, :16], pos[:, :16], mask[:, :16], cache, last_only=False)
        for b in range(3):
            real = mask[b, :16].bool()
            torch.testing.assert_close(prefill[b, real], ref[b, :16][real], atol=1e-5, rtol=1e-5)
        for t in range(16, 24):
            torch.testing.assert_close(fast.forward(ids[:, t: t + 1], pos[:, t: t + 1], mask[:, : t + 1], cache),
                                       ref[:, t], atol=1e-5, rtol=1e-5)
    engine, hf_engine = TorchEngine(model), TorchEngine(model, fast_forward=False)
    assert engine._fast is not None and engine._continuous
    prompt = list(range(7, 30))
    got = engine.generate([GenerateRequest(prompt, 12, temperature=0.0, stop_token_ids=[])])[0]
    with torch.inference_mode():
        want = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(prompt):].tolist()
    assert got.token_ids == want
    gen = torch.Generator().manual_seed(4)
    contexts = [torch.randint(1, 256, (n,), generator=gen).tolist() for n in (5, 17, 30)]
    for turn in range(2):
        reqs = [GenerateRequest(ctx, 6, temperature=1.0, seed=10 * e + turn, cache_key=f"e{e}")
                for e, ctx in enumerate(contexts)]
        for e, (f, h) in enumerate(zip(engine.generate(reqs), hf_engine.generate(reqs))):
            assert f.token_ids == h.token_ids and f.logprobs == pytest.approx(h.logprobs, abs=1e-5)
            assert f.routed_experts is not None and h.routed_experts is not None
            assert (f.routed_experts == h.routed_experts).all()
            contexts[e] = contexts[e] + f.token_ids + [9, 10, 11]
