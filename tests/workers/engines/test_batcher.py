"""AsyncBatcher with a real TorchEngine: concurrent episodes share batches, results equal direct
engine calls, exclusive work never overlaps a batch, and a failing batch fails only its callers."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Mapping, Sequence

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from earl_stream.errors import EngineError
from earl_stream.workers.engines import AsyncBatcher, EngineCapacity, GenerateRequest, GenerateResult, TorchEngine

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
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


class WatchedEngine:
    """A real TorchEngine that records whether a generate call is running (the batcher's view of it)."""

    def __init__(self, inner: TorchEngine, delay_s: float = 0.0) -> None:
        self.inner = inner
        self.delay_s = delay_s
        self.active = threading.Event()
        self.calls = 0

    def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        assert not self.active.is_set(), "two batches overlap"
        self.active.set()
        try:
            self.calls += 1
            time.sleep(self.delay_s)
            return self.inner.generate(requests)
        finally:
            self.active.clear()

    def load_state_dict(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        self.inner.load_state_dict(state, version)

    def release(self, cache_key: str) -> None:
        self.inner.release(cache_key)

    @property
    def policy_version(self) -> int:
        return self.inner.policy_version

    @property
    def capacity(self) -> EngineCapacity:
        return self.inner.capacity

    def set_capacity(self, capacity: EngineCapacity) -> None:
        self.inner.set_capacity(capacity)


def requests(n: int) -> list[GenerateRequest]:
    gen = torch.Generator().manual_seed(11)
    out = []
    for i in range(n):
        prompt = torch.randint(0, 256, (3 + (7 * i) % 40,), generator=gen).tolist()
        out.append(GenerateRequest(prompt, 2 + i % 5, temperature=0.0 if i % 3 == 0 else 1.0, seed=i))
    return out


def test_concurrent_coroutines_match_direct_calls_in_fewer_batches(model: Qwen2ForCausalLM) -> None:
    reqs = requests(40)
    direct = [TorchEngine(model).generate([r])[0] for r in reqs]

    async def main() -> tuple[list[GenerateResult], AsyncBatcher]:
        batcher = AsyncBatcher(TorchEngine(model), max_batch_size=16, max_wait_s=0.01)

        async def episode(i: int) -> GenerateResult:
            await asyncio.sleep(0.001 * (i % 4))  # arrivals spread a little, as episodes do
            return await batcher.generate(reqs[i])

        results = await asyncio.gather(*(episode(i) for i in range(40)))
        await batcher.aclose()
        return list(results), batcher

    results, batcher = asyncio.run(main())
    for got, want in zip(results, direct):
        assert got.token_ids == want.token_ids
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-5)
        assert got.finish_reason is want.finish_reason
    assert batcher.requests_run == 40
    assert 3 <= batcher.batches_run < 40


def test_run_exclusive_never_overlaps_a_batch(model: Qwen2ForCausalLM) -> None:
    engine = WatchedEngine(TorchEngine(model), delay_s=0.005)
    reqs = requests(30)
    seen: list[int] = []

    def weight_load(version: int) -> int:
        assert not engine.active.is_set(), "exclusive work ran during a batch"
        time.sleep(0.01)
        engine.load_state_dict(model.state_dict(), version)
        assert not engine.active.is_set()
        seen.append(version)
        return version

    async def async_work() -> str:
        assert not engine.active.is_set()
        await asyncio.sleep(0.005)
        assert not engine.active.is_set()
        return "ok"

    async def main() -> list[object]:
        batcher = AsyncBatcher(engine, max_batch_size=4, max_wait_s=0.001)
        gens = [batcher.generate(r) for r in reqs]
        loads = [batcher.run_exclusive(lambda v=v: weight_load(v)) for v in (1, 2, 3)]
        out = await asyncio.gather(*gens[:10], loads[0], *gens[10:20], loads[1], async_work(), *gens[20:], loads[2])
        exclusive_async = await batcher.run_exclusive(async_work)
        batcher.close()
        return [*out, exclusive_async]

    out = asyncio.run(main())
    assert seen == [1, 2, 3] and engine.policy_version == 3
    assert out[-1] == "ok" and out.count("ok") == 2
    assert engine.calls >= 30 // 4


def test_release_reaches_the_engine_cache(model: Qwen2ForCausalLM) -> None:
    engine = TorchEngine(model)
    request = GenerateRequest(requests(1)[0].prompt_ids, 3, seed=1, cache_key="episode-1")

    async def main() -> tuple[int, int]:
        batcher = AsyncBatcher(engine)
        await batcher.generate(request)
        kept = engine.stats.kept_cache_tokens
        batcher.release("episode-1")
        await batcher.aclose()
        return kept, engine.stats.kept_cache_tokens

    assert asyncio.run(main()) == (len(request.prompt_ids) + 2, 0)


def test_engine_error_fails_exactly_its_batch(model: Qwen2ForCausalLM) -> None:
    good = requests(6)
    bad = GenerateRequest([], 2)  # the engine rejects an empty prompt

    async def main() -> tuple[list[object], list[object]]:
        batcher = AsyncBatcher(TorchEngine(model), max_batch_size=3, max_wait_s=0.05)
        first = await asyncio.gather(*(batcher.generate(r) for r in (good[0], bad, good[1])), return_exceptions=True)
        second = await asyncio.gather(*(batcher.generate(r) for r in good[2:5]), return_exceptions=True)
        batcher.close()
        return list(first), list(second)

    first, second = asyncio.run(main())
    assert all(isinstance(r, EngineError) for r in first)
    assert all(isinstance(r, GenerateResult) for r in second)


def test_event_loop_runs_during_a_batch_and_close_fails_waiters(model: Qwen2ForCausalLM) -> None:
    engine = WatchedEngine(TorchEngine(model), delay_s=0.2)

    async def main() -> tuple[int, list[object]]:
        batcher = AsyncBatcher(engine, max_batch_size=2, max_wait_s=0.0)
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        tick_task = asyncio.create_task(ticker())
        running = asyncio.gather(*(batcher.generate(r) for r in requests(4)), return_exceptions=True)
        await asyncio.sleep(0.1)  # first batch is inside the engine, second is waiting
        ticks_during_batch = ticks
        batcher.close()
        results = await running
        tick_task.cancel()
        with pytest.raises(EngineError, match="closed"):
            await batcher.generate(requests(1)[0])
        return ticks_during_batch, list(results)

    ticks, results = asyncio.run(main())
    assert ticks >= 4
    assert all(isinstance(r, EngineError) for r in results)


def test_requests_that_gather_share_one_batch_until_all_are_here(model: Qwen2ForCausalLM) -> None:
    """Requests arriving one by one (as HTTP agents' do) share a batch when they ask to gather, and stop
    waiting as soon as `all_here()` says no more are coming."""
    reqs = requests(6)

    async def run(gather: float, expected: int) -> int:
        batcher = AsyncBatcher(TorchEngine(model), max_batch_size=16, max_wait_s=0.002)
        arrived = 0

        async def agent(i: int) -> GenerateResult:
            nonlocal arrived
            await asyncio.sleep(0.006 * i)  # 6 ms apart: more than max_wait_s, less than the quiet gap
            arrived += 1
            return await batcher.generate(reqs[i], gather_quiet_s=gather, gather_max_s=2.0,
                                          all_here=lambda: arrived >= expected)

        start = time.monotonic()
        await asyncio.gather(*(agent(i) for i in range(6)))
        elapsed = time.monotonic() - start
        await batcher.aclose()
        assert elapsed < 1.5, "gathering waited for its cap although every request was there"
        return batcher.batches_run

    assert asyncio.run(run(0.0, 6)) >= 2  # no gathering: the arrivals split into several batches
    assert asyncio.run(run(0.05, 6)) == 1  # gathering: one batch, started once all six were here
    assert asyncio.run(run(0.05, 99)) == 1  # more expected than come: the quiet gap ends the wait
