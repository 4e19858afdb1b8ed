"""The policy loss of one micro-batch: clipped surrogate (PPO, clip-higher, dual-clip), engine/trainer
mismatch correction per token (truncated IS or IcePop-style masking), KL to a reference (k1/k2/k3) and
an entropy bonus, aggregated by per-row weights that the caller computes for the whole step.

Pure functions of tensors; `workers.train_step` calls them. Aggregation (`row_weights`) is done with the
step's global counts, which the claim's metadata holds (every sample's loss-token count), so the loss of
a step does not depend on how it was split into micro-batches, data ranks or sequence slices.

Three log-probs per token: `behaviour` (the engine's, recorded while sampling), `old` (the trainer's, of
the weights the step started from: computed before the step's first update, or the current ones
detached when the step makes only one update), and the current `logprobs` (with gradient).
- is_correction=none: ratio = pi / pi_behaviour (the engine is the old policy).
- tis: ratio = pi / pi_old, each token weighted by min(pi_old / pi_behaviour, tis_cap) (Yao et al. 2025).
- mask: ratio = pi / pi_old, weighted by k = pi_old / pi_behaviour where is_mask_low <= k <= is_mask_high
  and 0 outside (IcePop, Ling team 2025: calibrate inside the band, drop the token outside).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from earl_stream.config import AlgoConfig


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


def row_weights(loss_tokens: list[int], agg: str) -> list[float]:
    """Weight of each token of each row so that sum(weight * per-token loss) is the step's loss.

    loss_tokens: [N] loss tokens of every row of the update (global counts, from the metadata).
    token-mean: 1 / sum(T); seq-mean-token-mean: 1 / (N T_i); seq-mean-token-sum: 1 / N.
    """
    n, total = len(loss_tokens), max(1, sum(loss_tokens))
    if agg == "token-mean":
        return [1.0 / total] * n
    if agg == "seq-mean-token-mean":
        return [1.0 / (n * max(1, t)) for t in loss_tokens]
    if agg == "seq-mean-token-sum":
        return [1.0 / n] * n
    raise ValueError(f"unknown loss aggregation {agg!r}")


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from samples of pi, [B, T] (Schulman 2020, "Approximating KL").

    With d = log ref - log pi: k1 = -d, k2 = d^2 / 2, k3 = exp(d) - d - 1 (unbiased and >= 0).
    """
    d = ref_logprobs - logprobs
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        return torch.exp(d) - d - 1.0
    raise ValueError(f"unknown KL estimator {estimator!r}")


def is_weights(old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor,
               algo: AlgoConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token correction weights [B, T] (detached) and the tokens they mask out [B, T] bool.

    k = exp(old - behaviour) on loss tokens (1 elsewhere); tis: min(k, tis_cap); mask: k inside
    [is_mask_low, is_mask_high], else 0 (and counted as masked).
    """
    with torch.no_grad():
        k = torch.exp((old_logprobs.detach().float() - behaviour_logprobs.float()) * mask.float())
        if algo.is_correction == "tis":
            if algo.tis_cap <= 0:
                raise ValueError(f"tis cap must be > 0, got {algo.tis_cap}")
            return k.clamp(max=algo.tis_cap), torch.zeros_like(k, dtype=torch.bool)
        if algo.is_correction == "mask":
            out = (k < algo.is_mask_low) | (k > algo.is_mask_high)
            return torch.where(out, torch.zeros_like(k), k), out & (mask > 0)
        raise ValueError(f"is_weights needs is_correction tis or mask, got {algo.is_correction!r}")


@dataclasses.dataclass(frozen=True)
class LossTerms:
    loss: torch.Tensor  # scalar: sum over tokens of weight * (policy + KL - entropy terms)
    stats: dict[str, float]  # see `policy_loss`


def clipped_surrogate(ratio: torch.Tensor, adv: torch.Tensor, algo: AlgoConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A), and for A < 0 at most -c A (dual-clip, Ye et al.
    2020) when dual_clip_c > 0. ratio [B, T], adv broadcastable. Returns (per-token loss, clip active)."""
    unclipped = -ratio * adv
    clipped = -torch.clamp(ratio, 1.0 - algo.clip_eps_low, 1.0 + algo.clip_eps_high) * adv
    loss = torch.maximum(unclipped, clipped)
    active = clipped > unclipped
    if algo.dual_clip_c > 0:
        bound = -algo.dual_clip_c * adv
        dual = (adv < 0) & (loss > bound)
        loss = torch.where(dual, bound.expand_as(loss), loss)
        active = active | dual
    return loss, active


def policy_loss(logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, weights: torch.Tensor, algo: AlgoConfig, *,
                old_logprobs: torch.Tensor | None = None, ref_logprobs: torch.Tensor | None = None,
                entropy: torch.Tensor | None = None) -> LossTerms:
    """The loss of one micro-batch.

    logprobs (with gradient), behaviour_logprobs, mask: [B, T]; advantages, weights: [B] (a row's
    advantage and its per-token weight from `row_weights`); old_logprobs [B, T] (default: logprobs
    detached); ref_logprobs [B, T] for the KL term in the loss (algo.kl_in=loss); entropy [B, T].
    Stats: `pg_loss` (the weighted policy term, a part of the step's loss) and sums over loss tokens of
    `clip_frac`, `ratio_dev` (|ratio - 1|), `mismatch_abs` (|old - behaviour|), `is_masked`,
    `tis_truncated`, `kl`, `entropy` (divide by the step's loss tokens).
    """
    m = mask.float()
    adv = advantages.float().unsqueeze(-1)
    old = logprobs.detach() if old_logprobs is None else old_logprobs.detach()
    base = behaviour_logprobs if algo.is_correction == "none" else old
    ratio = torch.exp((logprobs - base) * m)
    per_token, active = clipped_surrogate(ratio, adv, algo)
    masked = torch.zeros_like(m, dtype=torch.bool)
    if algo.is_correction != "none":
        w, masked = is_weights(old, behaviour_logprobs, mask, algo)
        per_token = per_token * w
    tw = weights.float().unsqueeze(-1) * m
    with torch.no_grad():
        stats = {"pg_loss": float((per_token * tw).sum()), "clip_frac": float((active.float() * m).sum()),
                 "ratio_dev": float(((ratio - 1.0).abs() * m).sum()),
                 "mismatch_abs": float(((old - behaviour_logprobs).abs() * m).sum()),
                 "is_masked": float(masked.float().sum())}
        if algo.is_correction == "tis":
            stats["tis_truncated"] = float(((w >= algo.tis_cap).float() * m).sum())
    if ref_logprobs is not None and algo.kl_coef > 0 and algo.kl_in == "loss":
        kl = kl_estimate(logprobs, ref_logprobs, algo.kl_estimator)
        per_token = per_token + algo.kl_coef * kl
        stats["kl"] = float((kl.detach() * m).sum())
    if entropy is not None:
        if algo.entropy_coef > 0:
            per_token = per_token - algo.entropy_coef * entropy
        stats["entropy"] = float((entropy.detach() * m).sum())
    return LossTerms(loss=(per_token * tw).sum(), stats=stats)
