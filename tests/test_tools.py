"""Tool calling: the call format and its parser, argument checks, dispatch, and the ToolEnv wrapper."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest

from earl_stream.env import StepResult, env_options, env_reset, env_step
from earl_stream.env.tools import (
    MAX_RESULT_CHARS,
    Tool,
    ToolCall,
    ToolCallError,
    ToolDispatcher,
    ToolEnv,
    ToolErrorKind,
    ToolUsingEnv,
    check_arguments,
    parse_tool_call,
    render_tools,
    with_tools,
)
from earl_stream.errors import EnvError

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def call(name: str, **arguments: object) -> str:
    return "<tool>" + json.dumps({"name": name, "arguments": arguments}) + "</tool>"


ADD_SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
ADD = Tool("add", "Add two integers.", ADD_SCHEMA, lambda a, b: a + b)


def boom(**_: object) -> str:
    raise RuntimeError("kaput")


async def shout(text: str) -> str:
    await asyncio.sleep(0)
    return text.upper()


SHOUT = Tool("shout", "Upper-case a text.", {"type": "object", "properties": {"text": {"type": "string"}},
                                             "required": ["text"]}, shout)
BOOM = Tool("boom", "Always fails.", {"type": "object"}, boom)


# ------------------------------------------------------------------------------------------ parse

def test_plain_text_is_not_a_tool_call() -> None:
    for text in ["5", "answer: 3", "", "I would use a tool here", "<tools>", "tool>{}</tool>"]:
        assert parse_tool_call(text) is None


def test_valid_calls_and_the_tool_call_alias() -> None:
    assert parse_tool_call(call("add", a=1, b=2)) == ToolCall("add", {"a": 1, "b": 2})
    text = 'Let me compute.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call> done'
    assert parse_tool_call(text) == ToolCall("add", {"a": 1, "b": 2})
    assert parse_tool_call('<tool>{"name": "now"}</tool>') == ToolCall("now", {})
    # Only the first call counts.
    assert parse_tool_call(call("x") + call("y")) == ToolCall("x", {})


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        ('<tool>{"name": "add"', ToolErrorKind.UNTERMINATED),
        ('<tool>{"name": "add"}</tool_call>', ToolErrorKind.UNTERMINATED),
        ("<tool>{name: add}</tool>", ToolErrorKind.BAD_JSON),
        ("<tool></tool>", ToolErrorKind.BAD_JSON),
        ('<tool>{"name": "add",}</tool>', ToolErrorKind.BAD_JSON),
        ('<tool>["add"]</tool>', ToolErrorKind.BAD_SHAPE),
        ("<tool>3</tool>", ToolErrorKind.BAD_SHAPE),
        ('<tool>{"arguments": {}}</tool>', ToolErrorKind.BAD_SHAPE),
        ('<tool>{"name": ""}</tool>', ToolErrorKind.BAD_SHAPE),
        ('<tool>{"name": 3}</tool>', ToolErrorKind.BAD_SHAPE),
        ('<tool>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool>', ToolErrorKind.BAD_SHAPE),
        ('<tool>{"name": "add", "args": {}}</tool>', ToolErrorKind.BAD_SHAPE),
        ("<tool>" + "[" * 5000 + "]" * 5000 + "</tool>", ToolErrorKind.TOO_LONG),
        ('<tool>{"name": "add", "arguments": ' + "[" * 2000 + "]" * 2000 + "}</tool>", ToolErrorKind.BAD_JSON),
    ],
)
def test_malformed_calls(text: str, kind: ToolErrorKind) -> None:
    parsed = parse_tool_call(text)
    assert isinstance(parsed, ToolCallError) and parsed.kind is kind
    assert parsed.observation().startswith("tool error: ") and parsed.message


# ------------------------------------------------------------------------------ argument schema

def test_check_arguments_subset_of_json_schema() -> None:
    assert check_arguments(ADD_SCHEMA, {"a": 1, "b": 2}) is None
    assert check_arguments(ADD_SCHEMA, {"a": 1, "b": 2.0}) is None  # JSON 2.0 is an integer
    assert "missing required 'b'" in (check_arguments(ADD_SCHEMA, {"a": 1}) or "")
    assert "unexpected 'c'" in (check_arguments(ADD_SCHEMA, {"a": 1, "b": 2, "c": 3}) or "")
    assert "arguments.a must be integer, got string" == check_arguments(ADD_SCHEMA, {"a": "1", "b": 2})
    assert "got boolean" in (check_arguments(ADD_SCHEMA, {"a": True, "b": 2}) or "")
    assert "got number" in (check_arguments(ADD_SCHEMA, {"a": 1.5, "b": 2}) or "")
    schema = {"type": "object", "properties": {
        "unit": {"enum": ["km", "mi"]},
        "xs": {"type": "array", "items": {"type": "number"}},
        "maybe": {"type": ["string", "null"]},
    }}
    assert check_arguments(schema, {"unit": "km", "xs": [1, 2.5], "maybe": None, "extra": 1}) is None
    assert "one of" in (check_arguments(schema, {"unit": "ft"}) or "")
    assert "xs[1] must be number" in (check_arguments(schema, {"xs": [1, "2"]}) or "")
    assert "string or null" in (check_arguments(schema, {"maybe": 3}) or "")


def test_tool_declaration_is_checked_and_rendered() -> None:
    with pytest.raises(EnvError, match="name"):
        Tool("bad name", "x", {"type": "object"}, lambda: 1)
    with pytest.raises(EnvError, match="object"):
        Tool("t", "x", {"type": "string"}, lambda: 1)
    with pytest.raises(EnvError, match="callable"):
        Tool("t", "x", {"type": "object"}, "nope")  # type: ignore[arg-type]
    block = render_tools([ADD, SHOUT])
    assert '<tool>{"name": "TOOL_NAME", "arguments": {...}}</tool>' in block
    assert "- add: Add two integers." in block and "- shout: Upper-case a text." in block
    assert json.dumps(ADD_SCHEMA, separators=(", ", ": ")) in block
    assert ADD.spec() == {"name": "add", "description": "Add two integers.", "parameters": ADD_SCHEMA}


# ---------------------------------------------------------------------------------- dispatcher

def test_dispatcher_runs_sync_and_async_tools_and_reports_errors() -> None:
    d = ToolDispatcher([ADD, SHOUT, BOOM], max_tool_calls=10)

    async def go() -> list[StepResult | None]:
        return [
            await d.handle("7"),
            await d.handle(call("add", a=2, b=40)),
            await d.handle(call("shout", text="hi")),
            await d.handle(call("sub", a=1)),
            await d.handle(call("add", a=1)),
            await d.handle(call("boom")),
            await d.handle("<tool>oops</tool>"),
        ]

    plain, add, loud, unknown, bad_args, failed, bad_json = run(go())
    assert plain is None
    assert add == StepResult("tool result: 42", 0.0, False, {"tool": "add"})
    assert loud == StepResult("tool result: HI", 0.0, False, {"tool": "shout"})
    assert unknown == StepResult("tool error: unknown tool 'sub'; available: add, boom, shout", 0.0, False,
                                 {"tool_error": "unknown_tool"})
    assert bad_args is not None and bad_args.info == {"tool_error": "bad_arguments"}
    assert "missing required 'b'" in bad_args.observation and not bad_args.done
    assert failed is not None and failed.observation == "tool error: boom failed: kaput"
    assert bad_json is not None and bad_json.info == {"tool_error": "bad_json"}
    assert d.calls == 6  # the plain reply is not a call


def test_results_are_json_or_truncated() -> None:
    big = Tool("big", "", {"type": "object"}, lambda: "x" * (MAX_RESULT_CHARS + 10))
    obj = Tool("obj", "", {"type": "object"}, lambda: {"b": [1, 2]})
    d = ToolDispatcher([big, obj])
    assert run(d.handle(call("obj"))).observation == 'tool result: {"b": [1, 2]}'  # type: ignore[union-attr]
    long = run(d.handle(call("big"))).observation  # type: ignore[union-attr]
    assert long.endswith("...[truncated]") and len(long) < MAX_RESULT_CHARS + 40


def test_budget_counts_malformed_calls_and_ends_the_episode() -> None:
    d = ToolDispatcher([ADD], max_tool_calls=2)

    async def go() -> list[StepResult | None]:
        return [await d.handle("<tool>bad</tool>"), await d.handle(call("add", a=1, b=1)),
                await d.handle(call("add", a=1, b=1))]

    first, second, third = run(go())
    assert first is not None and not first.done and second is not None and not second.done
    assert third is not None and third.done and third.reward == 0.0
    assert third.info["outcome"] == "too_many_tool_calls"
    d.reset()
    assert d.calls == 0 and not run(d.handle(call("add", a=1, b=1))).done  # type: ignore[union-attr]
    with pytest.raises(EnvError, match="duplicate"):
        ToolDispatcher([ADD, ADD])


# ----------------------------------------------------------------------------------- ToolEnv

class SyncCounter:
    """Synchronous env with a declared tool: reply the secret number to win."""

    system_prompt = "Guess the number."
    max_turn_tokens = 4

    def __init__(self) -> None:
        self.tools = [Tool("hint", "The secret.", {"type": "object"}, lambda: self.secret)]
        self.secret = 0
        self.steps = 0

    def reset(self, seed: int) -> str:
        self.secret, self.steps = seed % 10, 0
        return "guess"

    def step(self, action_text: str) -> StepResult:
        self.steps += 1
        won = action_text.strip() == str(self.secret)
        if won or self.steps >= 3:
            return StepResult("bye", 1.0 if won else 0.0, True, {"outcome": "win" if won else "loss"})
        return StepResult("again", 0.0, False)


class AsyncNoTools:
    async def reset(self, seed: int) -> str:
        return f"s{seed}"

    async def step(self, action_text: str) -> StepResult:
        return StepResult("", float(action_text == "ok"), True, {"outcome": "done"})


def test_tool_env_wraps_a_sync_env_with_declared_tools() -> None:
    inner = SyncCounter()
    env = ToolEnv(inner, max_tool_calls=2)
    assert ToolUsingEnv is ToolEnv
    opts = env_options(env)
    assert opts.system_prompt is not None and opts.system_prompt.startswith("Guess the number.\n\n")
    assert "- hint: The secret." in opts.system_prompt
    assert opts.max_turn_tokens >= 64  # room for a call, though the game alone needs 4

    async def go() -> list[StepResult]:
        assert await env_reset(env, 7) == "guess"
        hint = await env_step(env, call("hint"))
        assert inner.steps == 0  # a tool call does not step the game
        return [hint, await env_step(env, "3"), await env_step(env, "7")]

    hint, miss, win = run(go())
    assert hint == StepResult("tool result: 7", 0.0, False, {"tool": "hint"})
    assert miss == StepResult("again", 0.0, False)
    assert win == StepResult("bye", 1.0, True, {"outcome": "win", "tool_calls": 1})
    with pytest.raises(EnvError, match="finished"):
        run(env.step("7"))


def test_tool_env_budget_and_explicit_tools_on_an_async_env() -> None:
    env = ToolEnv(AsyncNoTools(), tools=[ADD], max_tool_calls=1)
    assert env_options(env).system_prompt == render_tools([ADD])

    async def go() -> list[StepResult]:
        out = [await env.step(call("add", a=1, b=2)), await env.step("<tool>{}</tool>")]
        await env.reset(1)
        out.append(await env.step("ok"))
        return out

    assert run(env.reset(0)) == "s0"
    first, over, ok = run(go())
    assert first.observation == "tool result: 3"
    assert over.done and over.info["outcome"] == "too_many_tool_calls"
    assert ok == StepResult("", 1.0, True, {"outcome": "done", "tool_calls": 0})
    with pytest.raises(EnvError, match="needs tools"):
        ToolEnv(AsyncNoTools())


def test_with_tools_wraps_only_envs_that_need_it() -> None:
    plain = AsyncNoTools()
    assert with_tools(plain) is plain
    wrapped = with_tools(SyncCounter())
    assert isinstance(wrapped, ToolEnv)
    assert with_tools(wrapped) is wrapped
