"""Advantage estimators: each against a hand-computed example, and the contract every registered
estimator keeps (run over the registry, so a new one is checked too)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from earl_stream.algo.advantages import EstimatorOptions, compute_advantages, estimator_names, get_estimator_class, register_estimator
from earl_stream.errors import ConfigError

# group a: rewards 1, 3 (mean 2, population std 1); group b: 0, 0, 3 (mean 1, std sqrt(2))
REWARDS = [1.0, 3.0, 0.0, 0.0, 3.0]
GROUPS = ["a", "a", "b", "b", "b"]
S2 = math.sqrt(2.0)
HAND = {
    # (r - group mean) / group std
    ("grpo", True): [-1.0, 1.0, -1 / S2, -1 / S2, 2 / S2],
    # r - group mean
    ("grpo", False): [-1.0, 1.0, -1.0, -1.0, 2.0],
    ("dr_grpo", True): [-1.0, 1.0, -1.0, -1.0, 2.0],
    # r_i - mean of the others: 1 - 3 = -2, 3 - 1 = 2; 0 - mean(0, 3) = -1.5, 3 - mean(0, 0) = 3
    ("rloo", True): [-2.0, 2.0, -1.5, -1.5, 3.0],
    # whitened over the step: mean 7/5 = 1.4, deviations -0.4 1.6 -1.4 -1.4 1.6, variance 9.2/5 = 1.84
    ("reinforce_pp", True): [d / math.sqrt(1.84) for d in (-0.4, 1.6, -1.4, -1.4, 1.6)],
    # centred in the group (-1 1 -1 -1 2; mean 0), then whitened: variance (1+1+1+1+4)/5 = 1.6
    ("reinforce_pp_baseline", True): [c / math.sqrt(1.6) for c in (-1.0, 1.0, -1.0, -1.0, 2.0)],
}


@pytest.mark.parametrize(("name", "std_scale"), sorted(HAND))
def test_estimator_by_hand(name: str, std_scale: bool) -> None:
    adv = compute_advantages(name, REWARDS, GROUPS, options=EstimatorOptions(std_scale=std_scale, eps=0.0))
    np.testing.assert_allclose(adv, HAND[name, std_scale], rtol=1e-6)


@pytest.mark.parametrize("name", ["grpo", "rloo"])
def test_positive_weight_scales_only_positive_advantages(name: str) -> None:
    # W-REINFORCE: the estimator's advantages, the positive ones times 0.1 (grpo: 1 -> 0.1, 2/sqrt2 -> 0.2/sqrt2)
    adv = compute_advantages(name, REWARDS, GROUPS, options=EstimatorOptions(eps=0.0, positive_weight=0.1))
    np.testing.assert_allclose(adv, [a * 0.1 if a > 0 else a for a in HAND[name, True]], rtol=1e-6)
    only_mistakes = compute_advantages(name, REWARDS, GROUPS, options=EstimatorOptions(eps=0.0, positive_weight=0.0))
    np.testing.assert_allclose(only_mistakes, [min(a, 0.0) for a in HAND[name, True]], rtol=1e-6)


def test_every_builtin_estimator_has_a_hand_computed_example() -> None:
    assert {n for n, _ in HAND} == set(estimator_names())


@pytest.mark.parametrize("name", estimator_names())
def test_estimator_contract(name: str) -> None:
    need = get_estimator_class(name).min_group_size
    size = max(need, 3)
    rng = np.random.default_rng(0)
    groups = [f"g{i // size}" for i in range(4 * size)]
    rewards = rng.normal(size=len(groups)).round(2)
    adv = compute_advantages(name, rewards, groups)
    assert adv.shape == (len(groups),) and adv.dtype == np.float32 and np.all(np.isfinite(adv))
    # a constant added to every reward changes nothing
    np.testing.assert_allclose(compute_advantages(name, rewards + 5.0, groups), adv, atol=1e-5)
    # the order of the samples does not matter
    perm = rng.permutation(len(groups))
    np.testing.assert_allclose(compute_advantages(name, rewards[perm], [groups[i] for i in perm]), adv[perm], atol=1e-6)
    # within a group, a higher reward never gets a lower advantage, and some sample gets a signal
    for g in set(groups):
        idx = [i for i, x in enumerate(groups) if x == g]
        order = np.argsort(rewards[idx])
        assert np.all(np.diff(adv[idx][order]) >= -1e-6)
    assert np.abs(adv).max() > 0.1
    # equal rewards everywhere: no signal
    assert np.all(compute_advantages(name, np.full(len(groups), 0.7), groups) == 0)
    # groups of the smallest size the estimator accepts work
    small = [f"g{i // need}" for i in range(2 * need)]
    assert np.all(np.isfinite(compute_advantages(name, np.arange(2 * need, dtype=float), small)))


def test_registry_refuses_duplicates_and_names_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="already registered"):
        register_estimator(get_estimator_class("grpo"))
    with pytest.raises(ConfigError, match="known: dr_grpo, grpo, reinforce_pp"):
        compute_advantages("ppo_gae", [1.0], ["a"])


def test_rloo_refuses_a_group_of_one() -> None:
    with pytest.raises(ValueError, match="groups of >= 2"):
        compute_advantages("rloo", [1.0, 2.0, 3.0], ["a", "a", "b"])
