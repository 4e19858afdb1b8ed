"""Arithmetic word problems solved with a calculator tool, over several turns (a tool-use task).

`reset(seed)` draws one word problem from a few templates with `random.Random(seed)`; every answer is
an integer. The model may call the `calculator` tool (see `earl_stream.env.tools` for the call format),
whose result comes back as the next observation, and finishes with a reply containing
`answer: N`. Rewards: 1.0 for a correct final answer, 0.0 otherwise (wrong answer, no answer within
`max_turns` replies, or more than `max_tool_calls` calls). `info["outcome"]` on the terminal step is
one of "correct", "wrong", "too_many_turns", "too_many_tool_calls"; it also carries "expected" and
"tool_calls". A reply that is neither a tool call nor an answer gets a reminder and costs a turn.

`safe_eval` is the calculator: the expression is parsed with `ast` and only numbers, + - * / ** and
parentheses are evaluated, exactly (fractions), with bounded length, depth and number sizes; it never
calls `eval`.
"""

from __future__ import annotations

import ast
import math
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

from earl_stream.env import Observation, StepResult
from earl_stream.env.tools import DEFAULT_TOOL_TURN_TOKENS, Tool, ToolDispatcher, render_tools
from earl_stream.errors import EnvError

__all__ = ["CALCULATOR_TOOL", "Calculator", "CalculatorError", "Problem", "make_problem", "safe_eval"]

MAX_EXPRESSION_CHARS = 200
MAX_NODES = 100
MAX_BITS = 256  # numerator and denominator of every intermediate value
MAX_EXPONENT = 64


class CalculatorError(ValueError):
    """The expression is not allowed or cannot be evaluated; the message is shown to the model."""


_BINOPS: dict[type[ast.operator], Callable[[Fraction, Fraction], Fraction]] = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
}


def safe_eval(expression: str) -> Fraction:
    """Evaluate an arithmetic expression of numbers, + - * / ** and parentheses, exactly.

    Raises CalculatorError for anything else (names, calls, attributes, strings, ...), division by
    zero, non-integer or too large exponents, and numbers past MAX_BITS bits.
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise CalculatorError(f"cannot parse {expression!r}") from exc
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise CalculatorError(f"expression has more than {MAX_NODES} parts")
    return _eval(tree.body)


def _eval(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return _bounded(Fraction(node.value))
    if isinstance(node, ast.Constant) and type(node.value) is float:
        if not math.isfinite(node.value):  # e.g. 1e400 parses as inf
            raise CalculatorError("number too large")
        return _bounded(Fraction(str(node.value)))  # the decimal as written, not its binary float
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _eval(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp):
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            return _power(left, right)
        op = _BINOPS.get(type(node.op))
        if op is None:
            raise CalculatorError(f"operator {type(node.op).__name__} is not allowed; use + - * / **")
        if isinstance(node.op, ast.Div) and right == 0:
            raise CalculatorError("division by zero")
        return _bounded(op(left, right))
    raise CalculatorError(f"{type(node).__name__} is not allowed; use numbers, + - * / ** and parentheses")


def _power(base: Fraction, exponent: Fraction) -> Fraction:
    if exponent.denominator != 1 or abs(exponent) > MAX_EXPONENT:
        raise CalculatorError(f"exponents must be integers between -{MAX_EXPONENT} and {MAX_EXPONENT}")
    n = int(exponent)
    if base == 0 and n < 0:
        raise CalculatorError("division by zero")
    bits = max(base.numerator.bit_length(), base.denominator.bit_length())
    if bits * abs(n) > MAX_BITS:
        raise CalculatorError("number too large")
    return _bounded(base**n)


def _bounded(value: Fraction) -> Fraction:
    if value.numerator.bit_length() > MAX_BITS or value.denominator.bit_length() > MAX_BITS:
        raise CalculatorError("number too large")
    return value


def format_number(value: Fraction) -> str:
    """An integer as digits; any other fraction as a decimal with up to 12 significant digits."""
    if value.denominator == 1:
        return str(value.numerator)
    return format(float(value), ".12g")


def _calculator(expression: str) -> str:
    return format_number(safe_eval(expression))


CALCULATOR_TOOL = Tool(
    name="calculator",
    description="Evaluate an arithmetic expression with numbers, + - * / ** and parentheses.",
    parameters={
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "e.g. 3*(4+5)"}},
        "required": ["expression"],
        "additionalProperties": False,
    },
    fn=_calculator,
)


@dataclass(frozen=True)
class Problem:
    text: str
    answer: int


def make_problem(rng: random.Random, max_operand: int = 999) -> Problem:
    """One word problem with an integer answer, drawn from `rng`; operands are at most `max_operand`."""
    hi = max(max_operand, 12)

    def n(lo: int = 2) -> int:
        return rng.randint(lo, hi)

    kind = rng.randrange(6)
    if kind == 0:
        a, b = n(), n(2)
        c = rng.randint(1, a * b - 1)
        return Problem(f"A farm packs {a} crates with {b} eggs each. {c} eggs break. "
                       "How many eggs are left?", a * b - c)
    if kind == 1:
        s1, h1, s2, h2 = n(), rng.randint(2, 12), n(), rng.randint(2, 12)
        return Problem(f"A train runs at {s1} km per hour for {h1} hours, then at {s2} km per hour "
                       f"for {h2} hours. How many km does it travel in total?", s1 * h1 + s2 * h2)
    if kind == 2:
        people, share, tip = rng.randint(2, 12), n(), rng.randint(1, 20)
        return Problem(f"{people} friends split a bill of {people * share} dollars equally, and each "
                       f"also pays a {tip} dollar tip. How many dollars does each friend pay?", share + tip)
    if kind == 3:
        stock, shipments, size = n(), rng.randint(2, 20), n()
        sold = rng.randint(1, stock + shipments * size)
        return Problem(f"A store has {stock} items. It receives {shipments} shipments of {size} items "
                       f"each and sells {sold} items. How many items does it have now?",
                       stock + shipments * size - sold)
    if kind == 4:
        w, length = n(), n()
        side = rng.randint(1, min(w, length))
        return Problem(f"A garden is {w} m by {length} m. A square pond with sides of {side} m is dug "
                       "in it. How many square meters of garden are left?", w * length - side * side)
    price, qty, budget_extra = n(), rng.randint(2, 30), n(0)
    return Problem(f"A book costs {price} dollars. Sam buys {qty} books and has {budget_extra} dollars "
                   "left. How many dollars did Sam have at first?", price * qty + budget_extra)


_ANSWER = re.compile(r"answer\s*[:=]\s*(-?\d[\d,]*(?:\.\d+)?)", re.IGNORECASE)


def parse_answer(text: str) -> Fraction | None:
    """The number after the last "answer:" in `text` (commas allowed as thousands separators)."""
    matches = _ANSWER.findall(text)
    return Fraction(matches[-1].replace(",", "")) if matches else None


class Calculator:
    """Word problems with a calculator tool: call it as often as needed, then reply `answer: N`."""

    handles_tool_calls = True
    max_turn_tokens: int = DEFAULT_TOOL_TURN_TOKENS

    def __init__(self, max_turns: int = 6, max_tool_calls: int = 4, max_operand: int = 999) -> None:
        # int() because `env attach --param k=v` may pass strings
        max_turns, max_tool_calls, max_operand = int(max_turns), int(max_tool_calls), int(max_operand)
        if max_turns < 1 or max_tool_calls < 0 or max_operand < 1:
            raise EnvError(f"Calculator needs max_turns >= 1, max_tool_calls >= 0 and max_operand >= 1, "
                           f"got {max_turns}, {max_tool_calls}, {max_operand}")
        self.max_turns = max_turns
        self.max_operand = max_operand
        self.tools: list[Tool] = [CALCULATOR_TOOL]
        self._dispatcher = ToolDispatcher(self.tools, max_tool_calls)
        self.system_prompt: str = (
            "Solve the word problem. Use the calculator tool for the arithmetic, then reply with "
            "'answer: N' where N is the final number.\n\n" + render_tools(self.tools)
        )
        self._problem = Problem("", 0)
        self._turns = 0
        self._done = True

    async def reset(self, seed: int) -> str:
        """Draw the problem for `seed` and return its text."""
        self._problem = make_problem(random.Random(seed), self.max_operand)
        self._dispatcher.reset()
        self._turns = 0
        self._done = False
        return self._problem.text

    async def step(self, action_text: str) -> StepResult:
        """Run a tool call, score an `answer: N`, or remind the model of the format."""
        if self._done:
            raise EnvError("Calculator.step() called on a finished episode; call reset(seed) first")
        self._turns += 1
        tool_step = await self._dispatcher.handle(action_text)
        if tool_step is not None and tool_step.done:
            return self._finish(0.0, "too_many_tool_calls", tool_step.observation)
        out_of_turns = self._turns >= self.max_turns
        if tool_step is not None:
            return self._finish(0.0, "too_many_turns", tool_step.observation) if out_of_turns else tool_step
        answer = parse_answer(action_text)
        if answer is not None:
            correct = answer == self._problem.answer
            return self._finish(1.0 if correct else 0.0, "correct" if correct else "wrong",
                                "correct" if correct else "wrong")
        reminder = "Call the calculator tool or reply with 'answer: N'."
        if out_of_turns:
            return self._finish(0.0, "too_many_turns", reminder)
        return StepResult(reminder, 0.0, False)

    def _finish(self, reward: float, outcome: str, observation: str | Observation) -> StepResult:
        self._done = True
        info = {"outcome": outcome, "expected": self._problem.answer, "tool_calls": self._dispatcher.calls}
        return StepResult(observation, reward, True, info)
