"""The SFT training loop shared by `earl-stream sft` and the embedded model's warm start.

Owns `SFTConfig` (the `key=value` knobs of `earl-stream sft`), the learning-rate schedule (linear
warm-up, constant, linear decay over the last `decay_fraction` of the budget, the budget being
`steps` or `seconds`, whichever runs out first), checkpoints (the trainer's own,
`workers.checkpoint`: DCP state plus a Hugging Face export under `out/checkpoints/step_N`), the final
Hugging Face model directory (`out` itself: `model.path=out` starts an RL run from it) and the
trainer's Prometheus metrics. Where the batches come from is the caller's: a transcript file
(`cli.sft`) or a game that plays synthetic episodes (`model.warmstart`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from earl_stream import metrics as M
from earl_stream.progress import Report
from earl_stream.sft.config import SFTConfig
from earl_stream.sft.data import Example
from earl_stream.sft.step import SFTStepResult, sft_step
from earl_stream.workers import checkpoint as ckpt
from earl_stream.workers.mesh import Placement, TrainerMesh
from earl_stream.workers.packed_attention import strip_run_state
from earl_stream.workers.sharding import apply_plan, shard_model
from earl_stream.workers.vision_inputs import VisionInputs

__all__ = ["SFTConfig", "SFTReport", "lr_factor", "place_model", "run_sft", "save_model_dir"]

log = logging.getLogger(__name__)

Batches = Callable[[int], list[Example]]  # step -> that step's examples (the same on every rank)


@dataclasses.dataclass(frozen=True)
class SFTReport:
    """steps taken; first_loss / final_loss: mean assistant-token cross-entropy over the first / last
    min(10, steps // 4) steps (at least one); examples and tokens trained; train_seconds."""

    steps: int
    first_loss: float
    final_loss: float
    examples: int
    tokens: int
    train_seconds: float

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def lr_factor(cfg: SFTConfig, step: int, progress: float) -> float:
    """Warm-up, constant, then linear decay to min_lr_ratio over the last decay_fraction of `progress`."""
    warm = min(1.0, (step + 1) / cfg.warmup_steps) if cfg.warmup_steps else 1.0
    if cfg.decay_fraction <= 0:
        return warm
    decay = min(1.0, max(0.0, (progress - (1.0 - cfg.decay_fraction)) / cfg.decay_fraction))
    return warm * (1.0 - (1.0 - cfg.min_lr_ratio) * decay)


def place_model(model: torch.nn.Module, cfg: SFTConfig, *, rank: int = 0, world: int = 1,
                device: torch.device | None = None) -> Placement:
    """Lay `model` out under the config's plan on this rank (a torch.distributed group when world > 1)."""
    device = device or torch.device("cpu")
    problems = cfg.plan.problems(world, model.config)
    if problems:
        from earl_stream.errors import ConfigError
        raise ConfigError("sft plan " + cfg.plan.name + ": " + "; ".join(problems))
    model.to(device).train()
    placement = TrainerMesh(world, rank, device).placement(cfg.plan)
    shard_model(model, placement)
    apply_plan(model, placement)
    return placement


def run_sft(model: torch.nn.Module, tokenizer: Any, batches: Batches, cfg: SFTConfig, placement: Placement, *,
            steps: int, out: str | os.PathLike[str] | None = None, rank: int = 0,
            progress: Report | None = None, vision: VisionInputs | None = None) -> SFTReport:
    """Train `steps` steps (or until `cfg.seconds`) on `batches(step)`; then, with `out`, write the
    final checkpoint and the Hugging Face model directory there. Every rank of the pool calls it.
    `progress` gets every step (steps done, `steps`, its loss); without one a line is logged every
    `cfg.log_every` steps. `vision`: a vision-language model's image inputs, for batches whose examples carry
    images (`sft.step`)."""
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                            weight_decay=cfg.weight_decay)
    label = str(rank)
    losses: list[float] = []
    examples = tokens = 0
    start = time.monotonic()
    while len(losses) < steps:
        elapsed = time.monotonic() - start
        if cfg.seconds and _agree_stop(elapsed >= cfg.seconds, placement):
            break
        spent = max(elapsed / cfg.seconds if cfg.seconds else 0.0, len(losses) / steps)  # of the budget
        for group in opt.param_groups:
            group["lr"] = cfg.lr * lr_factor(cfg, len(losses), spent)
        batch = batches(len(losses))
        result: SFTStepResult = sft_step(model, opt, batch, placement, micro_batch_tokens=cfg.micro_batch_tokens,
                                         context_weight=cfg.context_weight, grad_clip=cfg.grad_clip, vision=vision)
        losses.append(result.loss)
        examples += result.examples
        tokens += result.tokens
        M.TRAINER_STEP_SECONDS.labels(label).observe(result.step_seconds)
        M.TRAINER_LOSS.labels(label).set(result.loss)
        M.TRAINER_GRAD_NORM.labels(label).set(result.grad_norm)
        M.TRAINER_STEPS.labels(label).inc()
        if progress is not None:
            progress(len(losses), steps, f"loss {result.loss:.4f}")
        elif len(losses) % cfg.log_every == 0:
            log.info("sft step %d loss %.4f context %.4f (%.0f s)", len(losses), result.loss, result.context_loss,
                     elapsed)
        if out is not None and cfg.checkpoint_every and len(losses) % cfg.checkpoint_every == 0:
            _checkpoint(out, len(losses), model, opt, tokenizer, placement, rank)
    train_seconds = time.monotonic() - start
    if out is not None:
        _checkpoint(out, len(losses), model, opt, tokenizer, placement, rank)
        save_model_dir(model, tokenizer, out, rank=rank)
    window = max(1, min(10, len(losses) // 4))
    return SFTReport(steps=len(losses), first_loss=_mean(losses[:window]), final_loss=_mean(losses[-window:]),
                     examples=examples, tokens=tokens, train_seconds=round(train_seconds, 2))


def _agree_stop(mine: bool, placement: Placement) -> bool:
    """Every rank stops at the same step (wall clocks differ): any rank's budget ends the run."""
    if placement.world == 1:
        return mine
    from earl_stream.workers.collectives import any_rank
    return bool(any_rank([mine], placement.world)[0])


def _checkpoint(out: str | os.PathLike[str], step: int, model: torch.nn.Module, opt: torch.optim.Optimizer,
                tokenizer: Any, placement: Placement, rank: int) -> None:
    state = ckpt.RunState(step=step, policy_version=step, rng=torch.get_rng_state(), unreleased=[],
                          world_size=placement.world)
    ckpt.save_checkpoint(out, state, model, opt, tokenizer, rank=rank, collective=placement.world > 1)


def save_model_dir(model: torch.nn.Module, tokenizer: Any, out: str | os.PathLike[str], *, rank: int = 0) -> Path:
    """The whole model and tokenizer as a Hugging Face directory `out` (rank 0 writes; sharded
    parameters are gathered first, which every rank of the pool must join)."""
    from torch.distributed.tensor import DTensor

    sharded = any(isinstance(p, DTensor) for p in model.parameters())
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)) \
        if sharded else None
    path = Path(out)
    if rank == 0:
        strip_run_state(model)
        path.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(path, state_dict=full)  # type: ignore[operator]
        tokenizer.save_pretrained(path)
    return path


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")
