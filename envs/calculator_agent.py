"""The calculator word problems (`earl_stream_envs.calculator`) written as an agent: an ordinary OpenAI-API program
with tool calls in the OpenAI tools format, trained as it is through the rollout worker's endpoint.

`task(seed)` draws the same problem `Calculator.reset(seed)` would; `run(client, task)` chats with the
policy: tool calls run the calculator and come back as `tool` messages, a reply with `answer: N` ends
the episode (reward 1.0 if N is right, else 0.0), as does running out of turns or tool calls (0.0).

`summarize_after=K` (0: never) makes it a summarising agent, as long-horizon agents fold their context:
once the conversation holds K of its replies, they and the tool results are replaced by one summary (the
question and the calculator results so far), and the agent goes on from there. Such a request does not
extend what the model saw: the rollout worker's `rollout.non_append` decides whether the episode goes on
as a new segment (`split`) or the request is refused (`refuse`, and this agent then fails its episode).
"""

from __future__ import annotations

import json
import random
from typing import Any

from earl_stream_envs.calculator import CALCULATOR_TOOL, CalculatorError, make_problem, parse_answer, safe_eval
from earl_stream_envs.calculator import format_number as _fmt

from earl_stream.errors import EnvError

SYSTEM = "Solve the word problem. Use the calculator tool for the arithmetic, then reply with 'answer: N'."
TOOL = {"type": "function", "function": CALCULATOR_TOOL.spec()}


def calculate(arguments: str) -> str:
    """The tool's answer to a call's JSON arguments (an error message for the model if they are bad)."""
    try:
        args = json.loads(arguments)
        expression = args["expression"] if isinstance(args, dict) else None
        if not isinstance(expression, str):
            return 'error: arguments must be {"expression": "..."}'
        return _fmt(safe_eval(expression))
    except (ValueError, KeyError, CalculatorError) as exc:
        return f"error: {exc}"


class CalculatorAgent:
    """Word problems with a calculator, played by an OpenAI-API agent (see the module docstring)."""

    def __init__(self, max_turns: int = 6, max_tool_calls: int = 4, max_operand: int = 999, max_tokens: int = 96,
                 model: str = "policy", timeout_s: float = 300.0, summarize_after: int = 0) -> None:
        self.max_turns, self.max_tool_calls = int(max_turns), int(max_tool_calls)
        self.max_operand, self.max_tokens = int(max_operand), int(max_tokens)
        self.summarize_after = int(summarize_after)
        if self.max_turns < 1 or self.max_tool_calls < 0 or self.max_operand < 1 or self.max_tokens < 1 \
                or self.summarize_after < 0:
            raise EnvError("CalculatorAgent needs max_turns >= 1, max_tool_calls >= 0, max_operand >= 1, max_tokens >= 1, "
                           "summarize_after >= 0")
        self.model = model
        self.timeout_s = float(timeout_s)

    def task(self, seed: int) -> dict[str, Any]:
        problem = make_problem(random.Random(seed), self.max_operand)
        return {"question": problem.text, "answer": problem.answer}

    async def run(self, client: Any, task: dict[str, Any]) -> float:
        messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM},
                                          {"role": "user", "content": task["question"]}]
        calls, results = 0, list[str]()
        for turn in range(self.max_turns):
            if self.summarize_after and turn and turn % self.summarize_after == 0:
                messages = _summary(task["question"], results)
            out = await client.chat.completions.create(model=self.model, messages=messages, tools=[TOOL],
                                                       max_tokens=self.max_tokens)
            message = out.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if message.tool_calls:
                for call in message.tool_calls:
                    calls += 1
                    if calls > self.max_tool_calls:
                        return 0.0
                    results.append(calculate(call.function.arguments))
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": results[-1]})
                continue
            answer = parse_answer(message.content or "")
            if answer is not None:
                return 1.0 if answer == task["answer"] else 0.0
            messages.append({"role": "user", "content": "Call the calculator tool or reply with 'answer: N'."})
        return 0.0


def _summary(question: str, results: list[str]) -> list[dict[str, Any]]:
    """The conversation after a summarising agent folded its turns: the question and what it has found."""
    found = ", ".join(results) if results else "none yet"
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"{question}\n\n(Summary of your earlier turns: calculator results {found}.)"}]
