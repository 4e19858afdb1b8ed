"""pass@k and the summary of an evaluation: success (fraction of episodes that succeed), the unbiased
pass@k estimator of Chen et al. 2021 (n samples of an item, c of them correct:
pass@k = 1 - C(n - c, k) / C(n, k), averaged over items, for k = 1..n) and the mean reward; for a game
(an environment whose outcomes include "win", "draw" or "loss"), its win, draw and loss rates beside success.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any


@dataclasses.dataclass(frozen=True)
class EpisodeOutcome:
    """One evaluation episode: item `item` (its index in the held-out set), sample `sample` of it."""

    item: int
    sample: int
    reward: float
    success: bool
    outcome: str
    tokens: int = 0  # tokens the model generated
    policy_version: int = -1  # the oldest policy version of its tokens (-1: none generated)


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of P(at least one of k samples succeeds) from n samples with c successes."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


GAME_OUTCOMES = ("win", "draw", "loss")
FORFEITS = ("illegal",)  # a game ended by the model's invalid move: lost, counted in loss_rate


@dataclasses.dataclass(frozen=True)
class EvalSummary:
    """success = mean over all episodes; pass_at_k[k] = mean over items; stderr = binomial of success."""

    problems: int
    samples: int
    episodes: int
    success: float
    stderr: float
    pass_at_k: dict[int, float]
    mean_reward: float
    outcomes: dict[str, int]
    generated_tokens: int
    versions: tuple[int, int]  # oldest and newest policy version that played (-1, -1: unknown)
    # a game's: fractions of the episodes won, drawn, lost (an illegal move loses); None for other environments
    win_rate: float | None = None
    draw_rate: float | None = None
    loss_rate: float | None = None

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["pass_at_k"] = {str(k): v for k, v in self.pass_at_k.items()}
        out["versions"] = list(self.versions)
        return out


def summarize(episodes: Iterable[EpisodeOutcome]) -> EvalSummary:
    """The summary of a finished evaluation. Every item must have the same number of samples (pass@k's n)."""
    eps = list(episodes)
    if not eps:
        raise ValueError("summarize: no episodes")
    per_item: dict[int, list[bool]] = {}
    outcomes: dict[str, int] = {}
    for e in eps:
        per_item.setdefault(e.item, []).append(e.success)
        outcomes[e.outcome] = outcomes.get(e.outcome, 0) + 1
    n = {len(v) for v in per_item.values()}
    if len(n) != 1:
        raise ValueError(f"summarize: items have different numbers of samples {sorted(n)}")
    samples = n.pop()
    game = any(o in outcomes for o in (*GAME_OUTCOMES, *FORFEITS))
    rates = [sum(outcomes.get(o, 0) for o in group) / len(eps) if game else None
             for group in (("win",), ("draw",), ("loss", *FORFEITS))]
    passk = {k: sum(pass_at_k(samples, sum(v), k) for v in per_item.values()) / len(per_item)
             for k in range(1, samples + 1)}
    p = sum(e.success for e in eps) / len(eps)
    versions = [e.policy_version for e in eps if e.policy_version >= 0]
    return EvalSummary(problems=len(per_item), samples=samples, episodes=len(eps), success=p,
                       stderr=math.sqrt(p * (1 - p) / len(eps)), pass_at_k=passk,
                       mean_reward=sum(e.reward for e in eps) / len(eps), outcomes=outcomes,
                       generated_tokens=sum(e.tokens for e in eps),
                       versions=(min(versions), max(versions)) if versions else (-1, -1),
                       win_rate=rates[0], draw_rate=rates[1], loss_rate=rates[2])
