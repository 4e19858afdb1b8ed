"""Held-out sets (evaluation/heldout.py): reasoning-gym's are questions its training dataset never poses; an
environment that cannot be loaded, or one that cannot find enough unseen items, is refused with why (one without a
held_out() hook is played on evaluation seeds: tests/evaluation/test_seed_split.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from earl_stream.env import make_env
from earl_stream.evaluation.heldout import HeldOutUnavailable, check_held_out, held_out_set

pytest.importorskip("reasoning_gym")

# by file: this checkout's class, whichever checkout an installed entry point names
RG = f"{Path(__file__).resolve().parents[2] / 'envs' / 'reasoning_gym_env.py'}:ReasoningGymEnv"
PARAMS = {"task": "basic_arithmetic", "size": 300, "dataset_seed": 0,
          "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}}


def _question(spec: str, params: dict, seed: int) -> str:
    return asyncio.run(make_env(spec, params).reset(seed))


def test_reasoning_gym_held_out_questions_are_never_posed_in_training() -> None:
    held = held_out_set(RG, PARAMS, 20, "arith")
    assert len(held.seeds) == 20 and held.params["dataset_seed"] != PARAMS["dataset_seed"]
    training = {_question(RG, PARAMS, s) for s in range(PARAMS["size"])}  # every question training can pose
    asked = [_question(RG, held.params, s) for s in held.seeds]
    assert len(set(asked)) == 20 and not set(asked) & training
    assert held_out_set(RG, PARAMS, 20, "arith") == held  # the same items every time


def test_refusals_say_why() -> None:
    with pytest.raises(HeldOutUnavailable, match="cannot be loaded"):
        check_held_out("no_such_module_xyz:Env")
    tiny = {"task": "basic_arithmetic", "size": 50,
            "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+"],
                       "allow_parentheses": False, "allow_negation": False}}
    with pytest.raises(HeldOutUnavailable, match="held-out questions differ from the training set"):
        held_out_set(RG, {**tiny, "size": 3000}, 20, "small")  # 121 distinct questions, all posed in training
    with pytest.raises(HeldOutUnavailable, match="problems must be >= 1"):
        held_out_set(RG, tiny, 0)
