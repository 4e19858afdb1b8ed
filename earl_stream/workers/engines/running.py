"""The built-in engine's running batch: the rows being decoded together and their shared KV layout.

It owns `Row` (one request from submission to result: its sampling generator, the kept KV it starts
from, the tokens so far, and the result or error the submitting thread waits for) and `RunningBatch`
(the rows, their KV cache, attention mask, positions and next-token logits, kept aligned row by
row), with the three layout changes continuous batching needs: admit rows (`join`), drop finished
rows (`keep_rows`) and drop leading padding every remaining row shares (`trim`); and the row-wise KV
and sampling helpers (kept KV in and out, per-row uniforms), and the layout of a prefill (`prefill_layout`:
which rows run, their ids, mask and positions). The cache is the fast decoder's `StaticKV` or, on the HF
forward, a DynamicCache of full-attention layers. Which rows to admit, the forward passes and the
sampling itself are `admission`'s, `forward_passes`'s and `sampling`'s job.

Layout (one row per request, all rows share the cache length T):
  mask [B, T]: | pad | row's tokens (kept KV, prompt, generated) |; positions are cumsum(mask) - 1.
A row admitted into a longer batch is left-padded to T; when it is longer, the batch is left-padded.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from earl_stream.workers.engines.base import FinishReason, GenerateRequest, GenerateResult, PromptImage
from earl_stream.workers.engines.kv_store import KeptKV
from earl_stream.workers.engines.static_kv import StaticKV


@dataclass
class Row:
    """One request from `submit` to its result; `done` is set once `result` or `error` is, then `on_done`
    is called (from the thread driving the engine: it must only hand the row over, e.g. to a loop)."""

    req: GenerateRequest
    prompt: list[int]
    generator: torch.Generator | None
    keep_key: str | None = None
    kept: KeptKV | None = None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    reason: FinishReason | None = None
    result: GenerateResult | None = None
    error: Exception | None = None
    done: threading.Event = field(default_factory=threading.Event)
    on_done: Callable[[Row], None] | None = None
    routing: list = field(default_factory=list)  # MoE: (start position, choices [n, L, k]) per forward (engines.routing)
    versions: list[int] = field(default_factory=list)  # per token: the weights version its logits came from
    logits_version: int = 0  # the version of the forward that computed the row's pending logits
    resumed: int = 0  # `tokens[:resumed]` are part of `prompt` (re-prefilled by an interrupting weight swap)
    stale_kv: bool = False  # its KV spans a weight swap (inplace): never kept for the episode's next turn
    interrupted: bool = False  # taken out of the batch by an interrupting swap, queued for its re-prefill

    @property
    def remaining(self) -> int:
        """Tokens still to generate at most (the last one is sampled but never fed)."""
        return self.req.max_new_tokens - len(self.tokens)

    @property
    def fed(self) -> int:
        """Positions whose KV the row holds once its last sampled token is fed: its prompt and the
        generated tokens not already in it."""
        return len(self.prompt) + len(self.tokens) - self.resumed

    def resume_from_context(self) -> int:
        """Make the whole context so far (prompt and generated tokens) the prompt of a fresh prefill, as
        an interrupting weight swap needs; returns its length (the tokens to re-prefill)."""
        self.prompt = self.prompt + self.tokens[self.resumed :]
        self.resumed = len(self.tokens)
        self.kept = None
        self.interrupted = True
        return len(self.prompt)

    def finish(self, result: GenerateResult | None = None, error: Exception | None = None) -> None:
        self.result, self.error = result, error
        self.done.set()
        if self.on_done is not None:
            self.on_done(self)


@dataclass
class RunningBatch:
    """Rows decoding together: cache (StaticKV or DynamicCache) of length T, mask [B, T] int64,
    positions [B] int64 (of the next fed token), logits [B, V] float32 (for the next sample)."""

    rows: list[Row]
    cache: StaticKV | DynamicCache
    mask: torch.Tensor
    positions: torch.Tensor
    logits: torch.Tensor

    @property
    def length(self) -> int:
        return int(self.mask.shape[1])

    @property
    def held_tokens(self) -> int:
        """KV positions this batch holds in memory (rows x positions of its storage)."""
        if isinstance(self.cache, StaticKV):
            return self.cache.held_tokens
        return len(self.rows) * self.length

    def keep_rows(self, stay: list[int]) -> None:
        """Keep only the rows `stay` (indices into `rows`, in order); the others leave and free their KV."""
        idx = torch.tensor(stay, dtype=torch.long, device=self.mask.device)
        select_rows(self.cache, idx)
        self.rows = [self.rows[j] for j in stay]
        self.mask, self.positions, self.logits = self.mask[idx], self.positions[idx], self.logits[idx]

    def trim(self) -> int:
        """Drop leading positions that are padding in every row, once they are at least half the batch
        (so that the copy is amortised over many steps). Returns the positions dropped."""
        if not self.rows:
            return 0
        used = self.mask.any(dim=0).nonzero()
        lead = int(used[0]) if used.numel() else self.length
        if lead * 2 < self.length:
            return 0
        if isinstance(self.cache, StaticKV):
            self.cache.trim_left(lead)
        else:
            for layer in _full_layers(self.cache):
                layer.keys, layer.values = layer.keys[:, :, lead:], layer.values[:, :, lead:]
        self.mask = self.mask[:, lead:]
        return lead

    def join(self, other: RunningBatch, room: int) -> None:
        """Append `other`'s rows (a freshly prefilled batch with the same kind of cache), right-aligned at the
        longer length, with KV room for `room` more positions (a StaticKV's storage; a DynamicCache grows as
        it goes). A DynamicCache must hold full-attention layers only (`_full_layers`)."""
        if isinstance(self.cache, StaticKV):
            assert isinstance(other.cache, StaticKV)
            shift = self.cache.append_rows(other.cache, room)
        else:
            assert not isinstance(other.cache, StaticKV)
            shift = max(self.length, other.length) - self.length
            for mine, theirs in zip(_full_layers(self.cache), _full_layers(other.cache), strict=True):
                lag = shift + self.length - other.length
                mine.keys = torch.cat([_pad_kv(mine.keys, shift), _pad_kv(theirs.keys, lag)])
                mine.values = torch.cat([_pad_kv(mine.values, shift), _pad_kv(theirs.values, lag)])
        width = self.length + shift
        self.mask = torch.cat([_pad_left(self.mask, shift), _pad_left(other.mask, width - other.length)])
        self.positions = torch.cat([self.positions, other.positions])
        self.logits = torch.cat([self.logits, other.logits])
        self.rows = self.rows + other.rows


def select_rows(cache: StaticKV | DynamicCache, idx: torch.Tensor) -> None:
    """Keep the rows `idx` [B'] int64 of a cache; repeats copy a row (a shared prompt's KV)."""
    if isinstance(cache, StaticKV):
        cache.select_rows(idx)
        return
    layers: list[Any] = list(cache.layers)  # DynamicLayer.batch_select_indices accepts repeated indices
    for layer in layers:
        layer.batch_select_indices(idx)


def merged_kept(rows: list[Row], cached: list[int], width: int) -> DynamicCache | None:
    """A DynamicCache holding every row's kept KV right-aligned in [B, kv_heads, width, head_dim] per layer."""
    if width == 0:
        return None
    sample = next(r.kept for r in rows if r.kept is not None)
    layers = []
    for k0, _ in sample.kv:
        shape = (len(rows), k0.shape[1], width, k0.shape[3])
        layers.append((k0.new_zeros(shape), k0.new_zeros(shape)))
    fill_kept(rows, cached, width, layers)
    return DynamicCache(ddp_cache_data=layers)


def fill_kept(rows: list[Row], cached: list[int], width: int, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy every row's kept KV into positions [width - c_i, width) of per-layer [B, kv_heads, >= width, head_dim]."""
    for li, (keys, values) in enumerate(layers):
        for b, (row, c) in enumerate(zip(rows, cached)):
            if row.kept is not None:
                keys[b, :, width - c : width] = row.kept.kv[li][0][0]
                values[b, :, width - c : width] = row.kept.kv[li][1][0]


def kept_kv(row: Row, cache: StaticKV | DynamicCache, mask: torch.Tensor, j: int) -> KeptKV:
    """The KV of finished row `j` to keep (prompt + all generated tokens but the last, never fed)."""
    sel = mask[j].nonzero().squeeze(1)
    tokens = row.prompt + row.tokens[row.resumed : -1]
    assert sel.numel() == len(tokens), (sel.numel(), len(tokens))
    layers: list[Any] = list(cache.layers)  # DynamicLayer and _StaticLayer both hold keys/values
    kv = [(layer.keys[j : j + 1].index_select(2, sel), layer.values[j : j + 1].index_select(2, sel))
          for layer in layers]
    return KeptKV(tokens, kv)


def draw_uniforms(rows: list[Row], rng: torch.Generator) -> torch.Tensor:
    """One uniform [B] float32 per row for `sample_tokens`: from the row's own generator if seeded (so its
    samples do not depend on the batch), else from the engine's `rng`; 0 for greedy rows."""
    uniforms = torch.zeros(len(rows))
    shared = [j for j, r in enumerate(rows) if r.generator is None and r.req.temperature > 0]
    if shared:
        uniforms[shared] = torch.rand(len(shared), generator=rng)
    for j, row in enumerate(rows):
        if row.generator is not None and row.req.temperature > 0:
            uniforms[j] = torch.rand((), generator=row.generator)
    return uniforms


def _pad_left(mask: torch.Tensor, n: int) -> torch.Tensor:
    return torch.cat([mask.new_zeros((mask.shape[0], n)), mask], dim=1) if n else mask


def _pad_kv(kv: torch.Tensor, n: int) -> torch.Tensor:
    """kv [B, kv_heads, L, D] with `n` zero positions added on the left (padding the mask hides)."""
    return torch.cat([kv.new_zeros((*kv.shape[:2], n, kv.shape[3])), kv], dim=2) if n else kv


def _full_layers(cache: DynamicCache) -> list[Any]:
    """The cache's layers, checked to be plain full-attention layers (positions can be added or dropped)."""
    layers: list[Any] = list(cache.layers)
    assert all(type(layer) is DynamicLayer for layer in layers), "only full-attention DynamicCache layers re-align"
    return layers


@dataclass
class PrefillLayout:
    """One prefill of admitted rows: `sources` (the rows run through the model; `index[i]`: the source of
    admitted row i), `cached[j]` kept positions of source j (right-aligned in [0, width_c)), ids
    [S, width_n] int64 of their new tokens (left-padded), mask [S, width_c + width_n] int64, positions
    [S, width_n] int64 of the new tokens."""

    sources: list[Row]
    index: list[int]
    cached: list[int]
    width_c: int
    width_n: int
    ids: torch.Tensor
    mask: torch.Tensor
    positions: torch.Tensor
    images: list[PromptImage] = field(default_factory=list)  # the images among the new tokens, in row-major order


def prefill_layout(rows: list[Row], sharing: bool, pad_id: int) -> PrefillLayout:
    """Lay out the prefill of `rows`. Rows that start from no kept cache and carry the same prompt (a GRPO
    group) share one source when `sharing`. The cache is as wide as the longest prompt (what admission
    counts): kept KV that would reach into another row's new tokens is used only up to width_c (and
    cut to it on the row: the rest of that row is recomputed)."""
    sources, index = _sources(rows, sharing)
    cached = [_image_floor(r, len(r.kept.tokens)) if r.kept is not None else 0 for r in sources]
    longest = max(len(r.prompt) for r in sources)
    while True:  # a row never reuses part of an image's KV: its cut moves to the image's start (which widens width_n)
        width_n = max(len(r.prompt) - c for r, c in zip(sources, cached))
        width_c = longest - width_n
        cut = [_image_floor(r, min(c, width_c)) for r, c in zip(sources, cached)]
        if cut == cached:
            break
        cached = cut
    for row, c in zip(sources, cached):
        if row.kept is not None and len(row.kept.tokens) > c:
            row.kept = row.kept.prefix(c) if c else None
    ids = torch.full((len(sources), width_n), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sources), width_c + width_n), dtype=torch.long)
    for b, (row, c) in enumerate(zip(sources, cached)):
        new = row.prompt[c:]
        ids[b, width_n - len(new) :] = torch.tensor(new, dtype=torch.long)
        mask[b, width_c - c : width_c] = 1
        mask[b, width_c + width_n - len(new) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, width_c:]
    images = [img for row, c in zip(sources, cached) for img in row.req.images if img.start >= c]
    return PrefillLayout(sources, index, cached, width_c, width_n, ids, mask, positions, images)


def _image_floor(row: Row, c: int) -> int:
    """`c` kept positions of `row`, moved back to the start of an image that they would cut."""
    for img in row.req.images:
        if img.start < c < img.start + img.tokens:
            return img.start
    return c


def _sources(rows: list[Row], sharing: bool) -> tuple[list[Row], list[int]]:
    """The rows to run through the model, and for each admitted row the index of its source."""
    sources: list[Row] = []
    index: list[int] = []
    by_prompt: dict[tuple[tuple[int, ...], tuple[bytes, ...]], int] = {}
    for row in rows:
        key = (tuple(row.prompt), tuple(i.key for i in row.req.images)) if sharing and row.kept is None else None
        if key is not None and key in by_prompt:
            index.append(by_prompt[key])
            continue
        if key is not None:
            by_prompt[key] = len(sources)
        index.append(len(sources))
        sources.append(row)
    return sources, index
