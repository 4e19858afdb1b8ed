"""Packed micro-batches on one process: per-row attention equals a masked reference, the packed model
forward equals the padded one row by row, an sp rank's packed slice holds exactly its tokens, and a
micro-batch never materialises more tokens than its budget (`store.layout.materialised_tokens`)."""

from __future__ import annotations

import types
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from earl_stream.store.layout import Layout, materialised_tokens, partition
from earl_stream.workers.batches import local_batch, packed_local_batch, packed_token_ranges, packed_windows, sp_windows
from earl_stream.workers.packed_attention import PACKED, buckets, packed_segments, segment_attention, segment_bounds


def _masked_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: tuple[int, ...]) -> torch.Tensor:
    """Full S x S attention with a block-diagonal causal mask: q [1, H, S, d], k/v [1, KV, S, d] -> [1, S, H, d]."""
    s = q.shape[2]
    seg = torch.zeros(s, dtype=torch.long)
    for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        seg[a:b] = i
    allowed = (seg[:, None] == seg[None, :]) & torch.ones(s, s, dtype=torch.bool).tril()
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return (probs @ v).transpose(1, 2)


@pytest.mark.parametrize("base", ["sdpa", "eager"])
def test_segment_attention_equals_a_block_diagonal_causal_mask(base: str) -> None:
    gen = torch.Generator().manual_seed(0)
    bounds = segment_bounds([5, 1, 9, 4, 4], 25)  # five rows and two alignment-padding positions
    assert bounds == (0, 5, 6, 15, 19, 23, 25)
    # batched: rows padded to a bucket's longest (>= 3/4 of it), never more scores than the longest row's 9 x 9
    assert buckets(bounds) == [[(6, 15)], [(0, 5), (15, 19), (19, 23)], [(23, 25)], [(5, 6)]]
    q = torch.randn(1, 4, 25, 8, generator=gen)
    k, v = torch.randn(1, 2, 25, 8, generator=gen), torch.randn(1, 2, 25, 8, generator=gen)
    shim = types.SimpleNamespace(num_key_value_groups=2, training=False, is_causal=True)
    got = segment_attention(shim, q, k, v, bounds, base=base, scaling=8 ** -0.5)
    assert got.shape == (1, 25, 4, 8)
    assert torch.allclose(got, _masked_reference(q, k, v, bounds), atol=1e-6)


def _rows(lengths: list[int], vocab: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        mask = (rng.random(n) > 0.3).astype(np.uint8)
        mask[0] = 1  # a row's first token in the mask: it must not become the previous row's label
        out.append({"input_ids": rng.integers(1, vocab, n).astype(np.int32), "loss_mask": mask,
                    "behaviour_logprobs": -rng.random(n).astype(np.float32)})
    return out


def test_packed_forward_equals_the_padded_forward_row_by_row(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """... and transformers builds no packed-sequence (S x S) mask for it."""
    import transformers.masking_utils as masking

    from earl_stream.model import load_model
    from earl_stream.workers.vocab_parallel import forward_logprobs

    def no_mask(*_: object, **__: object) -> None:
        raise AssertionError("transformers looked for packed sequences to build their mask")

    torch.set_num_threads(1)
    model, _ = load_model(tiny_model_dir)
    lengths = [7, 30, 3, 12]
    rows = _rows(lengths, model.config.vocab_size)
    padded = local_batch(rows, np.zeros(4, np.float32), (0, max(lengths)))
    packed = packed_local_batch(rows, lengths, (0, sum(lengths)), 1)
    with torch.no_grad():
        want = forward_logprobs(model, padded)[1]
        with packed_segments([model], packed["segments"]), monkeypatch.context() as m:
            assert model.config._attn_implementation == PACKED
            m.setattr(masking, "find_packed_sequence_indices", no_mask)
            got = forward_logprobs(model, packed)[1][0]
        assert model.config._attn_implementation != PACKED  # restored on exit
    o = 0
    for r, n in enumerate(lengths):
        mask = packed["loss_mask"][0, o: o + n]
        assert torch.equal(mask, padded["loss_mask"][r, :n])  # the row's last position: no label
        assert torch.allclose(got[o: o + n] * mask, want[r, :n] * mask, atol=1e-5)
        assert (packed["token_rows"][o: o + n - 1] == r).all() and packed["token_rows"][o + n - 1] == -1
        o += n


@pytest.mark.parametrize("sp", [2, 3])
def test_sp_slices_of_a_packed_micro_batch_hold_exactly_their_tokens(sp: int) -> None:
    lengths = [7, 30, 3, 12]  # 52 tokens: alignment padding at sp=3
    rows = _rows(lengths, 100, seed=1)
    whole = packed_local_batch(rows, lengths, (0, -(-52 // sp) * sp), 1)
    for r in range(sp):
        (window,) = packed_windows([[0, 1, 2, 3]], lengths, sp, r)
        ranges = packed_token_ranges([[0, 1, 2, 3]], lengths, [window])
        pulled = [{k: v[a:b] for k, v in row.items()} for row, ((a, b),) in zip(rows, ranges.values())]
        part = packed_local_batch(pulled, lengths, window, sp)
        a, n = window
        for key in ("input_ids", "position_ids", "labels", "loss_mask", "behaviour_logprobs"):
            assert torch.equal(part[key][0], whole[key][0, a: a + n]), (r, key)
        assert part["segments"] == whole["segments"] == segment_bounds(lengths, sp * n)
        assert sum(b - a for ((a, b),) in ranges.values()) <= n + len(lengths)  # its slice, plus one label each
    lost = packed_local_batch([rows[0], None, rows[2], rows[3]], lengths, (0, 52), 1)  # row 1 lost since planning
    assert torch.equal(lost["input_ids"][0, :7], whole["input_ids"][0, :7]) and lost["segments"] == (0, 7, 37, 40, 52)
    assert not lost["loss_mask"][0, 7:37].any() and torch.equal(lost["loss_mask"][0, 37:], whole["loss_mask"][0, 37:52])


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.one_of(st.integers(1, 40), st.integers(200, 900)), min_size=1, max_size=30),
       budget=st.integers(1, 1200), sp=st.integers(1, 4), packed=st.booleans())
def test_a_skewed_micro_batch_never_materialises_more_than_its_budget(lengths: list[int], budget: int, sp: int,
                                                                      packed: bool) -> None:
    """What a rank builds for each micro-batch (its windows' tensors) is what the budget counts, and the
    budget holds except for a row that alone exceeds it, which gets a micro-batch of its own."""
    part = partition(lengths, Layout(cp_size=sp, cp_rank=sp - 1), micro_batch_tokens=budget, packed=packed)
    windows = (packed_windows if packed else sp_windows)(part.micro_batches, lengths, sp, sp - 1)
    for mb, (_, n) in zip(part.micro_batches, windows):
        built = n if packed else len(mb) * n  # [1, n] packed, [B, n] padded: tokens on this sp rank
        assert built * sp == materialised_tokens([lengths[i] for i in mb], sp, packed=packed)
        assert built <= budget or len(mb) == 1
