"""One training step on one rank, given the step's claimed metadata: `algo.ppo_epochs` passes over the
claim, each split into `algo.mini_batches` optimizer updates (groups kept whole).

Every rank computes the same partition of each mini-batch (`earl_stream.store.layout.partition`) and
pulls only its own rows from their producers, once per step. Advantages come from the metadata alone
(rewards and groups; with `algo.kl_in=reward` plus one all-reduce of per-row KL sums), so no rank needs
another rank's bytes. Each row's token weight comes from the claim's global counts
(`algo.losses.row_weights`) and gradients are summed across ranks, so an update does not depend on how
its batch was split. With more than one update per step, the trainer's log-probs of the step's
starting weights are computed once, before the first update, and every ratio is taken against them.

Tokens sampled by a policy older than `min_version` (the staleness bound, per token) are masked out
of the loss; they stay in the context. The math of the loss is `earl_stream.algo.losses`.

With `trainer.packing` a micro-batch is one packed sequence [1, n] (`workers.batches`), run with
per-row attention (`workers.packed_attention`); the loss sees each of its tokens as a row of one
token with its own row's advantage and weight, so the sums are those of the padded layout.

With `trainer.dynamic_sp_tokens` (`workers.dynamic_sp`) an update's rows longer than that run first,
one shared micro-batch each, on all N data ranks at Ulysses sp = N (each rank its slice of the row);
the other rows are partitioned and run at sp = 1 as above.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from earl_stream.algo import distill
from earl_stream.algo.advantages import EstimatorOptions, compute_advantages, episode_sums
from earl_stream.algo.losses import kl_estimate, policy_loss
from earl_stream.algo.schedule import apply_lr, kl_factor, lr_factor
from earl_stream.config import AlgoConfig, TrainerConfig
from earl_stream.errors import ConfigError
from earl_stream.store.experience import Puller
from earl_stream.store.layout import Layout
from earl_stream.store.schema import SampleMeta, episode_key
from earl_stream.workers.batches import agree_on_lost
from earl_stream.workers.dynamic_sp import DynamicSp
from earl_stream.workers.mesh import Placement, clip_gradients, reduce_gradients
from earl_stream.workers.packed_attention import packed_segments
from earl_stream.workers.routing_replay import RoutingReplay
from earl_stream.workers.step_batches import FIELDS, VERSION, add_rope, claim_images, micro_batch, plan_updates, pull_claim
from earl_stream.workers.ulysses import sp_state
from earl_stream.workers.vision_inputs import VisionInputs
from earl_stream.workers.vocab_parallel import forward_logprobs, vocab_entropy


@dataclasses.dataclass
class StepResult:
    loss: float  # mean over the step's updates of the policy term of the loss
    grad_norm: float  # mean over the step's updates, before clipping
    mismatch: float  # mean |trainer log-prob - engine log-prob| over loss tokens
    clip_frac: float  # fraction of loss tokens whose PPO (or dual) clip was active, over all updates
    entropy: float
    mean_reward: float
    samples: int
    tokens: int  # prompt + response tokens of the step's samples
    step_seconds: float
    pull_seconds: float
    pull_bytes: int
    lost_sample_ids: list[str]
    ratio_dev: float = 0.0  # mean |ratio - 1| over loss tokens and updates (0 at one on-policy update)
    masked_frac: float = 0.0  # fraction of loss tokens masked: too stale, or outside the IS band
    stale_frac: float = 0.0  # the part of masked_frac that was too stale
    kl: float = 0.0  # mean per-token KL estimate to the reference (when kl_coef > 0)
    routing_mismatch: float = 0.0  # MoE: fraction of recorded expert choices this rank's routers did not make
    distill_kl: float = 0.0  # mean per-token reverse KL to algo.distill's teacher (student - teacher log-prob)
    lr: float = 0.0
    updates: int = 0
    images: int = 0  # pictures this rank pulled (a vision-language policy's samples)
    image_bytes: int = 0  # their PNG bytes (also in pull_bytes)
    claim_image_bytes: int = 0  # the PNG bytes of every picture of the step's claim (all ranks' samples)
    loss_tokens: int = 0  # tokens that receive gradient (the model's own tokens: response_tokens), once per epoch

    def metrics(self) -> dict[str, float]:
        return {k: float(v) for k, v in dataclasses.asdict(self).items() if isinstance(v, (int, float))}


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, metas: Sequence[SampleMeta], layout: Layout,
               client: Puller, cfg: TrainerConfig, *, algo: AlgoConfig | None = None, step: int = 0,
               run_steps: int = 0, min_version: int = 0, ref_model: torch.nn.Module | None = None, rank: int = 0,
               placement: Placement | None = None, temperature: float = 1.0,
               vision: VisionInputs | None = None) -> StepResult:
    """Training step `step` (0-based; drives the lr schedule, which ends at `run_steps` if set) of this
    rank. Tokens of policy versions below `min_version` are masked. `placement` says how the model is
    laid out (default: replicated, with a DDP-style gradient all-reduce when the pool has several ranks).
    `temperature` is the rollout's sampling temperature: log-probs, ratios and entropy are those of the
    tempered distribution the samples were drawn from. `vision`: a vision-language policy's images (claimed
    samples that showed images need it: their pictures are pulled with their rows and recomputed by the tower)."""
    start = time.monotonic()
    algo = algo or AlgoConfig()
    if algo.kl_decay_steps > 0:  # this step's KL weight; at 0 the reference's forward is skipped below
        algo = dataclasses.replace(algo, kl_coef=algo.kl_coef * kl_factor(algo, step))
    placement = placement or Placement.single(layout, micro_batch_tokens=cfg.micro_batch_tokens)
    if sp_state() != (layout.cp_size, layout.cp_rank):
        raise ConfigError(f"layout has sp={layout.cp_size} (rank {layout.cp_rank}) but the model runs sp={sp_state()}: "
                          "apply the plan (workers.sharding / workers.ulysses.set_sequence_parallel) first")
    hf: Any = model
    dynamic = DynamicSp.of(cfg.dynamic_sp_tokens, placement, hf.config.get_text_config())
    minis = plan_updates(metas, layout, placement, cfg.micro_batch_tokens, algo, packed=cfg.packing, dynamic=dynamic)
    fields: tuple[str, ...] = FIELDS + (VERSION,) if any(m.policy_version_min < min_version for m in metas) else FIELDS
    replay = RoutingReplay.of(model, algo.routing_replay)  # MoE models: routed experts (workers.routing_replay)
    fields += replay.fields(metas) if replay is not None else ()
    if algo.distill.enabled and algo.distill.mode == "loss":
        fields += (distill.FIELD,)
    pull_start = time.monotonic()
    ranges = {i: r for mini in minis for i, r in (mini.ranges or {}).items()} or None  # sp'd rows: their slice
    described, claim_image_bytes = claim_images(metas, vision)
    with_images = bool(described)
    pulled, lost, images = pull_claim(client, metas, [i for mini in minis for i in mini.rows], ranges, fields, with_images)
    if placement.world > 1:
        # Before any forward pass every rank drops the groups any rank lost: an sp or tp group's ranks
        # must run the same rows, and no rank may train part of a group that the ledger re-issues.
        pulled, lost = agree_on_lost(metas, pulled, lost)
    routed = replay.split(pulled) if replay is not None else {}
    pull_seconds = time.monotonic() - pull_start
    pictures = [img for row in images.values() for img, _ in row]
    image_bytes = sum(len(img.image.png) for img in pictures)
    pull_bytes = sum(sum(a.nbytes for a in r.values()) for r in pulled.values()) + image_bytes
    mean_reward = float(np.mean([m.reward for m in metas])) if metas else 0.0
    if len(lost) == len(metas):
        # Every group was lost (its producers died): no optimizer step, which with Adam's momentum would
        # still move the weights without any data. Every rank knows the agreed lost set, so all skip.
        optimizer.zero_grad(set_to_none=True)
        return StepResult(loss=0.0, grad_norm=0.0, mismatch=0.0, clip_frac=0.0, entropy=0.0, mean_reward=mean_reward,
                          samples=0, tokens=0, step_seconds=time.monotonic() - start, pull_seconds=pull_seconds,
                          pull_bytes=pull_bytes, lost_sample_ids=lost)
    run = _MicroBatchRunner(model, ref_model, algo, placement, temperature, dynamic, vision)
    lengths = [m.total_tokens for m in metas]
    batches = {(u, k): micro_batch(mini, k, pulled, layout, min_version, lengths, images) for u, mini in enumerate(minis)
               for k in range(mini.passes)}
    if replay is not None:
        replay.add_to_batches(batches, minis, routed, lengths)
    if vision is not None and vision.mrope and with_images:
        add_rope(batches, minis, described, lengths, vision)
    rewards = np.array([m.reward for m in metas], dtype=np.float64)
    kl_in_reward = 0.0
    if algo.updates > 1 or (run.kl_in_reward and ref_model is not None):
        kl_rows = run.prepass(batches, len(metas))  # old (and reference) log-probs, before any update
        if run.kl_in_reward:
            rewards -= algo.kl_coef * episode_sums(kl_rows, [episode_key(m) for m in metas])  # segments: one episode
            kl_in_reward = float(kl_rows.sum()) * algo.ppo_epochs  # reported like the in-loss KL sums
    if algo.distill.enabled and algo.distill.mode == "reward":  # a sequence reward: see algo.distill
        rewards -= episode_sums(distill.reward_penalties(metas, algo.distill.coef), [episode_key(m) for m in metas])
    advantages = _advantages(metas, rewards, set(lost), algo)
    lr = apply_lr(optimizer, lr_factor(algo, step, run_steps)) if _scheduled(algo) else optimizer.param_groups[0]["lr"]
    norms = [_update(model, optimizer, placement, run, [batches[u, k] for k in range(mini.passes)], advantages)
             for _ in range(algo.ppo_epochs) for u, mini in enumerate(minis)]
    stats = run.totals()
    tokens = max(1.0, float(sum(m.response_tokens for m in metas))) * algo.ppo_epochs
    return StepResult(
        loss=stats["pg_loss"] / algo.updates, grad_norm=float(np.mean(norms)), mismatch=stats["mismatch_abs"] / tokens,
        clip_frac=stats["clip_frac"] / tokens, entropy=stats["entropy"] / tokens, mean_reward=mean_reward,
        samples=len(metas), tokens=sum(m.total_tokens for m in metas), step_seconds=time.monotonic() - start,
        pull_seconds=pull_seconds, pull_bytes=pull_bytes, lost_sample_ids=lost, ratio_dev=stats["ratio_dev"] / tokens,
        masked_frac=(stats["is_masked"] + stats["stale"]) / tokens, stale_frac=stats["stale"] / tokens,
        kl=(stats["kl"] + kl_in_reward) / tokens, lr=float(lr), updates=algo.updates,
        routing_mismatch=replay.take_mismatch() if replay is not None else 0.0,
        distill_kl=_distill_kl(metas, stats, tokens, algo), images=len(pictures), image_bytes=image_bytes,
        claim_image_bytes=claim_image_bytes, loss_tokens=sum(m.response_tokens for m in metas),
    )


def _distill_kl(metas: Sequence[SampleMeta], stats: dict[str, float], tokens: float, algo: AlgoConfig) -> float:
    if not algo.distill.enabled:
        return 0.0
    if algo.distill.mode == "loss":
        return stats["distill_kl"] / tokens
    return float(distill.reward_penalties(metas, 1.0).sum()) * algo.ppo_epochs / tokens


def _update(model: torch.nn.Module, optimizer: torch.optim.Optimizer, placement: Placement, run: _MicroBatchRunner,
            batches: list[dict[str, Any]], advantages: np.ndarray) -> float:
    """One optimizer update over these micro-batches (this rank's share of a mini-batch); returns the
    gradient norm before clipping."""
    for batch in batches:
        run(batch, advantages)
    reduce_gradients(model, placement)
    norm = clip_gradients(model, run.algo.grad_clip, placement)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


def _scheduled(algo: AlgoConfig) -> bool:
    return algo.warmup_steps > 0 or algo.lr_schedule != "constant"


def _advantages(metas: Sequence[SampleMeta], rewards: np.ndarray, lost: set[str], algo: AlgoConfig) -> np.ndarray:
    """[N] float32: the estimator over the rows that will train (a lost group is played again), one reward per
    episode: the segments of a split episode share its advantage."""
    keep = [i for i, m in enumerate(metas) if m.sample_id not in lost]
    out = np.zeros(len(metas), np.float32)
    out[keep] = compute_advantages(algo.advantage, rewards[keep], [metas[i].group_id for i in keep],
                                   options=EstimatorOptions(std_scale=algo.std_scale, positive_weight=algo.positive_weight),
                                   episodes=[episode_key(metas[i]) for i in keep])
    return out


_STATS = ("pg_loss", "mismatch_abs", "clip_frac", "entropy", "ratio_dev", "is_masked", "kl", "stale", "distill_kl")


class _MicroBatchRunner:
    """Forward, loss and backward of one micro-batch on this rank (its slice under sp, its vocabulary
    shard under tp, under autocast for bf16), accumulating the loss statistics."""

    def __init__(self, model: torch.nn.Module, ref_model: torch.nn.Module | None, algo: AlgoConfig,
                 placement: Placement, temperature: float = 1.0, dynamic: DynamicSp | None = None,
                 vision: VisionInputs | None = None) -> None:
        self.model, self.ref_model, self.algo, self.placement = model, ref_model, algo, placement
        self.vision = vision
        self.dynamic = dynamic or DynamicSp()
        hf: Any = model
        config: Any = hf.config.get_text_config()  # a vision-language model: its decoder's
        self.vocab = {"group": placement.tp_group, "vocab_start": placement.vocab_start(int(config.vocab_size)),
                      "temperature": temperature}
        self.sums = dict.fromkeys(_STATS, 0.0)
        self.kl_in_reward = algo.kl_coef > 0 and algo.kl_in == "reward"
        self.replay = RoutingReplay.of(model, algo.routing_replay)
        # the KL reference routes as the policy does: under `rollout` it too takes the recorded experts
        self.ref_replay = (RoutingReplay.of(ref_model, algo.routing_replay)
                           if ref_model is not None and self.replay is not None else None)
        if self.ref_replay is not None:
            self.ref_replay.take_mismatch()  # its counts are not reported (the metric is the policy's)

    @contextlib.contextmanager
    def _packed(self, batch: dict[str, Any]) -> Iterator[None]:
        """Per-row attention for a packed micro-batch, over its forward and backward (a no-op padded), the
        routers (policy and reference) set to the batch's recorded routing, and a shared micro-batch's
        Ulysses degree (dynamic sp; entered first: `packed_segments` keeps Ulysses)."""
        models = [m for m in (self.model, self.ref_model) if m is not None]
        inner = packed_segments(models, batch.get("segments"))
        if self.ref_replay is not None:
            inner = self.ref_replay.around(inner, batch)
        inner = inner if self.replay is None else self.replay.around(inner, batch)
        with self.dynamic.around(models, batch.get("sp", 1)), inner:
            yield

    def _forward(self, model: torch.nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = self.placement.autocast_dtype
        with torch.autocast(self.placement.device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            pictures, rope = batch.get("images") or [], batch.get("rope")
            if (pictures or rope) and self.vision is not None:  # the forward merges the micro-batch's pictures
                with self.vision.merged(model, pictures, rope):
                    return forward_logprobs(model, batch, **self.vocab)
            return forward_logprobs(model, batch, **self.vocab)

    def _on_device(self, batch: dict[str, Any]) -> dict[str, Any]:
        return {k: v.to(self.placement.device, non_blocking=True) if isinstance(v, torch.Tensor) else v
                for k, v in batch.items()}

    def prepass(self, batches: dict[tuple[int, int], dict[str, Any]], n: int) -> np.ndarray:
        """Store each micro-batch's `old_logprobs` (and `ref_logprobs`) from the current weights, before
        the step's first update; returns each claim row's KL sum to the reference [n] (0 without one)."""
        kl_rows = torch.zeros(n, dtype=torch.float64)
        with torch.no_grad():
            for batch in batches.values():
                dev = self._on_device(batch)
                with self._packed(batch):
                    batch["old_logprobs"] = self._forward(self.model, dev)[1].float()
                    if self.ref_model is not None and self.algo.kl_coef > 0:
                        batch["ref_logprobs"] = self._forward(self.ref_model, dev)[1].float()
                if "ref_logprobs" in batch and self.kl_in_reward and batch["rows"]:
                    kl = kl_estimate(batch["old_logprobs"], batch["ref_logprobs"], self.algo.kl_estimator)
                    per = (kl * dev["loss_mask"]).double().cpu()
                    if "token_rows" in batch:  # packed [1, n]: each token's sum goes to its own row
                        j = batch["token_rows"]
                        kl_rows.index_add_(0, j[j >= 0], per[0][j >= 0])
                    else:
                        kl_rows[batch["rows"]] += per.sum(-1)
        if self.kl_in_reward and self.placement.world > 1:
            dist.all_reduce(kl_rows)
            kl_rows /= self.placement.plan.tp  # the ranks of a tp group computed the same sums
        return kl_rows.numpy()

    def __call__(self, batch: dict[str, Any], advantages: np.ndarray) -> None:
        algo = self.algo
        dev = self._on_device(batch)
        with self._packed(batch):
            logits, logp = self._forward(self.model, dev)
            ref = dev.get("ref_logprobs")
            if ref is None and self.ref_model is not None and algo.kl_coef > 0 and algo.kl_in == "loss":
                with torch.no_grad():
                    ref = self._forward(self.ref_model, dev)[1]
            ent = vocab_entropy(logits.detach() if algo.entropy_coef == 0 else logits, group=self.vocab["group"])
            adv, view = _loss_rows(batch, advantages)
            terms = policy_loss(view(logp), view(dev["behaviour_logprobs"]), adv.to(logp.device), view(dev["loss_mask"]),
                                dev["weights"], algo, old_logprobs=view(dev.get("old_logprobs")), ref_logprobs=view(ref),
                                entropy=view(ent))
            loss = terms.loss
            if distill.FIELD in dev and algo.distill.mode == "loss":  # on-policy distillation's term (algo.distill)
                extra, kl_sum = distill.distill_loss(
                    view(logp), view(dev[distill.FIELD]), view(dev["loss_mask"]), dev["weights"], algo.distill.coef)
                loss = loss + extra
                self.sums["distill_kl"] += kl_sum
            loss.backward()
        for k, v in terms.stats.items():
            if k in self.sums:
                self.sums[k] += v
        self.sums["stale"] += batch["stale"]

    def totals(self) -> dict[str, float]:
        """The sums of every rank (one all-reduce; a tp group's ranks computed the same terms)."""
        stats = torch.tensor([self.sums[k] for k in _STATS], dtype=torch.float64, device=self.placement.device)
        if self.placement.world > 1:
            dist.all_reduce(stats)
            stats /= self.placement.plan.tp
        return dict(zip(_STATS, (float(x) for x in stats)))


def _loss_rows(batch: dict[str, Any], advantages: np.ndarray) -> tuple[torch.Tensor, Any]:
    """(advantages per loss row, a view of [B, n] tensors as loss rows). Padded: the batch's rows [B],
    tensors as they are. Packed: every token is a row of one, [n] advantages and [n, 1] tensors."""
    if "token_rows" not in batch:
        return torch.from_numpy(advantages[batch["rows"]] if batch["rows"] else np.zeros(1, np.float32)), lambda x: x
    j = batch["token_rows"]
    adv = torch.from_numpy(advantages)[j.clamp(min=0)] * (j >= 0)
    return adv, lambda x: None if x is None else x.reshape(-1, 1)
