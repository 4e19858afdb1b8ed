"""Advantage estimators: one Protocol, a registry by name (`algo.advantage`), and the estimators users
of GRPO-style trainers switch between.

An estimator maps a step's per-sample rewards and group ids to one advantage per sample ([N] float32),
which the loss broadcasts over that sample's loss tokens. Estimators are pure numpy (no torch), so
config validation can import this module to check `algo.advantage` and the group size it needs.
What the loss does with the advantages (aggregation, clipping, off-policy weights) is `algo.losses`.

- grpo: (r - group mean) / (group std + eps) (Shao et al. 2024); `algo.std_scale=false` drops the std.
- dr_grpo: r - group mean (Liu et al. 2025, "Understanding R1-Zero-like training": the std division
  and per-sequence length normalisation bias GRPO; pair it with `algo.loss_agg=seq-mean-token-sum`).
- rloo: r_i - mean of the other samples of its group (Ahmadian et al. 2024) = n/(n-1) (r_i - mean).
- reinforce_pp: the reward whitened over the whole step, no group baseline (Hu 2025, REINFORCE++).
- reinforce_pp_baseline: r - group mean, then whitened over the whole step (REINFORCE++-baseline).
  REINFORCE++ whitens over tokens; here over samples, so a long episode does not weigh more.

Whatever the estimator, `algo.positive_weight` < 1 then scales the positive advantages down (W-REINFORCE,
Zhu et al. 2025, "The Surprising Effectiveness of Negative Reinforcement in LLM Reasoning"). Their
argument: pushing successes up is what collapses a policy onto its first wins, while pushing mistakes down
moves their probability to the other answers in proportion to what the policy gives them. (On the embedded
default it did not keep the missed blocks from setting in: docs/history.md, "Why it stops near 0.93".)
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Sequence
from typing import Any, ClassVar, Protocol

import numpy as np

from earl_stream.errors import ConfigError

EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class EstimatorOptions:
    """What an estimator may be configured with (from `AlgoConfig`)."""

    std_scale: bool = True
    eps: float = EPS
    positive_weight: float = 1.0  # applied by compute_advantages to any estimator's positive advantages


class AdvantageEstimator(Protocol):
    """rewards [N] float64 and group ids [N] -> advantages [N] float32 (finite; a group of equal rewards
    gets 0 under every group-baseline estimator). `min_group_size`: the smallest group it is defined for."""

    name: ClassVar[str]
    min_group_size: ClassVar[int]

    def __call__(self, rewards: np.ndarray, group_ids: Sequence[str]) -> np.ndarray: ...


def _groups(group_ids: Sequence[str]) -> list[list[int]]:
    members: dict[str, list[int]] = defaultdict(list)
    for i, g in enumerate(group_ids):
        members[g].append(i)
    return list(members.values())


def _centred(r: np.ndarray, group_ids: Sequence[str]) -> np.ndarray:
    out = np.zeros_like(r)
    for idx in _groups(group_ids):
        if np.ptp(r[idx]) > 0:  # equal rewards: exactly 0 (their float mean may differ in the last bit)
            out[idx] = r[idx] - r[idx].mean()
    return out


def _whiten(x: np.ndarray, eps: float) -> np.ndarray:
    if np.ptp(x) == 0:
        return np.zeros_like(x)
    return (x - x.mean()) / (x.std() + eps)


class Grpo:
    name: ClassVar[str] = "grpo"
    min_group_size: ClassVar[int] = 2

    def __init__(self, options: EstimatorOptions) -> None:
        self.options = options

    def __call__(self, rewards: np.ndarray, group_ids: Sequence[str]) -> np.ndarray:
        out = _centred(rewards, group_ids)
        if self.options.std_scale:
            for idx in _groups(group_ids):
                out[idx] /= rewards[idx].std() + self.options.eps  # population std (ddof=0)
        return out.astype(np.float32)


class DrGrpo:
    name: ClassVar[str] = "dr_grpo"
    min_group_size: ClassVar[int] = 2

    def __init__(self, options: EstimatorOptions) -> None:
        self.options = options

    def __call__(self, rewards: np.ndarray, group_ids: Sequence[str]) -> np.ndarray:
        return _centred(rewards, group_ids).astype(np.float32)


class Rloo:
    name: ClassVar[str] = "rloo"
    min_group_size: ClassVar[int] = 2

    def __init__(self, options: EstimatorOptions) -> None:
        self.options = options

    def __call__(self, rewards: np.ndarray, group_ids: Sequence[str]) -> np.ndarray:
        out = _centred(rewards, group_ids)
        for idx in _groups(group_ids):
            n = len(idx)
            if n < 2:
                raise ValueError(f"rloo needs groups of >= 2 samples, got one of {n}")
            out[idx] *= n / (n - 1)  # r_i - mean of the others = n/(n-1) (r_i - mean of all)
        return out.astype(np.float32)


class ReinforcePP:
    name: ClassVar[str] = "reinforce_pp"
    min_group_size: ClassVar[int] = 1

    def __init__(self, options: EstimatorOptions) -> None:
        self.options = options

    def __call__(self, rewards: np.ndarray, group_ids: Sequence[str]) -> np.ndarray:
        return _whiten(rewards, self.options.eps).astype(np.float32)


class ReinforcePPBaseline:
    name: ClassVar[str] = "reinforce_pp_baseline"
    min_group_size: ClassVar[int] = 2

    def __init__(self, options: EstimatorOptions) -> None:
        self.options = options

    def __call__(self, rewards: np.ndarray, group_ids: Sequence[str]) -> np.ndarray:
        return _whiten(_centred(rewards, group_ids), self.options.eps).astype(np.float32)


class EstimatorClass(Protocol):
    """What the registry holds: an estimator class, called with its options."""

    name: str
    min_group_size: int

    def __call__(self, options: EstimatorOptions) -> AdvantageEstimator: ...


_REGISTRY: dict[str, EstimatorClass] = {c.name: c for c in (Grpo, DrGrpo, Rloo, ReinforcePP, ReinforcePPBaseline)}


def estimator_names() -> list[str]:
    """The registered estimator names, sorted."""
    return sorted(_REGISTRY)


def register_estimator(cls: EstimatorClass) -> None:
    """Add an estimator class (with `name`, `min_group_size`, `__init__(options)`, `__call__`); a name
    can be registered once."""
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not isinstance(getattr(cls, "min_group_size", None), int):
        raise ConfigError(f"{cls!r} is not an advantage estimator: it needs a `name` str and a `min_group_size` int")
    if name in _REGISTRY:
        raise ConfigError(f"an advantage estimator named {name!r} is already registered "
                          f"(known: {', '.join(estimator_names())})")
    _REGISTRY[name] = cls


def get_estimator_class(name: str) -> EstimatorClass:
    if name not in _REGISTRY:
        raise ConfigError(f"unknown advantage estimator {name!r}; known: {', '.join(estimator_names())}")
    return _REGISTRY[name]


def make_estimator(name: str, options: EstimatorOptions | None = None) -> AdvantageEstimator:
    """The estimator registered under `name`. Raises ConfigError naming the known ones."""
    return get_estimator_class(name)(options or EstimatorOptions())


def compute_advantages(name: str, rewards: Sequence[float] | np.ndarray, group_ids: Sequence[str], *,
                       options: EstimatorOptions | None = None, episodes: Sequence[str] | None = None) -> np.ndarray:
    """rewards [N], group ids [N] -> advantages [N] float32 of estimator `name`, the positive ones times
    `options.positive_weight`.

    `episodes` [N] (keys, `store.schema.episode_key`): rows with the same key are the segments of one
    episode (`rollout.non_append=split`). The estimator sees each episode once, with its first row's reward
    (its segments share it), so an episode split in three weighs in its group's mean and std as one split
    in none; every segment gets its episode's advantage."""
    options = options or EstimatorOptions()
    r = np.asarray(rewards, dtype=np.float64)
    if r.shape != (len(group_ids),) or (episodes is not None and len(episodes) != len(group_ids)):
        raise ValueError(f"{r.shape[0] if r.ndim else 1} rewards, {len(group_ids)} group ids"
                         f"{'' if episodes is None else f', {len(episodes)} episode keys'}")
    if r.size == 0:
        return np.zeros(0, np.float32)
    first, row_to_episode = _episode_rows(episodes if episodes is not None else range(len(group_ids)))
    adv = make_estimator(name, options)(r[first], [group_ids[i] for i in first])[row_to_episode]
    if options.positive_weight != 1.0:
        adv = np.where(adv > 0, adv * np.float32(options.positive_weight), adv).astype(np.float32)
    return adv


def _episode_rows(keys: Sequence[Any]) -> tuple[list[int], np.ndarray]:
    """(the first row of each episode, in order; [N] each row's episode index)."""
    index: dict[Any, int] = {}
    first: list[int] = []
    rows = np.empty(len(keys), np.int64)
    for i, key in enumerate(keys):
        if key not in index:
            index[key] = len(first)
            first.append(i)
        rows[i] = index[key]
    return first, rows


def episode_sums(values: np.ndarray, episodes: Sequence[str]) -> np.ndarray:
    """[N] -> [N]: each row gets the sum of `values` over the rows of its episode (e.g. a per-sample KL
    penalty: the episode's is the sum over its segments, which every segment's reward then carries)."""
    first, rows = _episode_rows(episodes)
    totals = np.zeros(len(first), np.float64)
    np.add.at(totals, rows, np.asarray(values, np.float64))
    return totals[rows]
