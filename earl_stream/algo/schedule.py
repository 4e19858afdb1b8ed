"""Learning-rate schedule: linear warm-up, then constant or cosine decay, as a factor of `trainer.lr`.

The trainer calls `lr_factor(algo, step, run_steps)` once per training step (a policy version) and sets
every parameter group's lr to its initial lr times that factor; the optimizer keeps everything else.
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


def apply_lr(optimizer: torch.optim.Optimizer, factor: float) -> float:
    """Set each parameter group's lr to its initial lr (kept in `initial_lr`) times `factor`; returns the
    first group's lr."""
    for group in optimizer.param_groups:
        group.setdefault("initial_lr", group["lr"])
        group["lr"] = group["initial_lr"] * factor
    return float(optimizer.param_groups[0]["lr"])
