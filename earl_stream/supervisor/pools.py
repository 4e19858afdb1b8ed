"""The elastic rollout pool: which workers drain when the pool is scaled down, which drains a scale-up
cancels, and how many workers a launcher has to start. Pure decisions, no I/O.

The supervisor (`earl_stream.supervisor.server`) holds the desired size and applies the decision;
the workers drain themselves (`earl_stream.workers.rollout`); launchers start new workers
(`earl-stream up`, Kubernetes, Slurm) or the user does, by hand.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class Member:
    """A live worker of the pool as the decision sees it: `held` groups it still answers for (in
    flight, or samples not yet released), `order` its registration order (later = larger)."""

    worker_id: str
    draining: bool
    held: int
    order: int


@dataclasses.dataclass(frozen=True)
class ScaleDecision:
    drain: list[str]  # start draining these
    undrain: list[str]  # cancel these drains (they take prompts again)
    to_start: int  # workers still missing after cancelling drains


def decide(members: Sequence[Member], replicas: int) -> ScaleDecision:
    """Reach `replicas` active (non-draining) workers with the least disruption.

    Down: drain the workers that hold the least (they leave soonest), the latest joined first on a
    tie. Up: cancel the drains of the workers that hold the most (they are furthest from leaving),
    then ask for new ones.
    """
    if replicas < 0:
        raise ValueError(f"replicas={replicas} (must be >= 0)")
    active = [m for m in members if not m.draining]
    draining = [m for m in members if m.draining]
    if len(active) > replicas:
        leaving = sorted(active, key=lambda m: (m.held, -m.order))[: len(active) - replicas]
        return ScaleDecision(drain=[m.worker_id for m in leaving], undrain=[], to_start=0)
    missing = replicas - len(active)
    back = sorted(draining, key=lambda m: (-m.held, m.order))[:missing]
    return ScaleDecision(drain=[], undrain=[m.worker_id for m in back], to_start=missing - len(back))


def order_of(worker_id: str) -> int:
    """`rollout-7` -> 7 (the supervisor numbers workers in registration order)."""
    tail = worker_id.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else 0
