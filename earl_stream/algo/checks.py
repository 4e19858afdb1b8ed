"""Cross-field rules of the `algo` config section: what cannot work with the rest of the config.

`earl_stream.config.validate` calls `algo_problems` at load time and reports its lines with every other problem
in one `ConfigError`. Numpy only (through the estimator registry), so loading a config stays light.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from earl_stream.algo.advantages import estimator_names, get_estimator_class

if TYPE_CHECKING:
    from earl_stream.config.run import RunConfig


def algo_problems(cfg: RunConfig) -> list[str]:
    """What in `cfg.algo` cannot work with the rest of the config (one line each; [] when all is well)."""
    a, t = cfg.algo, cfg.trainer
    if any(getattr(a, f.name) is None for f in dataclasses.fields(a)) or t.group_size is None:
        return []  # a field already failed to parse: that error says it
    out: list[str] = []
    if a.advantage not in estimator_names():
        out.append(f"algo.advantage: {a.advantage!r} is not a known estimator; choose one of "
                   f"{', '.join(estimator_names())}")
    elif t.group_size < (need := get_estimator_class(a.advantage).min_group_size):
        out.append(f"algo.advantage={a.advantage} needs trainer.group_size >= {need} (its baseline comes from "
                   f"the other samples of a group), got {t.group_size}")
    if a.dynamic_sampling and t.group_size == 1:
        out.append("algo.dynamic_sampling: every group of trainer.group_size=1 has equal rewards, so every group "
                   "would be dropped")
    if t.groups_per_step is not None and a.mini_batches > t.groups_per_step:
        out.append(f"algo.mini_batches={a.mini_batches}: a mini-batch holds whole groups, and a step has only "
                   f"trainer.groups_per_step={t.groups_per_step}")
    if a.clip_eps_low >= 1:
        out.append(f"algo.clip_eps_low={a.clip_eps_low} must be < 1 (the lower clip bound is 1 - clip_eps_low)")
    if 0 < a.dual_clip_c <= 1:
        out.append(f"algo.dual_clip_c={a.dual_clip_c} must be > 1 (or 0 = off)")
    if a.is_correction == "tis" and a.tis_cap <= 0:
        out.append("algo.tis_cap must be > 0 with algo.is_correction=tis (or choose is_correction=none)")
    if a.is_correction == "mask" and not a.is_mask_low < 1 < a.is_mask_high:
        out.append(f"algo.is_mask_low={a.is_mask_low} and algo.is_mask_high={a.is_mask_high} must hold 1 "
                   "strictly between them (a token with equal probabilities must be kept)")
    if a.positive_weight > 1:
        out.append(f"algo.positive_weight={a.positive_weight} must be <= 1 (it scales positive advantages down)")
    if a.kl_decay_steps > 0 and a.kl_coef == 0:
        out.append(f"algo.kl_decay_steps={a.kl_decay_steps} decays the KL weight, but algo.kl_coef is 0 (set both)")
    if a.min_lr_ratio > 1:
        out.append(f"algo.min_lr_ratio={a.min_lr_ratio} must be <= 1")
    if a.lr_schedule == "cosine":
        end = a.lr_decay_steps or (cfg.steps or 0)
        if end == 0:
            out.append("algo.lr_schedule=cosine needs algo.lr_decay_steps > 0 or a run with steps > 0")
        elif a.warmup_steps >= end:
            out.append(f"algo.warmup_steps={a.warmup_steps} must be below the cosine's end step {end}")
    return out
