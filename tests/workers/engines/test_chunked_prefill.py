"""Chunked prefill (`engines.chunked_prefill`): a long prompt run a chunk of positions at a time gives the tokens and
log-probs of one whole forward, on the fast decoder and the HF forward, with kept KV, shared prompts and rows of
unequal lengths; the batch-invariant path stays batch-invariant; the rollout memory model counts the chunk."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from earl_stream.supervisor.model_shape import ModelShape
from earl_stream.supervisor.rollout_memory import engine_transient
from earl_stream.workers.engines import GenerateRequest, TorchEngine
from earl_stream.workers.engines.chunked_prefill import chunk_bounds, fast_chunks
from earl_stream.workers.engines.decode_path import DecodePath


@pytest.fixture(scope="module")
def model() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, max_position_embeddings=2048)
    return Qwen2ForCausalLM(config).eval()


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(1, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_chunks_are_cut_from_the_right_and_shared_by_the_rows() -> None:
    assert chunk_bounds(10, 1, 4) == [(0, 2), (2, 6), (6, 10)]
    assert chunk_bounds(10, 2, 4) == [(0, 2), (2, 4), (4, 6), (6, 8), (8, 10)]  # 2 rows x 2 columns each
    assert chunk_bounds(10, 3, 4) == [(i, i + 1) for i in range(10)]  # never below one column
    assert chunk_bounds(10, 2, 4, rows_share=False) == [(0, 2), (2, 6), (6, 10)]
    assert chunk_bounds(10, 1, 0) == chunk_bounds(10, 1, 10) == chunk_bounds(10, 4, 64) == [(0, 10)]


def test_the_fast_decoders_chunked_forward_gives_the_whole_forwards_logits_and_kv(model: Qwen2ForCausalLM) -> None:
    engine = TorchEngine(model)
    fast = engine.decode_path.decoder
    assert fast is not None
    ids = torch.tensor([[0] * 7 + _tokens(93, 1), _tokens(100, 2)])  # a row left-padded by 7
    mask = (ids != 0).long()
    mask[1] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.inference_mode():
        whole_cache, chunk_cache = fast.new_cache(2, 100), fast.new_cache(2, 100)
        whole = fast.forward(ids, positions, mask, whole_cache)
        chunked = fast_chunks(fast, ids, positions, mask, chunk_cache, chunk_bounds(100, 2, 32))
    assert chunk_cache.length == whole_cache.length == 100
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=1e-5)
    for a, b in zip(chunk_cache.layers, whole_cache.layers):
        torch.testing.assert_close(a.keys[:, :, 7:], b.keys[:, :, 7:], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a.values[1], b.values[1], atol=1e-5, rtol=1e-5)


def _turns(engine: TorchEngine) -> list[list[tuple[list[int], list[float]]]]:
    """Two turns of three episodes (prompts of 300, 170 and 41 tokens, two of them the same GRPO prompt, then
    contexts grown by 120 tokens on kept KV), greedy; and a seeded sampled row."""
    firsts = [_tokens(300, 0), _tokens(300, 0), _tokens(170, 1), _tokens(41, 2)]
    reqs = [GenerateRequest(p, 6, temperature=0.0, cache_key=f"e{i}") for i, p in enumerate(firsts)]
    reqs.append(GenerateRequest(_tokens(260, 3), 6, temperature=1.0, seed=7))
    got = engine.generate(reqs)
    again = [GenerateRequest([*r.prompt_ids, *g.token_ids, *_tokens(120, 10 + i)], 6, temperature=0.0,
                             cache_key=f"e{i}") for i, (r, g) in enumerate(zip(reqs[:4], got))]
    return [[(g.token_ids, g.logprobs) for g in turn] for turn in (got, engine.generate(again))]


@pytest.mark.parametrize("fast_forward", [True, False], ids=["fast", "hf_forward"])
def test_a_chunked_prefill_samples_what_a_whole_one_does(model: Qwen2ForCausalLM, fast_forward: bool) -> None:
    whole = TorchEngine(model, fast_forward=fast_forward, prefill_chunk_tokens=0)
    chunked = TorchEngine(model, fast_forward=fast_forward, prefill_chunk_tokens=64)
    path = DecodePath.FAST if fast_forward else DecodePath.HF_FORWARD
    assert whole.decode_path.path is chunked.decode_path.path is path
    want, got = _turns(whole), _turns(chunked)
    for want_turn, got_turn in zip(want, got, strict=True):
        for (w_tokens, w_lps), (g_tokens, g_lps) in zip(want_turn, got_turn, strict=True):
            assert g_tokens == w_tokens
            assert g_lps == pytest.approx(w_lps, abs=1e-5)
    # the same prefills, in more forwards: the chunks ran
    assert chunked.stats.prefill_tokens == whole.stats.prefill_tokens
    assert chunked.stats.forward_calls >= whole.stats.forward_calls + 10


def test_the_setting_reaches_the_engine_that_make_engine_starts(model: Qwen2ForCausalLM, tmp_path: Path) -> None:
    """`rollout.prefill_chunk_tokens` as the rollout worker passes it: 0 prefills whole, 64 in chunks."""
    from earl_stream.workers.engines.registry import make_engine

    calls: dict[int, int] = {}
    for chunk in (0, 64):
        engine = make_engine("torch", tmp_path, model, prefill_chunk_tokens=chunk)
        assert isinstance(engine, TorchEngine)
        engine.generate([GenerateRequest(_tokens(300, 0), 1, temperature=0.0)])
        calls[chunk] = engine.stats.forward_calls
    assert calls[64] >= calls[0] + 4  # 300 positions in 64-position forwards


def test_chunked_prefills_stay_batch_invariant(model: Qwen2ForCausalLM) -> None:
    """A row's tokens and log-probs are bitwise the same alone and in a prefill with wider and narrower rows."""
    row = GenerateRequest(_tokens(150, 5), 8, temperature=1.0, seed=3)
    others = [GenerateRequest(_tokens(n, 20 + n), 8, temperature=1.0, seed=n) for n in (230, 90, 33)]
    alone = TorchEngine(model, batch_invariant=True, prefill_chunk_tokens=64)
    batched = TorchEngine(model, batch_invariant=True, prefill_chunk_tokens=64)
    want = alone.generate([row])[0]
    got = batched.generate([others[0], row, *others[1:]])[1]
    assert (got.token_ids, got.logprobs) == (want.token_ids, want.logprobs)
    assert batched.stats.forward_calls > 8 + 1  # its prefill ran in chunks


SHAPE = ModelShape(hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64, intermediate_size=1024,
                   vocab_size=512)


def test_the_memory_model_counts_one_chunk_of_a_prefill() -> None:
    whole = engine_transient(SHAPE, design_seq_len=4096, rows=1, dtype_bytes=4, prefill_chunk_tokens=0)
    chunked = engine_transient(SHAPE, design_seq_len=4096, rows=1, dtype_bytes=4, prefill_chunk_tokens=512)
    assert (whole.prefill_positions, chunked.prefill_positions) == (4096, 512)
    # activations and masks shrink 8x (keys still reach 4,096), the last position's logits do not
    logits = 512 * (4 + 8)
    assert chunked.prefill_bytes - logits == (whole.prefill_bytes - logits) // 8
    # many rows: a chunk is at least one column of every row of the prefill
    rows = engine_transient(SHAPE, design_seq_len=256, rows=600, dtype_bytes=4, prefill_chunk_tokens=512)
    assert rows.prefill_positions == 600
    # a prompt shorter than a chunk: nothing changes
    short = engine_transient(SHAPE, design_seq_len=300, rows=1, dtype_bytes=4, prefill_chunk_tokens=512)
    assert short == engine_transient(SHAPE, design_seq_len=300, rows=1, dtype_bytes=4, prefill_chunk_tokens=0)
