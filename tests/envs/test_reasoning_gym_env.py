"""ReasoningGymEnv against the real reasoning-gym package: tasks by name, seeds, scoring, multi-turn."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest

rg = pytest.importorskip("reasoning_gym")

# imported after the skip: the adapter needs reasoning_gym at import time
from earl_stream_envs.reasoning_gym_env import ReasoningGymEnv  # noqa: E402

from earl_stream.env import StepResult, env_options, make_env  # noqa: E402
from earl_stream.errors import EnvError  # noqa: E402

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def test_questions_come_from_the_dataset_by_seed() -> None:
    env = ReasoningGymEnv("basic_arithmetic", size=100, dataset_seed=3)
    dataset = rg.create_dataset("basic_arithmetic", seed=3, size=100)
    for seed in (0, 7, 99, 100, 12345):
        assert run(env.reset(seed)) == dataset[seed % 100]["question"]
    other = ReasoningGymEnv("basic_arithmetic", size=100, dataset_seed=3)
    assert run(other.reset(7)) == run(env.reset(7))
    assert run(ReasoningGymEnv("basic_arithmetic", size=100, dataset_seed=4).reset(7)) != run(env.reset(7))


@pytest.mark.parametrize("task", ["basic_arithmetic", "chain_sum", "leg_counting", "spell_backward", "maze"])
def test_the_datasets_own_answer_scores_one_and_garbage_zero(task: str) -> None:
    env = ReasoningGymEnv(task, size=50)
    opts = env_options(env)
    assert opts.system_prompt == rg.utils.SYSTEM_PROMPTS["default"] and opts.max_turn_tokens == 256
    dataset = rg.create_dataset(task, seed=0, size=50)
    for seed in range(3):
        entry = dataset[seed]
        run(env.reset(seed))
        good = run(env.step(f"<think>easy</think>\n<answer>{entry['answer']}</answer>"))
        assert good == StepResult("correct", 1.0, True,
                                  {"outcome": "correct", "score": 1.0, "task": task, "attempts": 1})
        run(env.reset(seed))
        bad = run(env.step("<answer>zzz not it</answer>"))
        # some tasks give partial credit (e.g. spell_backward by edit distance)
        assert bad.done and bad.reward < 1.0 and bad.info["outcome"] == ("partial" if bad.reward else "wrong")


def test_bare_answers_and_no_tag_mode() -> None:
    dataset = rg.create_dataset("basic_arithmetic", seed=0, size=10)
    lenient = ReasoningGymEnv("basic_arithmetic", size=10)
    run(lenient.reset(2))
    assert run(lenient.step(f"  {dataset[2]['answer']}\n")).reward == 1.0
    bare = ReasoningGymEnv("basic_arithmetic", size=10, answer_tag=None)
    assert env_options(bare).system_prompt == "Answer the question. Reply with the final answer only."
    run(bare.reset(2))
    assert run(bare.step(f"<answer>{dataset[2]['answer']}</answer>")).reward < 1.0  # tags are not stripped


def test_last_number_answers() -> None:
    dataset = rg.create_dataset("basic_arithmetic", seed=0, size=10)
    answer = dataset[2]["answer"]
    env = ReasoningGymEnv("basic_arithmetic", size=10, answer_tag=None, answer_from="last_number")
    run(env.reset(2))
    assert run(env.step(f"First 1 + 2 = 3, then the result is {answer}.")).reward == 1.0
    run(env.reset(2))
    assert run(env.step(f"It is {answer}, or 12345.")).info["outcome"] != "correct"  # the last number counts
    run(env.reset(2))
    assert run(env.step("no number at all")).info["outcome"] == "wrong"
    tagged = ReasoningGymEnv("basic_arithmetic", size=10, answer_from="last_number")
    run(tagged.reset(2))
    assert run(tagged.step(f"<answer>so {answer}</answer> 7")).reward == 1.0
    with pytest.raises(EnvError, match="answer_from"):
        ReasoningGymEnv("basic_arithmetic", answer_from="first_word")


def test_multi_turn_attempts() -> None:
    dataset = rg.create_dataset("basic_arithmetic", seed=0, size=10)
    env = ReasoningGymEnv("basic_arithmetic", size=10, max_attempts=3)
    run(env.reset(4))
    first = run(env.step("<answer>nope</answer>"))
    assert first == StepResult("That is not correct. Try again (2 attempts left).", 0.0, False)
    second = run(env.step(f"<answer>{dataset[4]['answer']}</answer>"))
    assert second.done and second.reward == 1.0 and second.info["attempts"] == 2
    run(env.reset(4))
    results = [run(env.step("x")) for _ in range(3)]
    assert [r.done for r in results] == [False, False, True]
    assert results[-1].info == {"outcome": "wrong", "score": 0.0, "task": "basic_arithmetic", "attempts": 3}
    with pytest.raises(EnvError, match="reset"):
        run(env.step("x"))


def test_config_params_and_errors() -> None:
    env = make_env("reasoning_gym", {"task": "basic_arithmetic", "config": '{"min_terms": 2, "max_terms": 2}',
                                     "size": "20"})
    assert isinstance(env, ReasoningGymEnv) and env.size == 20 and env.config == {"min_terms": 2, "max_terms": 2}
    question = run(env.reset(0))
    assert "Calculate" in question
    with pytest.raises(EnvError, match="unknown reasoning-gym task 'nope'.*basic_arithmetic"):
        ReasoningGymEnv("nope")
    with pytest.raises(EnvError, match="JSON"):
        ReasoningGymEnv("basic_arithmetic", config="{bad")
    with pytest.raises(EnvError, match="rejected config"):
        run(ReasoningGymEnv("basic_arithmetic", config={"no_such_option": 1}).reset(0))
