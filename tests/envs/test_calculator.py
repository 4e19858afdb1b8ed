"""Calculator: the safe evaluator, seeded word problems, the multi-turn tool protocol, and its rewards;
plus one episode through the real agent loop, which needs no change to support tools."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Coroutine, Mapping, Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any, TypeVar

import pytest
from earl_stream_envs.calculator import (
    MAX_EXPRESSION_CHARS,
    Calculator,
    CalculatorError,
    format_number,
    make_problem,
    parse_answer,
    safe_eval,
)

from earl_stream.env import StepResult, env_options
from earl_stream.errors import EnvError

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def calc(expression: str) -> str:
    return json.dumps({"name": "calculator", "arguments": {"expression": expression}}).join(["<tool>", "</tool>"])


@pytest.mark.parametrize(
    ("expression", "value"),
    [("3*(4+5)", 27), ("2**10", 1024), ("-3 + +4", 1), ("7/2", Fraction(7, 2)), ("1.5*2", 3),
     ("(1+2)*3-4/2", 7), ("0.1+0.2", Fraction(3, 10)), ("2**-2", Fraction(1, 4)), ("((((7))))", 7),
     (" 12 * 12 ", 144), ("10**18", 10**18)],
)
def test_safe_eval_computes_exactly(expression: str, value: Fraction) -> None:
    assert safe_eval(expression) == value


@pytest.mark.parametrize(
    "expression",
    ["__import__('os').system('true')", "a+1", "abs(-1)", "1 if 1 else 2", "[1]", "'a'*3", "1//2", "1%2",
     "2**0.5", "2**1000", "9" * 100, "1/0", "0**-1", "1" * (MAX_EXPRESSION_CHARS + 1), "True+1", "1j",
     "1e400", "1e-300", "", "3 +", "x.y", "(1,2)", "1 < 2", "~1", "2**2**2**2**2", "lambda: 1"],
)
def test_safe_eval_rejects_everything_else(expression: str) -> None:
    with pytest.raises(CalculatorError):
        safe_eval(expression)


def test_format_and_answer_parsing() -> None:
    assert format_number(Fraction(27)) == "27" and format_number(Fraction(7, 2)) == "3.5"
    assert format_number(Fraction(1, 3)) == "0.333333333333"
    assert parse_answer("answer: 42") == 42 and parse_answer("ANSWER = -1,234") == -1234
    assert parse_answer("first answer: 1 then answer: 2") == 2 and parse_answer("42") is None


def test_problems_are_seeded_integer_and_varied() -> None:
    texts = set()
    for seed in range(300):
        a, b = make_problem(random.Random(seed)), make_problem(random.Random(seed))
        assert a == b and isinstance(a.answer, int) and a.answer >= 0
        texts.add(a.text.split(" ")[1])
    assert len(texts) >= 6  # every template was drawn


def test_solving_with_the_tool_then_answering_scores_one() -> None:
    env = Calculator()
    opts = env_options(env)
    assert opts.system_prompt is not None and "calculator" in opts.system_prompt and "answer: N" in opts.system_prompt
    assert opts.max_turn_tokens >= 64 and env.handles_tool_calls

    async def episode(seed: int) -> list[StepResult]:
        problem = make_problem(random.Random(seed))
        assert await env.reset(seed) == problem.text
        tool = await env.step(calc(f"{problem.answer} * 1"))
        assert tool == StepResult(f"tool result: {problem.answer}", 0.0, False, {"tool": "calculator"})
        return [tool, await env.step(f"The result is in. answer: {problem.answer}")]

    for seed in range(20):
        _, final = run(episode(seed))
        assert final.done and final.reward == 1.0
        assert final.info == {"outcome": "correct", "expected": make_problem(random.Random(seed)).answer,
                              "tool_calls": 1}


def test_wrong_answer_scores_zero_and_ends() -> None:
    env = Calculator()
    run(env.reset(1))
    result = run(env.step("answer: -1"))
    assert result.done and result.reward == 0.0 and result.info["outcome"] == "wrong"
    with pytest.raises(EnvError, match="reset"):
        run(env.step("answer: 1"))


def test_malformed_calls_and_chatter_cost_turns_until_the_limit() -> None:
    env = Calculator(max_turns=4, max_tool_calls=10)

    async def go() -> list[StepResult]:
        await env.reset(3)
        return [await env.step(calc("import os")), await env.step("<tool>{oops}</tool>"),
                await env.step("let me think"), await env.step(calc("1+1"))]

    bad_expr, bad_json, chatter, last = run(go())
    assert bad_expr.observation.startswith("tool error: calculator failed:") and not bad_expr.done
    assert bad_json.info == {"tool_error": "bad_json"} and not bad_json.done
    assert chatter == StepResult("Call the calculator tool or reply with 'answer: N'.", 0.0, False)
    assert last.done and last.reward == 0.0 and last.info["outcome"] == "too_many_turns"
    assert last.info["tool_calls"] == 3


def test_too_many_tool_calls_ends_with_zero() -> None:
    env = Calculator(max_turns=10, max_tool_calls=2)

    async def go() -> list[StepResult]:
        await env.reset(0)
        return [await env.step(calc("1+1")) for _ in range(3)]

    first, second, third = run(go())
    assert not first.done and not second.done
    assert third.done and third.reward == 0.0 and third.info["outcome"] == "too_many_tool_calls"
    with pytest.raises(EnvError, match="max_turns"):
        Calculator(max_turns=0)
    assert Calculator(max_turns="3").max_turns == 3  # type: ignore[arg-type]  # CLI params are strings


# --------------------------------------------------------------------- through the agent loop

class ScriptedEngine:
    """An Engine that replies with fixed texts, in order (the model is the edge being faked here)."""

    def __init__(self, replies: list[list[int]], end_token_id: int) -> None:
        self.replies = replies
        self.end = end_token_id
        self.prompts: list[list[int]] = []

    def generate(self, requests: Sequence[Any]) -> list[Any]:
        from earl_stream.workers.engines.base import FinishReason, GenerateResult

        out: list[Any] = []
        for request in requests:
            self.prompts.append(list(request.prompt_ids))
            ids = self.replies.pop(0) + [self.end]
            out.append(GenerateResult(ids, [-0.5] * len(ids), FinishReason.STOP, policy_version=0))
        return out

    def load_state_dict(self, state: Mapping[str, object], version: int) -> None:
        raise AssertionError("not used")

    def release(self, cache_key: str) -> None:
        pass

    @property
    def policy_version(self) -> int:
        return 0


def test_a_tool_using_episode_through_the_agent_loop(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    from earl_stream.model.chat import ChatFormat
    from earl_stream.workers.agent_loop import Sampling, play_episode
    from earl_stream.workers.engines.batcher import AsyncBatcher

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    chat = ChatFormat(tokenizer)
    problem = make_problem(random.Random(11))
    texts = [calc(f"{problem.answer}+0"), f"answer: {problem.answer}"]
    engine = ScriptedEngine([tokenizer.encode(t, add_special_tokens=False) for t in texts], chat.end_token_id)
    env = Calculator()

    async def go():
        batcher = AsyncBatcher(engine)  # type: ignore[arg-type]
        try:
            return await play_episode(
                env, env_options(env), chat, batcher, env_name="calculator", seed=11, prompt_ordinal=0,
                group_id="g0", sampling=Sampling(), policy_version=lambda: 0, decode=tokenizer.decode)
        finally:
            await batcher.aclose()

    record = run(go())
    assert record.turns == 2 and record.reward == 1.0
    assert record.info == {"outcome": "correct", "expected": problem.answer, "tool_calls": 1}
    # The tool's result was shown to the model as the next user turn.
    second_prompt = tokenizer.decode(engine.prompts[1])
    assert f"tool result: {problem.answer}" in second_prompt and problem.text in second_prompt
