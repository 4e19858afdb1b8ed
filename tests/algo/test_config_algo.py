"""Bad `algo` input is refused when the config is loaded, every problem in the one error."""

from __future__ import annotations

import pytest

from earl_stream.config import load_config
from earl_stream.errors import ConfigError


def test_every_problem_in_one_error() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, ["algo.advantage=ppo_gae", "algo.dual_clip_c=0.5", "algo.is_correction=mask",
                           "algo.is_mask_low=1.5", "algo.lr_decay_steps=0", "algo.mini_batches=9",
                           "algo.loss_agg=sum", "trainer.clip_eps=0.3", "algo.positive_weight=2",
                           "algo.kl_decay_steps=100"])
    text = str(err.value)
    for line in ("algo.advantage: 'ppo_gae' is not a known estimator; choose one of dr_grpo, grpo, reinforce_pp, "
                 "reinforce_pp_baseline, rloo",
                 "algo.dual_clip_c=0.5 must be > 1",
                 "algo.is_mask_low=1.5 and algo.is_mask_high=2.0 must hold 1 strictly between them",
                 "algo.lr_schedule=cosine needs algo.lr_decay_steps > 0 or a run with steps > 0",
                 "algo.mini_batches=9: a mini-batch holds whole groups, and a step has only trainer.groups_per_step=8",
                 "algo.loss_agg: 'sum' is not allowed; choose one of token-mean, seq-mean-token-mean, seq-mean-token-sum",
                 "trainer.clip_eps: moved to algo.clip_eps_low and algo.clip_eps_high",
                 "algo.positive_weight=2.0 must be <= 1",
                 "algo.kl_decay_steps=100 decays the KL weight, but algo.kl_coef is 0 (set both)"):
        assert line in text, text


@pytest.mark.parametrize("advantage", ["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"])
def test_group_baselines_refuse_groups_of_one(advantage: str) -> None:
    with pytest.raises(ConfigError, match=f"algo.advantage={advantage} needs trainer.group_size >= 2"):
        load_config(None, [f"algo.advantage={advantage}", "trainer.group_size=1"])


def test_a_global_baseline_takes_groups_of_one_but_not_dynamic_sampling() -> None:
    assert load_config(None, ["algo.advantage=reinforce_pp", "trainer.group_size=1"]).trainer.group_size == 1
    with pytest.raises(ConfigError, match="every group of trainer.group_size=1 has equal rewards"):
        load_config(None, ["algo.advantage=reinforce_pp", "trainer.group_size=1", "algo.dynamic_sampling=true"])


def test_good_combinations_load() -> None:
    cfg = load_config(None, ["algo.advantage=rloo", "algo.ppo_epochs=2", "algo.mini_batches=2", "algo.clip_eps_high=0.28",
                             "algo.dual_clip_c=3", "algo.is_correction=mask", "algo.kl_coef=0.01", "algo.kl_in=reward",
                             "algo.lr_schedule=cosine", "algo.warmup_steps=10", "steps=100"])
    assert cfg.algo.updates == 4 and cfg.algo.kl_in == "reward"
