"""The seed space of a run, split once: the seeds an environment is reset with in training and the seeds
evaluation plays never meet.

`reset(seed)` takes a 31-bit seed. Training draws every seed from the lower half, [0, 2^30): the
supervisor's ledger gives each prompt one (`supervisor.ledger`) and a group whose episodes get seeds of
their own derives them in that half too (`workers.agent_loop.episode_env_seed`). Evaluation of an
environment that defines no held-out set of its own (`evaluation.heldout`: a game whose seed draws the
opponent's moves, like Tic-Tac-Toe) plays seeds from the upper half, [2^30, 2^31), which no run ever
issues for training. `SEED_SPLIT` is what a run records of it (the supervisor's status and the summary's
`seed_split`, each evaluation point's `items`).
"""

from __future__ import annotations

from typing import Any

TRAIN_SEEDS = range(0, 1 << 30)  # every seed an environment is reset with in training
EVAL_SEEDS = range(1 << 30, 1 << 31)  # seeds evaluation plays where the environment has no held-out set
SEED_SPLIT: dict[str, Any] = {"train": [TRAIN_SEEDS.start, TRAIN_SEEDS.stop],
                              "eval": [EVAL_SEEDS.start, EVAL_SEEDS.stop]}  # [start, stop) each


def train_seed(value: int) -> int:
    """`value` folded into the training seeds (its low 30 bits)."""
    return value & (TRAIN_SEEDS.stop - 1)


def eval_seeds(count: int) -> list[int]:
    """The first `count` evaluation seeds: the same items in every run, so evaluations compare across runs."""
    if not 1 <= count <= len(EVAL_SEEDS):
        raise ValueError(f"eval_seeds: count must be in [1, {len(EVAL_SEEDS)}], got {count}")
    return list(EVAL_SEEDS[:count])
