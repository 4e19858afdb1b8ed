"""The supervisor's window of recently finished episodes, and the rates it reports over it.

Owns: `Finished` (what the statistics keep of one episode's metadata row), the outcome rate of a
window with its standard error, and `window_stats` (what status and the metrics report: mean reward,
outcome rates, context-length percentiles, the same per environment).

The samples of a GRPO group share a prompt, so they need not be independent draws: where they also
share the environment's seed (`EnvSpec.group_seed`: shared, e.g. one opponent) a nearly deterministic
policy plays the eight games of a group as one game eight times. The standard error is therefore
clustered by group (the sandwich estimator for a proportion), not the binomial sqrt(p (1 - p) / n) that
would treat a 512-game window of 64 groups as 512 independent games; where the games are independent
the two agree.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np


class Finished(NamedTuple):
    """One finished episode as the statistics window keeps it."""

    reward: float
    outcome: str  # what the environment reported ("win", "draw", "correct", ...; "" if nothing)
    tokens: int  # context length: every token of the episode
    env: str
    group: str  # the GRPO group (prompt) the episode belongs to


def outcome_rate(window: Sequence[Finished], outcome: str) -> float | None:
    """Fraction of the window's episodes whose outcome is `outcome`; None for an empty window."""
    if not window:
        return None
    return sum(e.outcome == outcome for e in window) / len(window)


def outcome_rate_stderr(window: Sequence[Finished], outcome: str) -> float | None:
    """Standard error of `outcome_rate`, clustered by group; None with fewer than two groups.

    With n_g episodes and k_g hits in group g, N episodes, G groups and p = sum k_g / N:
    se = sqrt(G / (G - 1) * sum_g (k_g - p n_g)^2) / N. One episode per group gives the usual
    sqrt(p (1 - p) / (N - 1))-like binomial error; identical games within a group widen it.
    """
    hits: dict[str, list[int]] = {}
    for e in window:
        counts = hits.setdefault(e.group, [0, 0])
        counts[0] += e.outcome == outcome
        counts[1] += 1
    groups, n = len(hits), len(window)
    if groups < 2:
        return None
    p = sum(k for k, _ in hits.values()) / n
    spread = sum((k - p * m) ** 2 for k, m in hits.values())
    return math.sqrt(groups / (groups - 1) * spread) / n


class EnvWindow(NamedTuple):
    """One environment's part of the window."""

    episodes: int
    mean_reward: float
    mean_context_tokens: float
    outcomes: dict[str, float]  # each reported outcome's rate among this environment's episodes


class WindowStats(NamedTuple):
    """What the supervisor's status and metrics report over the window (None / empty for an empty one)."""

    mean_reward: float | None
    outcomes: dict[str, float]  # each reported outcome's rate, rounded to 4 places
    context_length: dict[str, float]  # p50, p90, p99 and max of the episodes' context lengths (tokens)
    envs: dict[str, EnvWindow]


def window_stats(window: Sequence[Finished]) -> WindowStats:
    """The window's mean reward, outcome rates, context-length percentiles and per-environment figures."""
    if not window:
        return WindowStats(None, {}, {}, {})
    by_env: dict[str, list[Finished]] = {}
    for e in window:
        by_env.setdefault(e.env, []).append(e)
    lengths = np.array([e.tokens for e in window], dtype=np.float64)
    context = {f"p{q}": float(np.percentile(lengths, q)) for q in (50, 90, 99)} | {"max": float(lengths.max())}
    envs = {name: EnvWindow(len(eps), float(np.mean([e.reward for e in eps])),
                            float(np.mean([e.tokens for e in eps])), _rates(eps))
            for name, eps in by_env.items()}
    return WindowStats(float(np.mean([e.reward for e in window])), _rates(window), context, envs)


def _rates(window: Sequence[Finished]) -> dict[str, float]:
    outcomes = [e.outcome for e in window]
    return {o: round(outcomes.count(o) / len(outcomes), 4) for o in sorted(set(outcomes))}
