"""Log-probabilities and entropy of the next token, computed where the logits are.

Owns `forward_logprobs` and `vocab_entropy` for a batch built by `workers.batches.local_batch`
(position i is scored against `labels[i]`). Without tensor parallelism the logits are the model's
whole `[B, n, V]`. Under tensor parallelism the LM head is column-parallel over the vocabulary and
each rank holds `[B, n, V/tp]` (vocabulary ids [start, start + V/tp)); the full logits are never
gathered: the softmax normaliser, the label's logit and the entropy's sum are each one all-reduce
over the tp group of `[B, n]` values (Megatron-LM's vocab-parallel cross entropy).

Autograd: every tp rank holds the same rows, so everything computed after a reduction is the same
on every rank and each rank back-propagates the same loss into its own vocabulary shard. The
reductions therefore have an identity backward (Megatron's "g" operator); the shard's gradient is
exact because nothing rank-specific is computed from a reduced value (the entropy is
log Z - sum(p l) with both sums reduced first).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from earl_stream.model.loading import placeholder_token_ids


class _SumOverTP(torch.autograd.Function):
    """all_reduce(SUM) over the tp group in forward; identity in backward (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _shifted(local: torch.Tensor, group: Any) -> torch.Tensor:
    """Local logits (float32) minus the global max over the vocabulary (detached; cancels out)."""
    logits = local.float()
    top = logits.detach().amax(dim=-1)
    if group is not None:
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    return logits - top.unsqueeze(-1)


def _reduce(x: torch.Tensor, group: Any) -> torch.Tensor:
    return x if group is None else _SumOverTP.apply(x, group)


def vocab_logprobs(local_logits: torch.Tensor, labels: torch.Tensor, *, group: Any = None,
                   vocab_start: int = 0) -> torch.Tensor:
    """log p(labels) [B, n] float32 from logits `[B, n, V_local]` holding ids [vocab_start, +V_local).

    group None: V_local is the whole vocabulary (plain log_softmax + gather).
    """
    z = _shifted(local_logits, group)
    log_norm = torch.log(_reduce(z.exp().sum(-1), group))
    local_ids = labels - vocab_start
    inside = (local_ids >= 0) & (local_ids < z.shape[-1])
    picked = z.gather(-1, local_ids.clamp(0, z.shape[-1] - 1).unsqueeze(-1)).squeeze(-1) * inside
    return _reduce(picked, group) - log_norm


def vocab_entropy(local_logits: torch.Tensor, *, group: Any = None) -> torch.Tensor:
    """Next-token entropy [B, n] (nats) from logits `[B, n, V_local]` sharded over `group`'s ranks."""
    z = _shifted(local_logits, group)
    e = z.exp()
    norm = _reduce(e.sum(-1), group)
    weighted = _reduce((e * z).sum(-1), group)
    return torch.log(norm) - weighted / norm


_NEVER = -1e30  # a token's logit that no sampling reaches (finite: the entropy's e * z stays 0, not NaN)


def forward_logprobs(model: torch.nn.Module, batch: dict[str, torch.Tensor], *, group: Any = None,
                     vocab_start: int = 0, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(local logits [B, n, V_local], log p(labels) [B, n] float32) of a `local_batch` micro-batch.

    `temperature` is the rollout's: the logits are divided by it, so that the log-probs are those of
    the distribution the engine sampled from (the built-in engine and vLLM report theirs after the
    temperature); 0 (greedy) and 1 leave them as they are. A packed batch ([1, n], position ids
    restarting per row) runs inside `workers.packed_attention.packed_segments`."""
    # no KV cache: nothing is generated (a cache would also turn off transformers' packed-position checks)
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    never = placeholder_token_ids(getattr(model, "config", None))  # a VLM's image tokens (model.loading)
    local = [i - vocab_start for i in never if 0 <= i - vocab_start < logits.shape[-1]]
    if local:  # never sampled by the engine: left out of the distribution here too
        logits = logits.index_fill(-1, torch.tensor(local, device=logits.device), _NEVER)
    logp = vocab_logprobs(logits, batch["labels"], group=group, vocab_start=vocab_start)
    if never:  # an image token as a label is a prompt placeholder, never a choice: no log-prob
        logp = logp.masked_fill(torch.isin(batch["labels"], torch.tensor(never, device=logp.device)), 0.0)
    return logits, logp

