"""Weight swaps of the built-in engine mid-generation (rollout.weight_swap): interrupt re-prefills each
running row under the new weights (its continued greedy tokens equal `transformers` on the new weights
from the same prefix), inplace keeps the rows' KV, both mark every token with the version it was sampled
by; a rejected swap leaves the engine and its running rows on the old version; the batcher does not
wait for running rows; the modes other backends cannot offer are refused at config load."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from earl_stream.config import load_config
from earl_stream.errors import ConfigError, EngineError
from earl_stream.workers.engines import AsyncBatcher, GenerateRequest, TorchEngine
from earl_stream.workers.engines.weight_swap import SwapMode, SwapTally, swap_mode_problem, swap_weights

torch.set_num_threads(1)
NEW = 24  # tokens per reply
BEFORE = 6  # engine steps before the swap: an admission and 5 sampled tokens


def tiny_model(seed: int) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, tie_word_embeddings=False)
    return Qwen2ForCausalLM(config).eval()


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(1, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_greedy(model: Qwen2ForCausalLM, ids: list[int], new: int) -> list[int]:
    t = torch.tensor([ids])
    out = model.generate(t, attention_mask=torch.ones_like(t), do_sample=False, max_new_tokens=new,
                         min_new_tokens=new, pad_token_id=0, eos_token_id=None)
    return out[0, len(ids):].tolist()


def hf_logprobs(model: Qwen2ForCausalLM, context: list[int], generated: list[int]) -> list[float]:
    with torch.inference_mode():
        logits = model(torch.tensor([context + generated])).logits[0]
    lp = torch.log_softmax(logits[len(context) - 1 : -1], dim=-1)
    return lp[torch.arange(len(generated)), torch.tensor(generated)].tolist()


def swap_mid_reply(mode: str, new_state: dict[str, torch.Tensor], reqs: list[GenerateRequest]) -> tuple[TorchEngine, list]:
    """Run `reqs` on a fresh engine of tiny_model(0); after BEFORE steps another thread swaps in `new_state`
    as version 1 (applied there, at that step boundary); then the rows run to their end."""
    engine = TorchEngine(tiny_model(0), weight_swap=mode)
    rows = engine.submit(reqs)
    for _ in range(BEFORE):
        engine.step()
    errors: list[Exception] = []

    def load() -> None:
        try:
            engine.load_state_dict(new_state, 1)
        except EngineError as exc:
            errors.append(exc)

    loader = threading.Thread(target=load)
    loader.start()
    loader.join(30)
    while not all(r.done.is_set() for r in rows):
        engine.step()
    if errors:
        raise errors[0]
    return engine, [r.result for r in rows]


@pytest.mark.parametrize("mode", ["interrupt", "inplace"])
def test_a_reply_spanning_a_swap_carries_both_versions_token_by_token(mode: str) -> None:
    old, new = tiny_model(0), tiny_model(1)
    p = prompt(11, 3)
    engine, (res,) = swap_mid_reply(mode, new.state_dict(), [GenerateRequest(p, NEW, temperature=0.0)])
    # interrupt: the 5 tokens sampled before the swap are v0, the re-prefill's logits make the 6th v1;
    # inplace: the pending logits were the old weights', so the 6th is v0 too
    cut = BEFORE - 1 if mode == "interrupt" else BEFORE
    assert res.token_versions == [0] * cut + [1] * (NEW - cut)
    assert res.policy_version == 0 and engine.policy_version == 1
    assert res.token_ids[:cut] == hf_greedy(old, p, cut)
    assert res.logprobs[:cut] == pytest.approx(hf_logprobs(old, p, res.token_ids[:cut]), abs=1e-5)
    stats = engine.stats
    assert stats.swaps == 1
    if mode == "interrupt":  # the whole context so far was prefilled again under the new weights
        assert stats.reprefill_tokens == len(p) + cut
    else:
        assert stats.reprefill_tokens == 0 and stats.prefill_tokens == len(p)


def test_interrupt_continues_with_the_new_weights_as_transformers_does() -> None:
    old, new = tiny_model(0), tiny_model(1)
    ps = [prompt(9, 4), prompt(17, 5)]  # different lengths: the re-prefill pads one of them
    _, results = swap_mid_reply("interrupt", new.state_dict(), [GenerateRequest(q, NEW, temperature=0.0) for q in ps])
    cut = BEFORE - 1
    for q, res in zip(ps, results):
        prefix = q + res.token_ids[:cut]  # what the old weights produced, now the new weights' prompt
        assert res.token_ids[:cut] == hf_greedy(old, q, cut)
        assert res.token_ids[cut:] == hf_greedy(new, prefix, NEW - cut)
        assert res.logprobs[cut:] == pytest.approx(hf_logprobs(new, prefix, res.token_ids[cut:]), abs=1e-5)
        assert res.token_versions == [0] * cut + [1] * (NEW - cut)


def test_seeded_sampling_goes_on_through_an_interrupt() -> None:
    """A seeded row draws its uniforms from its own generator: an identical swap (same weights, new version)
    leaves its tokens as they were without one, while the versions still split."""
    same = {k: v.clone() for k, v in tiny_model(0).state_dict().items()}
    req = GenerateRequest(prompt(10, 6), NEW, temperature=1.0, seed=11)
    plain = TorchEngine(tiny_model(0)).generate([req])[0]
    _, (res,) = swap_mid_reply("interrupt", same, [req])
    assert res.token_ids == plain.token_ids
    assert res.logprobs == pytest.approx(plain.logprobs, abs=1e-5)
    assert res.token_versions == [0] * (BEFORE - 1) + [1] * (NEW - BEFORE + 1)


@pytest.mark.parametrize("mode", ["interrupt", "inplace", "drain"])
@pytest.mark.parametrize("damage", ["missing", "shape", "nan"])
def test_a_rejected_swap_leaves_the_engine_and_its_rows_on_the_old_version(mode: str, damage: str) -> None:
    state = dict(tiny_model(1).state_dict())
    if damage == "missing":
        del state["model.layers.1.mlp.down_proj.weight"]
    elif damage == "shape":
        state["model.norm.weight"] = torch.ones(3)
    else:  # what a corrupted transfer could deliver
        state["model.layers.0.self_attn.q_proj.weight"] = state["model.layers.0.self_attn.q_proj.weight"].clone()
        state["model.layers.0.self_attn.q_proj.weight"][0, 0] = float("nan")
    req = GenerateRequest(prompt(12, 7), NEW, temperature=0.0)
    plain = TorchEngine(tiny_model(0)).generate([req])[0]
    expect = {"missing": "missing names.*down_proj", "shape": "model.norm.weight has shape", "nan": "non-finite"}[damage]
    with pytest.raises(EngineError, match=f"stays on version 0.*{expect}"):
        engine, (res,) = swap_mid_reply(mode, state, [req])
    engine = TorchEngine(tiny_model(0), weight_swap=mode)
    rows = engine.submit([req])
    for _ in range(BEFORE):
        engine.step()
    with pytest.raises(EngineError):
        engine.load_state_dict(state, 1)
    while not rows[0].done.is_set():
        engine.step()
    res = rows[0].result
    assert engine.policy_version == 0 and engine.stats.swaps == 0
    assert res is not None and res.token_ids == plain.token_ids and res.token_versions is None
    assert res.policy_version == 0


def test_the_batcher_swaps_without_waiting_for_running_rows() -> None:
    """Through the rollout worker's path (swap_weights over an AsyncBatcher): interrupt loads while a long
    reply is decoding; drain waits for it. Counted in tokens sampled after the load, not timed."""
    new = tiny_model(1).state_dict()

    async def run(mode: SwapMode) -> tuple[list[int], SwapTally, int]:
        engine = TorchEngine(tiny_model(0), weight_swap=mode)
        batcher = AsyncBatcher(engine)
        tally = SwapTally(mode.value)
        seen: list[int] = []
        started = asyncio.Event()
        loop = asyncio.get_running_loop()

        def on_token(tok: int) -> None:
            seen.append(tok)
            if len(seen) == 3:
                loop.call_soon_threadsafe(started.set)

        reply = asyncio.ensure_future(batcher.generate(GenerateRequest(prompt(8, 9), 200, temperature=0.0,
                                                                       on_token=on_token)))
        await started.wait()
        await swap_weights(batcher, engine, new, 1, mode, tally)
        at_load = len(seen)
        result = await reply
        await batcher.aclose()
        return result.versions(-1), tally, at_load

    versions, tally, at_load = asyncio.run(run(SwapMode.INTERRUPT))
    assert tally.swaps == 1 and tally.failures == 0 and at_load < 200  # loaded while the reply was decoding
    assert 3 <= versions.count(0) <= at_load and versions.count(1) == 200 - versions.count(0)
    assert tally.last_reprefill_tokens == 8 + versions.count(0) and tally.last_pause_s > 0
    versions, tally, at_load = asyncio.run(run(SwapMode.DRAIN))
    assert versions == [0] * 200 and at_load == 200  # drain: the reply ended before the load
    assert tally.swaps == 1 and tally.last_reprefill_tokens == 0


def test_modes_other_backends_cannot_offer_are_refused_with_the_reason(tmp_path) -> None:
    assert swap_mode_problem("torch", "interrupt") is None and swap_mode_problem("vllm", "drain") is None
    reason = swap_mode_problem("vllm", "inplace")
    assert reason is not None and "LLM.generate" in reason and "rollout.weight_swap=drain" in reason
    with pytest.raises(ConfigError, match="rollout.weight_swap=interrupt is not available with rollout.engine=sglang"):
        load_config(None, ["rollout.engine=sglang", "rollout.weight_swap=interrupt"])
    with pytest.raises(ConfigError, match="rollout.weight_swap"):
        load_config(None, ["rollout.weight_swap=later"])
    assert load_config(None, ["rollout.weight_swap=inplace"]).rollout.weight_swap == "inplace"
