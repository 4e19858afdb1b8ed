"""Chunked prefill of the built-in engine: a long prompt runs through the model a chunk of positions at a time.

Why: one forward over n prompt positions holds every layer's activations for all n at once and a boolean
causal mask of n x L query-key pairs (`supervisor.rollout_memory`), so one prompt of 4,096 tokens costs ~200 MB
of transient on a 2-layer toy model and grows as n x L. Run in chunks of at most `chunk_tokens` positions
(`rollout.prefill_chunk_tokens`), each chunk appending its K/V to the cache and attending to everything before
it, the transient is that of one chunk (its activations and a chunk x L mask), the KV and the result the same:
greedy tokens equal, logits to float rounding (the attention of a query sums its keys in other blocks).

It owns `chunk_bounds` (where a prefill of `width` left-padded positions is cut) and the two chunked forwards:
`fast_chunks` (the fast decoder, `StaticKV`) and `hf_chunks` (the Hugging Face forward, a `DynamicCache` that
grows by concatenation each chunk: full-attention layers only, see `hf_can_chunk`). The layout of the prefill is
`running.prefill_layout`'s, the choice of forward `forward_passes`'.

Chunks are counted from the right: the rows of a prefill are right-aligned (left padding), so a row's tokens are
cut at the same offsets from its end whatever rows share the prefill and however wide it is. With
`rows_share` (the default) a chunk's width is `chunk_tokens // rows` (at least 1), so one chunk holds at most
max(chunk_tokens, rows) positions; the batch-invariant path cuts every row at `chunk_tokens` whatever the rows,
so that a row's logits stay independent of its batch (its chunk then holds rows x chunk_tokens positions).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel

from earl_stream.workers.engines.fast_decoder import FastDecoder
from earl_stream.workers.engines.static_kv import StaticKV


def chunk_bounds(width: int, rows: int, chunk_tokens: int, *, rows_share: bool = True) -> list[tuple[int, int]]:
    """[start, end) column ranges covering [0, width), cut every `w` columns counted from the right, where w is
    `chunk_tokens // rows` (at least 1) with `rows_share`, else `chunk_tokens`; one range when `chunk_tokens` is
    0 (off) or `width` fits in one chunk. The first (leftmost) range is the remainder."""
    if chunk_tokens <= 0:
        return [(0, width)]
    w = max(1, chunk_tokens // max(1, rows)) if rows_share else chunk_tokens
    if width <= w:
        return [(0, width)]
    ends = list(range(width, 0, -w))
    return [(max(0, end - w), end) for end in reversed(ends)]


def fast_chunks(fast: FastDecoder, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache: StaticKV,
                bounds: list[tuple[int, int]]) -> torch.Tensor:
    """Run ids [B, n] int64 (positions [B, n]) after the cache's `length` kept positions, chunk by chunk over
    `bounds` (`chunk_bounds(n, ...)`); mask [B, length + n] covers kept and new positions. Returns the last
    position's logits [B, V] (model dtype)."""
    kept = cache.length
    logits = None
    for start, end in bounds:
        logits = fast.forward(ids[:, start:end], positions[:, start:end], mask[:, : kept + end], cache)
    assert logits is not None
    return logits


def hf_can_chunk(model: PreTrainedModel) -> bool:
    """True when every layer of `model` is full attention: its DynamicCache layers are plain ones, to which a chunk
    appends and over which it attends, as one forward would. Sliding-window layers drop keys as they grow, and the
    chunks' masks would have to say which: such models prefill whole."""
    config = model.config.get_text_config(decoder=True)
    return all(t == "full_attention" for t in (getattr(config, "layer_types", None) or ["full_attention"]))


def hf_chunks(model: PreTrainedModel, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
              cache: DynamicCache | None, bounds: list[tuple[int, int]],
              vision: dict[str, torch.Tensor] | None = None) -> tuple[torch.Tensor, Any]:
    """As `fast_chunks`, through the HF forward: `cache` holds the kept positions (None: none; kept width
    = mask width - n); `vision`: the images' inputs of the model's forward (one bound only: a vision tower
    fills its image tokens in one forward). Returns (the last position's logits [B, V], the cache holding
    every position)."""
    kept = mask.shape[1] - ids.shape[1]
    logits = None
    if vision and len(bounds) > 1:
        raise ValueError("a prefill with images runs in one forward, not in chunks")
    for start, end in bounds:
        out = model(input_ids=ids[:, start:end], attention_mask=mask[:, : kept + end],
                    position_ids=positions[..., start:end], past_key_values=cache, use_cache=True, logits_to_keep=1,
                    **(vision or {}))
        logits, cache = out.logits[:, -1, :], out.past_key_values
    assert logits is not None
    return logits, cache
