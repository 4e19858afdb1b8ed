"""Schedules over training steps: the learning rate (linear warm-up, then constant or cosine decay, as a
factor of `trainer.lr`) and the KL weight (`kl_factor`: constant, or a linear fall to 0).

The trainer calls `lr_factor(algo, step, run_steps)` once per training step (a policy version) and sets
every parameter group's lr to the optimizer's own lr (`trainer.lr`) times that factor (`apply_lr`); the
optimizer keeps everything else. The lr is a function of the config and the step alone, so nothing extra
lives in the optimizer's state: a resumed or re-laid optimizer (a new plan builds a new one and loads the
old state into it) gets the step's lr at its next step.
"""

from __future__ import annotations

import math

import torch

from earl_stream.config import AlgoConfig


def lr_factor(algo: AlgoConfig, step: int, run_steps: int = 0) -> float:
    """The lr multiplier of training step `step` (0-based).

    Warm-up: (step + 1) / warmup_steps for the first warmup_steps steps. Cosine after it: from 1 at
    the end of warm-up to min_lr_ratio at lr_decay_steps (default `run_steps`), then held there.
    """
    if algo.warmup_steps > 0 and step < algo.warmup_steps:
        return (step + 1) / algo.warmup_steps
    if algo.lr_schedule == "constant":
        return 1.0
    end = algo.lr_decay_steps or run_steps
    if end <= algo.warmup_steps:
        raise ValueError(f"cosine schedule needs an end step past the warm-up ({algo.warmup_steps}), got {end}")
    progress = min(1.0, (step - algo.warmup_steps) / (end - algo.warmup_steps))
    return algo.min_lr_ratio + (1.0 - algo.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def kl_factor(algo: AlgoConfig, step: int) -> float:
    """The multiplier of `algo.kl_coef` at training step `step` (0-based): 1 - step / kl_decay_steps down
    to 0 (then 0), or 1 when kl_decay_steps is 0."""
    if algo.kl_decay_steps <= 0:
        return 1.0
    return max(0.0, 1.0 - step / algo.kl_decay_steps)


def apply_lr(optimizer: torch.optim.Optimizer, factor: float) -> float:
    """Set each parameter group's lr to the lr the optimizer was built with (`optimizer.defaults`, which
    the trainer takes from `trainer.lr`) times `factor`; returns that lr.

    No key is added to the groups: torch.distributed's optimizer state dict maps the keys of the state it
    loads onto the new optimizer's, and an extra one (an `initial_lr`, which earlier versions kept there) made a
    re-shard to another plan fail with a KeyError; one such key from an older checkpoint is dropped here."""
    lr = float(optimizer.defaults["lr"]) * factor
    for group in optimizer.param_groups:
        group.pop("initial_lr", None)
        group["lr"] = lr
    return lr
