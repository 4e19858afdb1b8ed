"""TorchEngine's scheduler: requests join a running batch (continuous batching), a GRPO group's prompt
is prefilled once (prefix sharing), seeded rows come out the same whatever the batching, and the KV
budget bounds the running batch plus the kept caches. Counted in forward calls and stats, not timed."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from earl_stream.errors import EngineError
from earl_stream.workers.engines import AsyncBatcher, GenerateRequest, GenerateResult, TorchEngine

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, tie_word_embeddings=False)
    return Qwen2ForCausalLM(config).eval()


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(1, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run_until_done(engine: TorchEngine, rows: list, limit: int = 1000) -> int:
    """Step the engine until every row is done; returns the steps it took."""
    steps = 0
    while not all(r.done.is_set() for r in rows):
        engine.step()
        steps += 1
        assert steps < limit
    return steps


def alone(model: Qwen2ForCausalLM, req: GenerateRequest) -> GenerateResult:
    """The request on its own in a batch-to-completion engine without sharing: the reference."""
    return TorchEngine(model, continuous=False, prefix_sharing=False).generate([req])[0]


def assert_same(got: GenerateResult | None, want: GenerateResult) -> None:
    assert got is not None
    assert got.token_ids == want.token_ids
    assert got.logprobs == pytest.approx(want.logprobs, abs=1e-5)
    assert got.finish_reason is want.finish_reason


@pytest.mark.parametrize("continuous", [True, False])
def test_a_late_request_joins_the_running_batch(model: Qwen2ForCausalLM, continuous: bool) -> None:
    engine = TorchEngine(model, continuous=continuous)
    long_req = GenerateRequest(prompt(12, 1), 40, seed=1)
    late_req = GenerateRequest(prompt(25, 2), 3, seed=2)  # longer prompt: the running batch is re-padded
    (long_row,) = engine.submit([long_req])
    for _ in range(5):
        engine.step()
    (late_row,) = engine.submit([late_req])
    steps = run_until_done(engine, [late_row])
    if continuous:
        assert steps == 4  # admitted at the next step boundary, then 3 tokens: no wait for the 40-token row
        assert not long_row.done.is_set() and len(long_row.tokens) == 5 + 3
        assert engine.stats.admitted_while_running == 1
    else:
        assert steps > 30 and long_row.done.is_set()  # batch-to-completion: it waited
        assert engine.stats.admitted_while_running == 0
    run_until_done(engine, [long_row])
    assert_same(long_row.result, alone(model, long_req))
    assert_same(late_row.result, alone(model, late_req))
    assert engine.stats.running_kv_tokens == 0  # the batch ended: its KV storage is freed


def test_a_group_prompt_is_prefilled_once(model: Qwen2ForCausalLM) -> None:
    group = [GenerateRequest(prompt(20, 3), 6, temperature=1.0, seed=10 + i) for i in range(8)]
    other = GenerateRequest(prompt(9, 4), 6, seed=99)
    shared = TorchEngine(model)
    results = shared.generate([*group, other])
    assert shared.stats.prefill_tokens == 20 + 9
    assert shared.stats.shared_prefix_tokens == 7 * 20
    assert shared.stats.forward_calls == 1 + 5  # one prefill, then a decode step per further token
    assert len({tuple(r.token_ids) for r in results[:8]}) > 1  # each member samples with its own seed
    plain = TorchEngine(model, prefix_sharing=False)
    for got, want in zip(results, plain.generate([*group, other])):
        assert_same(got, want)
    assert plain.stats.prefill_tokens == 8 * 20 + 9 and plain.stats.shared_prefix_tokens == 0


def test_seeded_rows_match_whatever_the_batching(model: Qwen2ForCausalLM) -> None:
    """Groups arriving at different steps, mixed sampling settings and a second turn from kept caches:
    every row equals the same request run alone."""
    engine = TorchEngine(model, max_batch_size=10)
    groups = [[GenerateRequest(prompt(5 + 9 * g, g), 3 + 4 * g, temperature=[0.0, 1.0, 0.7][g], top_k=[0, 0, 20][g],
                               top_p=[1.0, 0.9, 1.0][g], seed=100 * g + i, cache_key=f"g{g}-{i}")
               for i in range(4)] for g in range(3)]
    rows = []
    for group in groups:  # arrive 2 steps apart; the batch holds at most 10 rows
        rows += engine.submit(group)
        engine.step()
        engine.step()
    run_until_done(engine, rows)
    assert engine.stats.admitted_while_running > 0 and engine.stats.shared_prefix_tokens > 0
    reqs = [r for group in groups for r in group]
    for row, req in zip(rows, reqs):
        assert_same(row.result, alone(model, req))
    second = [GenerateRequest([*req.prompt_ids, *row.result.token_ids, 7, 8], 5, temperature=1.0, seed=7 + i,
                              cache_key=req.cache_key) for i, (row, req) in enumerate(zip(rows, reqs))]
    before = engine.stats.reused_tokens
    for got, req in zip(engine.generate(second), second):
        assert_same(got, alone(model, req))
    assert engine.stats.reused_tokens > before


def test_the_kv_budget_bounds_running_rows_and_kept_caches(model: Qwen2ForCausalLM) -> None:
    budget = 160  # each request needs 20 + 12 positions: 5 rows at most, fewer next to kept caches
    engine = TorchEngine(model, kv_budget_tokens=budget)
    reqs = [GenerateRequest(prompt(20, 50 + i), 12, seed=i, cache_key=f"ep{i}") for i in range(12)]
    results = engine.generate(reqs)
    stats = engine.stats
    assert 0 < stats.peak_kv_tokens <= budget
    assert stats.batches >= 3  # admission waited for room instead of over-allocating
    assert 0 < stats.kept_cache_tokens <= budget
    for got, req in zip(results, reqs):
        assert_same(got, alone(model, req))
    roomy = TorchEngine(model, kv_budget_tokens=1 << 16)
    roomy.generate(reqs)
    assert roomy.stats.peak_kv_tokens > budget  # the bound above is the budget's doing


def test_the_batcher_hands_late_requests_to_the_running_batch(model: Qwen2ForCausalLM) -> None:
    engine = TorchEngine(model)
    long_req = GenerateRequest(prompt(10, 5), 300, seed=1)
    late_req = GenerateRequest(prompt(10, 6), 3, seed=2)

    async def main() -> tuple[bool, bool]:
        batcher = AsyncBatcher(engine, max_wait_s=0.0)
        long_task = asyncio.ensure_future(batcher.generate(long_req))
        while engine.stats.forward_calls < 3:
            await asyncio.sleep(0.001)
        late = await batcher.generate(late_req)
        long_running = engine.stats.generated_tokens < 100  # far from the long row's 300
        result = await long_task
        await batcher.aclose()
        return long_running, len(late.token_ids) == 3 and len(result.token_ids) == 300

    assert asyncio.run(main()) == (True, True)
    assert engine.stats.admitted_while_running == 1


def test_a_failed_step_fails_its_rows_and_later_requests_still_run(model: Qwen2ForCausalLM,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    engine = TorchEngine(model)
    assert engine._fast is not None
    (first,) = engine.submit([GenerateRequest(prompt(10, 1), 10, seed=1)])
    engine.step()
    engine.step()
    late_req = GenerateRequest(prompt(10, 2), 3, seed=2)
    (late,) = engine.submit([late_req])

    def out_of_memory(*args: object, **kwargs: object) -> None:
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory (simulated)")

    with monkeypatch.context() as patch:
        patch.setattr(engine._fast, "forward", out_of_memory)
        engine.step()
    assert first.done.is_set() and isinstance(first.error, EngineError) and "memory" in str(first.error)
    assert not late.done.is_set() and engine.stats.running_kv_tokens == 0
    run_until_done(engine, [late])
    assert_same(late.result, alone(model, late_req))


def test_the_batcher_resolves_each_request_when_its_row_finishes(model: Qwen2ForCausalLM) -> None:
    engine = TorchEngine(model)
    short_req = GenerateRequest(prompt(10, 7), 3, seed=1)
    long_req = GenerateRequest(prompt(10, 8), 300, seed=2)

    async def main() -> tuple[bool, int]:
        batcher = AsyncBatcher(engine, max_wait_s=0.05)  # both arrive within the wait: one batch
        long_task = asyncio.ensure_future(batcher.generate(long_req))
        short = await batcher.generate(short_req)
        generated = engine.stats.generated_tokens  # the long row is still decoding: far from its 300
        await long_task
        await batcher.aclose()
        assert short.token_ids == alone(model, short_req).token_ids
        return generated < 100, batcher.batches_run

    assert asyncio.run(main()) == (True, 1)


def test_exclusive_work_waits_for_running_rows_and_holds_later_ones(model: Qwen2ForCausalLM) -> None:
    engine = TorchEngine(model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    before = [GenerateRequest(prompt(10, 20 + i), 30, seed=i) for i in range(3)]
    after = GenerateRequest(prompt(10, 30), 5, seed=9)

    async def main() -> tuple[list[GenerateResult], GenerateResult]:
        batcher = AsyncBatcher(engine, max_wait_s=0.0)
        first = [asyncio.ensure_future(batcher.generate(r)) for r in before]
        while engine.stats.forward_calls < 2:
            await asyncio.sleep(0.001)
        load = asyncio.ensure_future(batcher.run_exclusive(lambda: engine.load_state_dict(state, 1)))
        late = asyncio.ensure_future(batcher.generate(after))
        results = await asyncio.gather(*first)
        await load
        out = await late
        await batcher.aclose()
        return results, out

    results, out = asyncio.run(main())
    assert [r.policy_version for r in results] == [0, 0, 0] and all(len(r.token_ids) == 30 for r in results)
    assert out.policy_version == 1


def test_on_token_sees_each_token_as_it_is_sampled(model: Qwen2ForCausalLM) -> None:
    """A request's observer gets its tokens in order at each decode step, before the result, through the
    batcher's continuous path; a failing observer fails nothing; rows without one are unchanged."""
    engine = TorchEngine(model)
    seen: list[tuple[int, int]] = []  # (token, tokens the engine had generated when it was observed)
    watched = GenerateRequest(prompt(10, 40), 12, seed=1,
                              on_token=lambda t: seen.append((t, engine.stats.generated_tokens)))

    def fail(token: int) -> None:
        raise ValueError(f"an observer's bug at token {token}")

    broken = GenerateRequest(prompt(10, 41), 12, seed=2, on_token=fail)
    plain = GenerateRequest(prompt(10, 42), 12, seed=3)

    async def main() -> list[GenerateResult]:
        batcher = AsyncBatcher(engine, max_wait_s=0.05)
        results = await asyncio.gather(*[batcher.generate(r) for r in (watched, broken, plain)])
        await batcher.aclose()
        return list(results)

    got = asyncio.run(main())
    assert [t for t, _ in seen] == got[0].token_ids
    assert len({at for _, at in seen}) == len(seen)  # one token per step, not all at the end
    assert_same(got[1], alone(model, GenerateRequest(prompt(10, 41), 12, seed=2)))
    assert_same(got[2], alone(model, plain))
