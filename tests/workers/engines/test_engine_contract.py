"""The Engine contract, run by every backend available here (torch always; vLLM in `make test-vllm`;
SGLang on a GPU machine with sglang installed), against the Hugging Face model itself:
greedy tokens, log-probs under the sampled-from distribution, stop tokens, seeds, weight loads,
capacity, the asyncio batcher, and request validation."""

from __future__ import annotations

import asyncio
import copy
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from earl_stream.errors import EngineError
from earl_stream.model import load_model
from earl_stream.workers.engines import AsyncBatcher, Engine, EngineCapacity, FinishReason, GenerateRequest
from earl_stream.workers.engines.registry import engine_names, make_engine, unavailable_reason
from earl_stream.workers.engines.sglang_engine import filtered_logprob

torch.set_num_threads(1)

CAPACITY = EngineCapacity(max_concurrent_sequences=8, kv_budget_tokens=8192)
BACKENDS = [
    pytest.param("torch"),
    pytest.param("vllm", marks=pytest.mark.vllm),
    pytest.param("sglang", marks=pytest.mark.sglang),
]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with an 8x output head: peaked distributions like a trained model's, so greedy
    decoding rarely meets a numerical near-tie that different kernels may break differently."""
    model, tokenizer = load_model(tiny_model_dir)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    out = tmp_path_factory.mktemp("contract-model")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def hf(model_dir: Path) -> PreTrainedModel:
    model, _ = load_model(model_dir)
    return model


@pytest.fixture(scope="module", params=BACKENDS)
def engine(request: pytest.FixtureRequest, model_dir: Path) -> Iterator[Engine]:
    reason = unavailable_reason(request.param)
    if reason is not None:
        pytest.skip(reason)
    eng = make_engine(request.param, model_dir, None, max_batch_size=CAPACITY.max_concurrent_sequences,
                      kv_budget_tokens=CAPACITY.kv_budget_tokens, seed=0)
    yield eng
    close = getattr(eng, "close", None)
    if close is not None:
        close()


def prompts(lengths: list[int], seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(6, 500, (n,), generator=gen).tolist() for n in lengths]


def next_token_logits(model: PreTrainedModel, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """Logits [len(generated), V] float32 at the positions that predicted each generated token."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + generated])).logits[0].float()
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(generated)]


def reference_logprobs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """base.py's convention, written out independently: log_softmax(logits / T) after top-k (exactly k by
    rank) then top-p (keep while the renormalised mass before a token is < p); greedy = log_softmax(logits)."""
    if temperature == 0:
        return torch.log_softmax(logits, dim=-1)
    x = logits / temperature
    values, order = x.sort(dim=-1, descending=True)
    if top_k > 0:
        values[:, top_k:] = float("-inf")
    if top_p < 1:
        probs = torch.softmax(values, dim=-1)
        values = values.masked_fill(probs.cumsum(-1) - probs >= top_p, float("-inf"))
    return torch.log_softmax(torch.empty_like(x).scatter(-1, order, values), dim=-1)


def assert_greedy(model: PreTrainedModel, prompt: list[int], tokens: list[int]) -> None:
    """Each token is the model's argmax given the engine's own prefix (up to a numerical near-tie)."""
    logits = next_token_logits(model, prompt, tokens)
    for i, tok in enumerate(tokens):
        gap = float(logits[i].max() - logits[i, tok])
        assert gap < 1e-4, f"token {i} ({tok}) is {gap:.2e} below the argmax {int(logits[i].argmax())}"


def assert_same_greedy(model: PreTrainedModel, prompt: list[int], a: list[int], b: list[int]) -> None:
    """Two greedy decodings of one prompt agree, or differ only after a numerical near-tie."""
    if a != b:
        assert_greedy(model, prompt, a)
        assert_greedy(model, prompt, b)


def test_engine_is_an_engine_and_reports_its_knobs(engine: Engine) -> None:
    assert isinstance(engine, Engine)
    assert engine.policy_version == 0
    assert engine.capacity == CAPACITY
    engine.release("an episode this engine never saw")  # unknown keys are ignored


def test_greedy_matches_the_model_with_logprobs_in_order(engine: Engine, hf: PreTrainedModel) -> None:
    ps = prompts([1, 5, 17, 40, 9])
    results = engine.generate([GenerateRequest(p, 8, temperature=0.0) for p in ps])
    assert len(results) == len(ps)
    for p, res in zip(ps, results):
        assert res.finish_reason is FinishReason.LENGTH and res.policy_version == 0
        assert len(res.token_ids) == len(res.logprobs) == 8
        assert_greedy(hf, p, res.token_ids)
        ref = reference_logprobs(next_token_logits(hf, p, res.token_ids), 0.0, 0, 1.0)
        expected = ref.gather(1, torch.tensor(res.token_ids)[:, None]).squeeze(1)
        assert res.logprobs == pytest.approx(expected.tolist(), abs=2e-4)
    alone = engine.generate([GenerateRequest(ps[3], 8, temperature=0.0)])[0]
    assert_same_greedy(hf, ps[3], alone.token_ids, results[3].token_ids)


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.7, 20, 0.9), (1.3, 0, 0.8)])
def test_sampled_logprobs_follow_the_convention(
    engine: Engine, hf: PreTrainedModel, temperature: float, top_k: int, top_p: float
) -> None:
    ps = prompts([3, 12, 30], seed=4)
    reqs = [GenerateRequest(p, 10, temperature=temperature, top_k=top_k, top_p=top_p, seed=i) for i, p in enumerate(ps)]
    for p, res in zip(ps, engine.generate(reqs)):
        ref = reference_logprobs(next_token_logits(hf, p, res.token_ids), temperature, top_k, top_p)
        expected = ref.gather(1, torch.tensor(res.token_ids)[:, None]).squeeze(1)
        assert bool(torch.isfinite(expected).all()), "a token outside the filtered set was sampled"
        assert res.logprobs == pytest.approx(expected.tolist(), abs=2e-4)


def test_a_seed_fixes_the_sample_whatever_the_batch(engine: Engine) -> None:
    p = prompts([7], seed=5)[0]
    req = GenerateRequest(p, 12, temperature=1.0, seed=1234)
    alone = engine.generate([req])[0]
    others = [GenerateRequest(q, 12, temperature=1.0) for q in prompts([4, 20, 9], seed=6)]
    batched = engine.generate([others[0], req, *others[1:]])[1]
    assert batched.token_ids == alone.token_ids
    assert batched.logprobs == pytest.approx(alone.logprobs, abs=1e-4)


def test_a_stop_token_ends_the_sequence_and_is_included(engine: Engine) -> None:
    p = prompts([6], seed=7)[0]
    free = engine.generate([GenerateRequest(p, 6, temperature=0.0)])[0].token_ids
    stop = free[2]
    cut = free.index(stop) + 1
    res = engine.generate([GenerateRequest(p, 6, temperature=0.0, stop_token_ids=frozenset({stop}))])[0]
    assert res.finish_reason is FinishReason.STOP
    assert res.token_ids == free[:cut] and len(res.logprobs) == cut
    never = next(t for t in range(6, 500) if t not in free)
    res = engine.generate([GenerateRequest(p, 6, temperature=0.0, stop_token_ids=frozenset({never}))])[0]
    assert res.finish_reason is FinishReason.LENGTH and res.token_ids == free


def test_loaded_weights_take_effect_in_place(engine: Engine, hf: PreTrainedModel) -> None:
    original = {k: v.clone() for k, v in hf.state_dict().items()}
    gen = torch.Generator().manual_seed(3)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in original.items()}
    changed = copy.deepcopy(hf)
    changed.load_state_dict(new)
    ps = prompts([1, 5, 17, 40, 9])  # the prompts of the greedy test: their prefixes may be cached
    try:
        engine.load_state_dict(new, 5)
        assert engine.policy_version == 5
        for p, res in zip(ps, engine.generate([GenerateRequest(p, 8, temperature=0.0) for p in ps])):
            assert res.policy_version == 5
            assert_greedy(changed, p, res.token_ids)
        with pytest.raises(EngineError):
            engine.load_state_dict({k: v for k, v in new.items() if "layers.0." not in k}, 6)
        with pytest.raises(EngineError):
            engine.load_state_dict({**new, "model.norm.weight": torch.ones(3)}, 6)
        assert engine.policy_version == 5
    finally:
        engine.load_state_dict(original, 7)
    for p, res in zip(ps, engine.generate([GenerateRequest(p, 8, temperature=0.0) for p in ps])):
        assert_greedy(hf, p, res.token_ids)


def test_capacity_can_be_lowered_and_is_validated(engine: Engine, hf: PreTrainedModel) -> None:
    ps = prompts([3, 8, 5, 13, 2], seed=8)
    reqs = [GenerateRequest(p, 5, temperature=0.0) for p in ps]
    full = engine.generate(reqs)
    smaller = EngineCapacity(2, 4096)
    engine.set_capacity(smaller)
    try:
        assert engine.capacity == smaller
        for p, a, b in zip(ps, engine.generate(reqs), full):
            assert_same_greedy(hf, p, a.token_ids, b.token_ids)
        with pytest.raises(EngineError):
            engine.set_capacity(EngineCapacity(0, 4096))
    finally:
        engine.set_capacity(CAPACITY)
    assert engine.capacity == CAPACITY


def test_the_batcher_drives_the_engine_from_its_worker_thread(engine: Engine, hf: PreTrainedModel) -> None:
    ps = prompts([2, 9, 4, 15, 6, 11], seed=9)
    reqs = [GenerateRequest(p, 6, temperature=0.0) for p in ps]
    direct = engine.generate(reqs)

    async def main() -> list[list[int]]:
        batcher = AsyncBatcher(engine, max_batch_size=CAPACITY.max_concurrent_sequences)
        try:
            results = await asyncio.gather(*(batcher.generate(r) for r in reqs))
        finally:
            await batcher.aclose()
        return [r.token_ids for r in results]

    for p, a, b in zip(ps, asyncio.run(main()), direct):
        assert_same_greedy(hf, p, a, b.token_ids)


def test_bad_requests_are_rejected_with_engine_errors(engine: Engine) -> None:
    with pytest.raises(EngineError, match="empty"):
        engine.generate([GenerateRequest([], 4)])
    with pytest.raises(EngineError, match="vocabulary"):
        engine.generate([GenerateRequest([1, 10**6], 4)])
    with pytest.raises(EngineError, match="max_new_tokens"):
        engine.generate([GenerateRequest([1, 2], 0)])
    assert engine.generate([]) == []


# ------------------------------------------------------------------ backend-independent pieces


def test_make_engine_names_the_known_backends(model_dir: Path) -> None:
    assert engine_names() == ["sglang", "torch", "vllm"]
    with pytest.raises(EngineError, match="known engines: sglang, torch, vllm"):
        make_engine("tensorrt", model_dir)
    for name in ("vllm", "sglang"):
        reason = unavailable_reason(name)
        if reason is not None:
            with pytest.raises(EngineError, match="install|GPU"):
                make_engine(name, model_dir)


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(1.0, 5, 1.0), (0.7, 20, 0.9), (1.0, 0, 0.5),
                                                               (2.0, 3, 0.5)])
def test_sglang_logprob_renormalisation_matches_the_convention(temperature: float, top_k: int, top_p: float) -> None:
    """SGLang reports log_softmax(logits / T) before filtering; `filtered_logprob` must turn that into base.py's
    convention from the top candidates alone (this part of the SGLang backend runs without a GPU)."""
    gen = torch.Generator().manual_seed(11)
    logits = 3 * torch.randn(6, 512, generator=gen)
    ref = reference_logprobs(logits, temperature, top_k, top_p)
    scaled = torch.log_softmax(logits / temperature, dim=-1)
    for row in range(logits.shape[0]):
        kept = torch.isfinite(ref[row]).nonzero().squeeze(1)
        candidates = scaled[row].topk(top_k if top_k > 0 else 256).values.tolist()
        for tok in kept[:5].tolist():
            got = filtered_logprob(float(scaled[row, tok]), candidates, top_k, top_p)
            assert got is not None and math.isclose(got, float(ref[row, tok]), abs_tol=1e-5)
    flat = torch.zeros(1, 512)  # a uniform distribution: the top-p nucleus is wider than 16 candidates
    assert filtered_logprob(-math.log(512), torch.log_softmax(flat, -1)[0, :16].tolist(), 0, 0.5) is None
