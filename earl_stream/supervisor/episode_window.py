"""The supervisor's window of recently finished episodes, and the rates it reports over it.

Owns: `Finished` (what the statistics keep of one episode's metadata row) and the outcome rate of a
window with its standard error. The samples of a GRPO group share a prompt, so they need not be
independent draws: where they also share the environment's seed (`EnvSpec.group_seed`: shared, e.g. one
opponent) a nearly deterministic policy plays the eight games of a group as one game eight times. The
standard error is therefore clustered by group (the sandwich estimator for a proportion), not the binomial
sqrt(p (1 - p) / n) that would treat a 512-game window of 64 groups as 512 independent games; where the
games are independent the two agree.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple


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
