"""Admission under a KV budget: as multi-turn contexts grow the built-in engine runs
fewer rows at once and never holds more KV than its budget; a request too large even alone is refused
(never run); an episode past the rollout plan's bound stops as too long. Real engine, batcher and
agent loop on a tiny model built here; counted in rows and KV positions, not timed."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from earl_stream.env import StepResult, env_options
from earl_stream.model import load_model
from earl_stream.model.chat import ChatFormat
from earl_stream.workers.agent_loop import Sampling, play_episode
from earl_stream.workers.engines import AsyncBatcher, FinishReason, GenerateRequest, GenerateResult, TorchEngine
from earl_stream.workers.engines.admission import KVPlan
from earl_stream.workers.engines.base import RequestRefused
from earl_stream.workers.engines.static_kv import StaticKV

torch.set_num_threads(1)
BUDGET = 3000  # KV tokens
EPISODES, TURNS, OBSERVATION, REPLY = 12, 5, 120, 12


@pytest.fixture(scope="module")
def model() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, tie_word_embeddings=False)
    return Qwen2ForCausalLM(config).eval()


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(1, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def storage_tokens(engine: TorchEngine) -> int:
    """KV positions the running batch's tensors really hold (read from the tensors, not the counters)."""
    batch = engine._batch
    if batch is None or not isinstance(batch.cache, StaticKV):
        return 0
    layer = batch.cache.layers[0]
    return int(layer.k_store.shape[0] * layer.k_store.shape[2])


def play(engine: TorchEngine) -> tuple[list[int], list[list[list[int]]]]:
    """EPISODES multi-turn episodes played concurrently through the batcher: each turn's prompt is the
    whole context so far plus a new OBSERVATION-token observation. Returns the most rows running at
    once during each turn, and every episode's replies."""
    most = [0] * TURNS
    replies: list[list[list[int]]] = [[] for _ in range(EPISODES)]
    held: list[int] = []

    async def episode(e: int, batcher: AsyncBatcher, turn_done: list[asyncio.Barrier]) -> None:
        context = tokens(40, e)
        for turn in range(TURNS):
            def seen(_token: int, turn: int = turn) -> None:  # in the driving thread, at every decode step
                most[turn] = max(most[turn], engine.stats.running_rows)
                held.append(storage_tokens(engine) + engine.stats.kept_cache_tokens)

            result = await batcher.generate(GenerateRequest(context, REPLY, seed=1000 * e + turn, cache_key=f"ep{e}",
                                                            on_token=seen))
            replies[e].append(result.token_ids)
            context = context + result.token_ids + tokens(OBSERVATION, 100 * e + turn)
            await turn_done[turn].wait()  # turns in lockstep: every episode's context grows together

    async def go() -> None:
        batcher = AsyncBatcher(engine, max_batch_size=64)
        barriers = [asyncio.Barrier(EPISODES) for _ in range(TURNS)]
        try:
            await asyncio.gather(*[episode(e, batcher, barriers) for e in range(EPISODES)])
        finally:
            await batcher.aclose()

    asyncio.run(go())
    assert held and max(held) <= engine.capacity.kv_budget_tokens  # measured on the tensors at every decode step
    return most, replies


def test_fewer_rows_run_as_contexts_grow_and_the_kv_stays_within_budget(model: Qwen2ForCausalLM) -> None:
    engine = TorchEngine(model, max_batch_size=64, kv_budget_tokens=BUDGET)
    most, replies = play(engine)
    stats = engine.stats
    # rows of ~52, 184, 316, 448, 580 KV tokens (context + reply): all 12 at first, then fewer ([12, 12, 9, 6, 5])
    assert most == sorted(most, reverse=True) and most[0] == EPISODES and most[-1] <= EPISODES // 2, most
    assert 0 < stats.peak_kv_tokens <= BUDGET and stats.refused == 0 and stats.running_rows == 0
    # a roomy engine runs every turn's rows together; the budget changed the batching, not the tokens
    roomy = TorchEngine(model, max_batch_size=64, kv_budget_tokens=1 << 20)
    most_roomy, replies_roomy = play(roomy)
    assert most_roomy == [EPISODES] * TURNS and roomy.stats.peak_kv_tokens > BUDGET
    assert replies == replies_roomy


def test_kv_plan_counts_the_joining_rows_and_a_growing_storage() -> None:
    empty = KVPlan(layers=4).join(100, 20).join(50, 30)
    assert empty.peak_tokens == empty.after_tokens == 2 * (100 + 30)  # the prefill cache becomes the batch
    running = KVPlan(4, row_capacity=2, capacity=200, rows=2, length=150, room=10)
    fits = running.join(100, 20)  # a third row: the storage grows to 3 x (150 + 20)
    assert fits.grows and fits.after_tokens == 3 * 170
    assert fits.peak_tokens == max(400, 510) + 120 + -(-510 // 4)
    roomy = KVPlan(4, row_capacity=4, capacity=200, rows=2, length=150, room=10).join(100, 20)
    assert not roomy.grows and roomy.peak_tokens == 800 + 120


def test_storage_left_by_finished_rows_is_compacted_to_admit_a_new_row(model: Qwen2ForCausalLM) -> None:
    """A long row keeps the batch alive after three short ones left: their storage (4 rows x 110
    positions) would not leave room for a new row, the compacted storage (1 row) does."""
    engine = TorchEngine(model, kv_budget_tokens=500)
    reqs = [GenerateRequest(tokens(10, 1), 100, seed=1)] + [GenerateRequest(tokens(10, i), 3, seed=i) for i in (2, 3, 4)]
    rows = engine.submit(reqs)
    while not all(r.done.is_set() for r in rows[1:]):
        engine.step()
    assert engine.stats.running_rows == 1 and engine.stats.running_kv_tokens == 4 * 110
    late = GenerateRequest(tokens(30, 5), 10, seed=5)
    (late_row,) = engine.submit([late])
    engine.step()
    stats = engine.stats
    assert stats.running_rows == 2 and stats.admitted_while_running == 1 and engine._counts["compactions"] == 1
    while not (rows[0].done.is_set() and late_row.done.is_set()):
        engine.step()
    assert engine.stats.peak_kv_tokens <= 500
    alone = TorchEngine(model, continuous=False)
    for row, req in zip(rows + [late_row], reqs + [late]):
        want = alone.generate([req])[0]
        assert row.result is not None and row.result.token_ids == want.token_ids
        assert row.result.logprobs == pytest.approx(want.logprobs, abs=1e-5)


def test_a_prefill_runs_at_most_max_prefill_tokens_new_positions(model: Qwen2ForCausalLM) -> None:
    """Prefill activations are not KV: each admission's prefill is bounded in the positions it runs
    (past its first row), counting only what kept caches do not cover."""
    engine = TorchEngine(model, max_prefill_tokens=100)
    first = [GenerateRequest(tokens(40, i), 3, seed=i, cache_key=f"ep{i}") for i in range(5)]
    done = engine.generate(first)
    assert engine.stats.batches == 3  # 2 + 2 + 1 rows of 40 new tokens
    again = [GenerateRequest(r.prompt_ids + d.token_ids + tokens(5, 10 + i), 3, seed=i, cache_key=f"ep{i}")
             for i, (r, d) in enumerate(zip(first, done))]
    before = engine.stats.batches
    engine.generate(again)  # each row's kept KV covers all but ~7 tokens: one prefill for all five
    assert engine.stats.batches == before + 1 and engine.stats.reused_tokens > 0
    alone = TorchEngine(model, max_prefill_tokens=100).generate([GenerateRequest(tokens(150, 9), 3, seed=9)])
    assert len(alone[0].token_ids) == 3  # a single row longer than the bound still runs (alone)


def test_a_request_too_large_alone_is_refused_and_the_others_run(model: Qwen2ForCausalLM) -> None:
    engine = TorchEngine(model, kv_budget_tokens=100)

    async def go() -> list[object]:
        batcher = AsyncBatcher(engine)
        try:
            return await asyncio.gather(batcher.generate(GenerateRequest(tokens(90, 1), 20, seed=1)),
                                        batcher.generate(GenerateRequest(tokens(30, 2), 20, seed=2)),
                                        return_exceptions=True)
        finally:
            await batcher.aclose()

    big, small = asyncio.run(go())
    assert isinstance(big, RequestRefused) and "90 prompt + 20 new tokens" in str(big) and "100 tokens" in str(big)
    assert not isinstance(small, BaseException) and len(small.token_ids) == 20  # type: ignore[attr-defined]
    assert engine.stats.refused == 1 and engine.stats.peak_kv_tokens <= 100


class Checked:
    """An engine that checks a whole batch before running it, as the vLLM and SGLang backends do."""

    policy_version, capacity = 0, None

    def generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        if any(len(r.prompt_ids) + r.max_new_tokens > 100 for r in requests):
            raise RequestRefused("request 0: too long for the engine's context of 100 tokens")
        return [GenerateResult([1] * r.max_new_tokens, [0.0] * r.max_new_tokens, FinishReason.LENGTH, 0)
                for r in requests]

    def release(self, cache_key: str) -> None:
        pass


def test_a_batch_checked_whole_refuses_only_the_request_too_large() -> None:
    async def go() -> list[object]:
        batcher = AsyncBatcher(Checked(), max_wait_s=0.05)  # type: ignore[arg-type]
        try:
            return await asyncio.gather(batcher.generate(GenerateRequest([1] * 90, 20)),
                                        batcher.generate(GenerateRequest([1] * 30, 20)), return_exceptions=True)
        finally:
            await batcher.aclose()

    big, small = asyncio.run(go())
    assert isinstance(big, RequestRefused) and isinstance(small, GenerateResult) and len(small.token_ids) == 20


class Growing:
    """A multi-turn environment whose every observation is long: the context grows ~60 tokens a turn."""

    max_turn_tokens = 8

    async def reset(self, seed: int) -> str:
        return "remember these words"

    async def step(self, action_text: str) -> StepResult:
        return StepResult(" ".join(["apple banana cherry"] * 4), 0.0, False, {})


@pytest.mark.parametrize("bound", ["plan", "engine"])
def test_an_episode_past_the_bound_stops_as_too_long(tiny_model_dir: Path, bound: str) -> None:
    """The rollout plan's max_episode_tokens stops the episode; without one, the engine's budget refuses
    the turn that no longer fits. Either way a truncated sample within the bound, marked too_long."""
    torch.manual_seed(0)
    tiny, tokenizer = load_model(tiny_model_dir)
    cap = 300
    engine = TorchEngine(tiny.eval(), kv_budget_tokens=cap if bound == "engine" else 1 << 16)
    env = Growing()

    async def go() -> object:
        batcher = AsyncBatcher(engine)
        try:
            return await play_episode(env, env_options(env), ChatFormat(tokenizer), batcher, env_name="growing", seed=0,
                                      prompt_ordinal=0, group_id="g0", sampling=Sampling(), policy_version=lambda: 0,
                                      decode=tokenizer.decode, sample_seed=1,
                                      max_episode_tokens=(lambda: cap) if bound == "plan" else None)
        finally:
            await batcher.aclose()

    record = asyncio.run(go())
    info = record.info  # type: ignore[attr-defined]
    assert info["outcome"] == "truncated" and info["too_long"].startswith("stopped after")
    assert record.turns >= 2 and record.num_tokens <= cap  # type: ignore[attr-defined]
    assert record.loss_mask[-1] == 1 or record.input_ids[-1] == ChatFormat(tokenizer).end_token_id  # type: ignore[attr-defined]
    if bound == "engine":
        assert "KV budget is 300 tokens" in info["too_long"] and engine.stats.refused == 1
