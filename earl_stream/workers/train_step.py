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
from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist

from earl_stream.algo.grpo import clipped_pg_loss, group_advantages
from earl_stream.config import TrainerConfig
from earl_stream.errors import ConfigError
from earl_stream.store.experience import Puller, SamplesUnavailable, pull_samples
from earl_stream.store.layout import Layout, partition
from earl_stream.store.schema import SampleMeta
from earl_stream.workers.parallel import agree_on_lost, entropy, forward_logprobs, local_batch, sp_state, sp_token_ranges, sp_windows

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
    world = layout.world_size  # dp and sp ranks alike hold partial gradients of the same weights
    if sp_state() != (layout.cp_size, layout.cp_rank):
        raise ConfigError(f"layout has sp={layout.cp_size} (rank {layout.cp_rank}) but the model runs sp={sp_state()}: "
                          "apply the plan with earl_stream.workers.parallel.apply_plan first")
    advantages = group_advantages([m.reward for m in metas], [m.group_id for m in metas])
    normalizer = float(max(1, sum(m.response_tokens for m in metas)))
    lengths = [m.total_tokens for m in metas]
    part = partition(lengths, layout, micro_batch_tokens=cfg.micro_batch_tokens)
    windows: list = [None] * len(part.micro_batches)
    ranges = None
    if layout.cp_size > 1:  # Ulysses: this rank pulls and runs only its slice of every micro-batch
        windows = sp_windows(part.micro_batches, lengths, layout.cp_size, layout.cp_rank)
        ranges = sp_token_ranges(part.micro_batches, lengths, windows)
    pull_start = time.monotonic()
    pulled, lost = _pull(client, metas, part.rows, ranges)
    if world > 1:
        # Before any forward pass every rank drops the groups any rank lost: an sp group's ranks must
        # run the same rows, and no rank may train part of a group that the ledger re-issues.
        pulled, lost = agree_on_lost(metas, pulled, lost)
    pull_seconds = time.monotonic() - pull_start
    if len(lost) == len(metas):
        # Every group was lost (its producers died): no optimizer step, which with Adam's momentum would
        # still move the weights without any data. Every rank knows the agreed lost set, so all skip.
        optimizer.zero_grad(set_to_none=True)
        return StepResult(loss=0.0, grad_norm=0.0, mismatch=0.0, clip_frac=0.0, entropy=0.0,
                          mean_reward=float(np.mean([m.reward for m in metas])) if metas else 0.0, samples=0, tokens=0,
                          step_seconds=time.monotonic() - start, pull_seconds=pull_seconds, pull_bytes=0,
                          lost_sample_ids=lost)
    sums = {"pg_loss": 0.0, "mismatch_abs": 0.0, "clip_frac": 0.0, "entropy": 0.0}
    for mb, window in zip(part.micro_batches, windows):
        rows = [i for i in mb if i in pulled]
        if not rows:
            continue
        if window is None:
            batch = batch_tensors([pulled[i] for i in rows], advantages[rows])
        else:  # this rank's token slice, loss tensors aligned to it
            batch = local_batch([pulled[i] for i in rows], advantages[rows], window)
        logits, logp = forward_logprobs(model, batch)
        ref = None
        if ref_model is not None:
            with torch.no_grad():
                ref = forward_logprobs(ref_model, batch)[1]
        ent = entropy(logits.detach() if cfg.entropy_coef == 0 else logits, batch)
        terms = clipped_pg_loss(logp, batch["behaviour_logprobs"], batch["advantages"], batch["loss_mask"],
                                clip_eps=cfg.clip_eps, normalizer=normalizer, ref_logprobs=ref, kl_coef=cfg.kl_coef,
                                entropy=ent, entropy_coef=cfg.entropy_coef, tis_cap=cfg.tis_cap)
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


def _pull(client: Puller, metas: Sequence[SampleMeta], rows: Sequence[int],
          ranges: dict[int, list[tuple[int, int]]] | None = None) -> tuple[dict[int, dict[str, np.ndarray]], list[str]]:
    """Pull this rank's rows (only `ranges[row]` of each when given); rows whose producer is gone are
    dropped with their whole group."""
    mine = [metas[i] for i in rows]

    def of(keep: Sequence[int]) -> dict[int, list[tuple[int, int]]] | None:
        return None if ranges is None else {pos: ranges[i] for pos, i in enumerate(keep)}

    try:
        data = pull_samples(client, mine, FIELDS, of(rows))
        return dict(zip(rows, data)), []
    except SamplesUnavailable as exc:
        missing = set(exc.sample_ids)
    lost_groups = {m.group_id for m in mine if m.sample_id in missing}
    keep = [i for i in rows if metas[i].group_id not in lost_groups]
    data = pull_samples(client, [metas[i] for i in keep], FIELDS, of(keep))
    lost = [m.sample_id for m in metas if m.group_id in lost_groups]
    return dict(zip(keep, data)), lost
