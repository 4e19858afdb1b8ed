"""One GRPO training step on one rank, given the step's claimed metadata.

Every rank computes the same partition of the claim (`earl_stream.store.layout.partition`) and
pulls only its own rows from their producers. Advantages come from the metadata alone (rewards and
groups), so no rank needs another rank's bytes. The loss is normalised by the number of loss tokens
in the whole claim, and gradients are summed across ranks, so the update does not depend on how the
batch was split.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist

from earl_stream.algo.grpo import clipped_pg_loss, group_advantages, token_entropy, token_logprobs
from earl_stream.config import TrainerConfig
from earl_stream.store.experience import Puller
from earl_stream.store.experience import SamplesUnavailable, pull_samples
from earl_stream.store.layout import Layout, partition
from earl_stream.store.schema import SampleMeta

FIELDS = ("input_ids", "loss_mask", "behaviour_logprobs")


@dataclasses.dataclass
class StepResult:
    loss: float
    grad_norm: float
    mismatch: float  # mean |trainer log-prob - engine log-prob| over loss tokens
    clip_frac: float
    entropy: float
    mean_reward: float
    samples: int
    tokens: int
    step_seconds: float
    pull_seconds: float
    pull_bytes: int
    lost_sample_ids: list[str]

    def metrics(self) -> dict[str, float]:
        return {k: float(v) for k, v in dataclasses.asdict(self).items() if isinstance(v, (int, float))}


def batch_tensors(rows: Sequence[dict[str, np.ndarray]], advantages: np.ndarray) -> dict[str, torch.Tensor]:
    """Right-pad rows into [B, T] tensors: input_ids int64, attention/loss masks, behaviour log-probs."""
    width = max(len(r["input_ids"]) for r in rows)
    b = len(rows)
    ids = torch.zeros(b, width, dtype=torch.long)
    attn = torch.zeros(b, width, dtype=torch.long)
    mask = torch.zeros(b, width, dtype=torch.float32)
    blp = torch.zeros(b, width, dtype=torch.float32)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n] = torch.from_numpy(r["input_ids"].astype(np.int64))
        attn[i, :n] = 1
        mask[i, :n] = torch.from_numpy(r["loss_mask"].astype(np.float32))
        blp[i, :n] = torch.from_numpy(r["behaviour_logprobs"])
    return {"input_ids": ids, "attention_mask": attn, "loss_mask": mask, "behaviour_logprobs": blp,
            "advantages": torch.from_numpy(np.asarray(advantages, dtype=np.float32))}


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, metas: Sequence[SampleMeta], layout: Layout,
               client: Puller, cfg: TrainerConfig, *, ref_model: torch.nn.Module | None = None,
               rank: int = 0) -> StepResult:
    start = time.monotonic()
    world = layout.dp_size
    advantages = group_advantages([m.reward for m in metas], [m.group_id for m in metas])
    normalizer = float(max(1, sum(m.response_tokens for m in metas)))
    part = partition([m.total_tokens for m in metas], layout, micro_batch_tokens=cfg.micro_batch_tokens)
    pull_start = time.monotonic()
    pulled, lost = _pull(client, metas, part.rows)
    pull_seconds = time.monotonic() - pull_start
    sums = {"pg_loss": 0.0, "mismatch_abs": 0.0, "clip_frac": 0.0, "entropy": 0.0}
    for mb in part.micro_batches:
        rows = [i for i in mb if i in pulled]
        if not rows:
            continue
        batch = batch_tensors([pulled[i] for i in rows], advantages[rows])
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        logp = token_logprobs(out.logits, batch["input_ids"])
        ref = None
        if ref_model is not None:
            with torch.no_grad():
                ref = token_logprobs(ref_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits,
                                     batch["input_ids"])
        ent = token_entropy(out.logits.detach()) if cfg.entropy_coef == 0 else token_entropy(out.logits)
        terms = clipped_pg_loss(logp, batch["behaviour_logprobs"], batch["advantages"], batch["loss_mask"],
                                clip_eps=cfg.clip_eps, normalizer=normalizer, ref_logprobs=ref, kl_coef=cfg.kl_coef,
                                entropy=ent, entropy_coef=cfg.entropy_coef)
        terms.loss.backward()
        for k in sums:
            sums[k] += terms.stats.get(k, 0.0)
    stats = torch.tensor([sums["pg_loss"], sums["mismatch_abs"], sums["clip_frac"], sums["entropy"]], dtype=torch.float64)
    if world > 1:
        for p in model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad)
        dist.all_reduce(stats)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip if cfg.grad_clip > 0 else float("inf"))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    pull_bytes = sum(sum(a.nbytes for a in r.values()) for r in pulled.values())
    return StepResult(
        loss=float(stats[0]) / normalizer, grad_norm=float(grad_norm), mismatch=float(stats[1]) / normalizer,
        clip_frac=float(stats[2]) / normalizer, entropy=float(stats[3]) / normalizer,
        mean_reward=float(np.mean([m.reward for m in metas])), samples=len(metas),
        tokens=sum(m.total_tokens for m in metas), step_seconds=time.monotonic() - start,
        pull_seconds=pull_seconds, pull_bytes=pull_bytes, lost_sample_ids=lost,
    )


def _pull(client: Puller, metas: Sequence[SampleMeta], rows: Sequence[int]) -> tuple[dict[int, dict[str, np.ndarray]], list[str]]:
    """Pull this rank's rows; rows whose producer is gone are dropped with their whole group."""
    mine = [metas[i] for i in rows]
    try:
        data = pull_samples(client, mine, FIELDS)
        return dict(zip(rows, data)), []
    except SamplesUnavailable as exc:
        missing = set(exc.sample_ids)
    lost_groups = {m.group_id for m in mine if m.sample_id in missing}
    keep = [i for i in rows if metas[i].group_id not in lost_groups]
    data = pull_samples(client, [metas[i] for i in keep], FIELDS)
    lost = [m.sample_id for m in metas if m.group_id in lost_groups]
    return dict(zip(keep, data)), lost
