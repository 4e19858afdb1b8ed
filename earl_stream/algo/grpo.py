"""GRPO: group-normalised advantages and the clipped policy-gradient loss.

Pure functions of tensors; the trainer loop calls them. Loss is a token-level sum divided by a
`normalizer` given by the caller (the number of loss tokens in the whole global batch), so that the
gradient of a step does not depend on how the batch was split across ranks and micro-batches.

Off-policy correction (truncated importance sampling, TIS; Yao et al. 2025, "Your efficient RL
framework secretly brings you off-policy RL training"): the engine samples from pi_engine, which is
not exactly the trainer's pi_old (other kernels, precision, and in an asynchronous run older weights).
With `tis_cap > 0` the PPO ratio is taken against the trainer's own old log-probs and each token's
term is weighted by min(pi_old / pi_engine, tis_cap), detached.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F


def group_advantages(rewards: Sequence[float], group_ids: Sequence[str], *, eps: float = 1e-6,
                     scale_by_std: bool = True) -> np.ndarray:
    """Advantage of each sample = (reward - mean of its group) / (std of its group + eps).

    rewards: [N] float; group_ids: [N]. Returns [N] float32. A group whose rewards are all equal
    gets zero advantages (it carries no signal). std is the population std (ddof=0).
    """
    r = np.asarray(rewards, dtype=np.float64)
    if r.shape[0] != len(group_ids):
        raise ValueError(f"{r.shape[0]} rewards but {len(group_ids)} group ids")
    members: dict[str, list[int]] = defaultdict(list)
    for i, g in enumerate(group_ids):
        members[g].append(i)
    adv = np.zeros_like(r)
    for idx in members.values():
        vals = r[idx]
        centred = vals - vals.mean()
        adv[idx] = centred / (vals.std() + eps) if scale_by_std else centred
    return adv.astype(np.float32)


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """logits [B, T, V] of a causal LM over input_ids [B, T] -> [B, T] log p(token_t | tokens_<t).

    Position 0 has no prediction and gets 0. Computed in float32.
    """
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    picked = logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return F.pad(picked, (1, 0), value=0.0)


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """[B, T, V] -> [B, T] entropy (nats) of the next-token distribution, aligned like token_logprobs."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    ent = -(logp.exp() * logp).sum(-1)
    return F.pad(ent, (1, 0), value=0.0)


@dataclasses.dataclass(frozen=True)
class LossTerms:
    loss: torch.Tensor  # scalar, already divided by the normalizer
    stats: dict[str, float]  # sums over this micro-batch's loss tokens (divide by the normalizer)


def truncated_is_weights(old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor,
                         cap: float) -> torch.Tensor:
    """Per-token TIS weights min(exp(old_logprobs - behaviour_logprobs), cap), detached.

    old_logprobs (the trainer's pi_old), behaviour_logprobs (the engine's), mask: [B, T]. Returns
    [B, T] float32; 1 outside the mask. cap must be > 0.
    """
    if cap <= 0:
        raise ValueError(f"tis cap must be > 0, got {cap}")
    m = mask.float()
    with torch.no_grad():
        log_w = (old_logprobs.detach().float() - behaviour_logprobs.float()) * m
        return torch.exp(log_w).clamp(max=cap)


def clipped_pg_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps: float,
    normalizer: float,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    tis_cap: float = 0.0,
    old_logprobs: torch.Tensor | None = None,
) -> LossTerms:
    """PPO-style clipped surrogate.

    logprobs, behaviour_logprobs, mask: [B, T]; advantages: [B] (one per sample, broadcast over its
    tokens). KL to the reference uses the k3 estimator exp(ref-lp) - (ref-lp) - 1 (>= 0).

    tis_cap == 0: the old policy of the ratio is the engine's (behaviour) log-probs.
    tis_cap > 0 (TIS): the old policy is the trainer's `old_logprobs` [B, T] (default
    `logprobs.detach()`, exact when the batch gets one optimizer step, as here), and each token's
    clipped term is multiplied by `truncated_is_weights(old, behaviour, mask, tis_cap)`.
    Stats `tis_weight` and `tis_truncated` are sums of the weights and of truncated tokens.
    """
    m = mask.float()
    adv = advantages.float().unsqueeze(-1)
    weights = None
    if tis_cap > 0:
        old = logprobs.detach() if old_logprobs is None else old_logprobs.detach()
        weights = truncated_is_weights(old, behaviour_logprobs, mask, tis_cap)
        log_ratio = (logprobs - old) * m
        mismatch = (old - behaviour_logprobs) * m
    else:
        log_ratio = (logprobs - behaviour_logprobs) * m
        mismatch = log_ratio
    ratio = torch.exp(log_ratio)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv
    per_token = -torch.minimum(unclipped, clipped)
    if weights is not None:
        per_token = per_token * weights
    with torch.no_grad():
        stats = {
            "pg_loss": float((per_token * m).sum()),
            "clip_frac": float((((ratio - 1.0).abs() > clip_eps).float() * m).sum()),
            "mismatch_abs": float((mismatch.abs() * m).sum()),
        }
        if weights is not None:
            stats["tis_weight"] = float((weights * m).sum())
            stats["tis_truncated"] = float(((weights >= tis_cap).float() * m).sum())
    if ref_logprobs is not None and kl_coef > 0:
        d = (ref_logprobs - logprobs) * m
        kl = torch.exp(d) - d - 1.0
        per_token = per_token + kl_coef * kl
        stats["kl"] = float((kl.detach() * m).sum())
    if entropy is not None and entropy_coef > 0:
        per_token = per_token - entropy_coef * entropy
    if entropy is not None:
        stats["entropy"] = float((entropy.detach() * m).sum())
    loss = (per_token * m).sum() / normalizer
    return LossTerms(loss=loss, stats=stats)
