"""Token sampling of the built-in engine: per-row temperature, top-k and top-p, by inverse CDF with
uniforms the caller draws (so that a seeded request samples the same tokens in any batch).

It owns the log-prob convention of `base.py` for sampled and greedy rows; it leaves drawing the
uniforms (per-request generators) to the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from earl_stream.workers.engines.base import GenerateRequest


@dataclass(frozen=True)
class SamplingParams:
    """Per-row sampling knobs of a batch: temperature [B] float32 (0 = greedy), top_k [B] int64 (0 = off),
    top_p [B] float32 (1 = off)."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor

    @staticmethod
    def of(requests: Sequence[GenerateRequest]) -> SamplingParams:
        return SamplingParams(
            torch.tensor([r.temperature for r in requests], dtype=torch.float32),
            torch.tensor([r.top_k for r in requests], dtype=torch.long),
            torch.tensor([r.top_p for r in requests], dtype=torch.float32),
        )

    def select(self, idx: torch.Tensor) -> SamplingParams:
        return SamplingParams(self.temperature[idx], self.top_k[idx], self.top_p[idx])

    def to(self, device: torch.device) -> SamplingParams:
        """The same knobs on `device` (the logits' device; a no-op when they are there already)."""
        return SamplingParams(self.temperature.to(device), self.top_k.to(device), self.top_p.to(device))


def sample_tokens(
    logits: torch.Tensor, params: SamplingParams, uniforms: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row by inverse CDF with the given uniforms [B] in [0, 1).

    logits [B, V] float32. Returns tokens [B] int64 and their log-probs [B] float32 under the
    distribution sampled from: log_softmax(logits / T) after top-k then top-p, renormalised;
    greedy rows (T == 0) take the argmax and report log_softmax(logits) of it.
    """
    params, uniforms = params.to(logits.device), uniforms.to(logits.device)
    greedy = params.temperature <= 0
    scaled = logits / torch.where(greedy, 1.0, params.temperature)[:, None]
    if bool((params.top_k > 0).any()) or bool((params.top_p < 1).any()):
        scaled = _filter_top_k_top_p(scaled, params.top_k, params.top_p)
    logp = torch.log_softmax(scaled, dim=-1)
    cdf = logp.exp().cumsum(dim=-1)
    targets = (uniforms * cdf[:, -1])[:, None]
    sampled = torch.searchsorted(cdf, targets, right=True).squeeze(1).clamp_(max=logits.shape[-1] - 1)
    # Rounding can land the inverse CDF on a filtered-out token; fall back to the mode then.
    sampled_lp = logp.gather(1, sampled[:, None]).squeeze(1)
    sampled = torch.where(torch.isinf(sampled_lp), scaled.argmax(dim=-1), sampled)
    tokens = torch.where(greedy, logits.argmax(dim=-1), sampled)
    chosen = logp.gather(1, tokens[:, None]).squeeze(1)
    if bool(greedy.any()):
        plain = torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None]).squeeze(1)
        chosen = torch.where(greedy, plain, chosen)
    return tokens, chosen


def _filter_top_k_top_p(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set logits outside each row's top-k (exactly k by rank), then outside its top-p nucleus, to -inf."""
    vocab = scaled.shape[-1]
    values, order = scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=scaled.device)[None, :]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    drop = ranks >= k[:, None]
    values = values.masked_fill(drop, float("-inf"))
    probs = torch.softmax(values, dim=-1)
    # Keep a token while the mass before it is below p: the top token always stays.
    drop |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
    values = values.masked_fill(drop, float("-inf"))
    return torch.full_like(scaled, float("-inf")).scatter(-1, order, values)
