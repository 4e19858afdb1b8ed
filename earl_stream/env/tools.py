"""Tool calling for environments: the tool-call format, its parser, and tool dispatch on the env side.

The format (one call per reply; text around the tags is ignored; only the first call runs)::

    <tool>{"name": "calculator", "arguments": {"expression": "3*(4+5)"}}</tool>

`<tool_call>...</tool_call>` (what Qwen2.5/Hermes-style instruct models emit) is accepted as an alias.
The body is one JSON object with a non-empty string "name" and an optional object "arguments"
(default {}); no other keys. The tool's answer comes back as the next observation, `tool result: ...`,
and a malformed call (unterminated tag, bad JSON, wrong shape, unknown tool, arguments that do not
match the tool's JSON schema, a tool that raises) as `tool error: ...`; the episode goes on either way.

Design: tool calls are handled INSIDE the environment, not by the agent loop. `ToolEnv` wraps any
environment (or an environment composes a `ToolDispatcher` itself, as `earl_stream_envs.calculator` does): its
`step(text)` runs a tool call and returns `StepResult(observation=tool result, reward=0, done=False)`
without stepping the wrapped environment. The agent loop therefore supports tools unchanged (a tool
turn is one more model turn, in the loss mask like any other), and a tool that hangs or crashes is
bounded by the loop's per-step timeout and failure handling like any environment code. A per-episode
budget of tool calls (`max_tool_calls`, malformed calls included) ends the episode with reward 0 and
`info["outcome"] == "too_many_tool_calls"` at the first call past it.

Tools run inline on the event loop: a tool that blocks for long should be `async def` (an awaitable
result is awaited) or offload its own work. Arguments are checked against a small subset of JSON
schema (type, properties, required, additionalProperties, enum, items); other keywords are ignored.
"""

from __future__ import annotations

import enum
import inspect
import json
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from earl_stream.env import Environment, StepResult, env_options, env_reset, env_step
from earl_stream.env.images import Observation
from earl_stream.errors import EnvError

__all__ = [
    "DEFAULT_MAX_TOOL_CALLS",
    "Tool",
    "ToolCall",
    "ToolCallError",
    "ToolDispatcher",
    "ToolEnv",
    "ToolErrorKind",
    "ToolUsingEnv",
    "check_arguments",
    "parse_tool_call",
    "render_tools",
    "with_tools",
]

logger = logging.getLogger(__name__)

DEFAULT_MAX_TOOL_CALLS = 8
MAX_CALL_CHARS = 4096
MAX_RESULT_CHARS = 2000
# A tool call alone needs ~20-40 tokens with a real tokenizer (more with a tiny byte-level one).
DEFAULT_TOOL_TURN_TOKENS = 96

_OPEN = re.compile(r"<(tool|tool_call)>")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}")
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,), "array": (list,), "string": (str,), "boolean": (bool,),
    "integer": (int,), "number": (int, float), "null": (type(None),),
}


@dataclass(frozen=True)
class Tool:
    """A tool the model may call: `fn(**arguments)` returns the result (str, JSON-able, or awaitable).

    parameters: a JSON schema for the arguments object, e.g.
      {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}.
    """

    name: str
    description: str
    parameters: dict[str, Any]
    fn: Callable[..., Any] = field(repr=False, compare=False)

    def __post_init__(self) -> None:
        if not _NAME.fullmatch(self.name):
            raise EnvError(f"tool name {self.name!r} must match {_NAME.pattern}")
        if not isinstance(self.parameters, dict) or self.parameters.get("type", "object") != "object":
            raise EnvError(f"tool {self.name!r}: parameters must be a JSON schema of type 'object'")
        if not callable(self.fn):
            raise EnvError(f"tool {self.name!r}: fn must be callable, got {type(self.fn).__name__}")

    def spec(self) -> dict[str, Any]:
        """The JSON-able declaration shown to the model (name, description, parameters)."""
        return {"name": self.name, "description": self.description, "parameters": self.parameters}


@dataclass(frozen=True)
class ToolCall:
    """A syntactically valid tool call parsed from a reply."""

    name: str
    arguments: dict[str, Any]


class ToolErrorKind(enum.Enum):
    UNTERMINATED = "unterminated"
    TOO_LONG = "too_long"
    BAD_JSON = "bad_json"
    BAD_SHAPE = "bad_shape"
    UNKNOWN_TOOL = "unknown_tool"
    BAD_ARGUMENTS = "bad_arguments"
    TOOL_FAILED = "tool_failed"


@dataclass(frozen=True)
class ToolCallError:
    """A reply that tried to call a tool and failed; `message` is what the model is told."""

    kind: ToolErrorKind
    message: str

    def observation(self) -> str:
        return f"tool error: {self.message}"


def parse_tool_call(text: str) -> ToolCall | ToolCallError | None:
    """Parse the first tool call in `text`: None if there is no opening tag, else a call or an error.

    Checks syntax and shape only; whether the tool exists and accepts the arguments is checked by
    `ToolDispatcher` against its tools.
    """
    start = _OPEN.search(text)
    if start is None:
        return None
    tag = start.group(1)
    end = text.find(f"</{tag}>", start.end())
    if end < 0:
        return ToolCallError(ToolErrorKind.UNTERMINATED, f"missing </{tag}> after <{tag}>")
    body = text[start.end():end].strip()
    if len(body) > MAX_CALL_CHARS:
        return ToolCallError(ToolErrorKind.TOO_LONG, f"tool call longer than {MAX_CALL_CHARS} characters")
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError) as exc:
        return ToolCallError(ToolErrorKind.BAD_JSON, f"the call is not valid JSON ({exc})")
    return _call_from_json(obj)


def _call_from_json(obj: object) -> ToolCall | ToolCallError:
    shape = 'expected {"name": "...", "arguments": {...}}'
    if not isinstance(obj, dict):
        return ToolCallError(ToolErrorKind.BAD_SHAPE, f"{shape}, got a JSON {type(obj).__name__}")
    extra = sorted(set(obj) - {"name", "arguments"})
    if extra:
        return ToolCallError(ToolErrorKind.BAD_SHAPE, f"{shape}; unexpected keys {extra}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ToolCallError(ToolErrorKind.BAD_SHAPE, f'{shape}; "name" must be a non-empty string')
    arguments = obj.get("arguments", {})
    if not isinstance(arguments, dict):
        return ToolCallError(ToolErrorKind.BAD_SHAPE, f'{shape}; "arguments" must be a JSON object')
    return ToolCall(name, arguments)


def check_arguments(schema: dict[str, Any], value: Any, path: str = "arguments") -> str | None:
    """Check `value` against the JSON-schema subset described in the module docstring.

    Returns None if it conforms, else a one-line description of the first problem.
    """
    expected = schema.get("type")
    if expected is not None:
        names = expected if isinstance(expected, list) else [expected]
        if not any(_is_type(value, n) for n in names):
            return f"{path} must be {' or '.join(names)}, got {_json_type(value)}"
    if "enum" in schema and value not in schema["enum"]:
        return f"{path} must be one of {schema['enum']}"
    if isinstance(value, dict):
        props: dict[str, Any] = schema.get("properties", {})
        for key in schema.get("required", []):
            if key not in value:
                return f"{path} is missing required {key!r}"
        for key, item in value.items():
            if key in props:
                problem = check_arguments(props[key], item, f"{path}.{key}")
                if problem:
                    return problem
            elif schema.get("additionalProperties", True) is False:
                return f"{path} has unexpected {key!r} (allowed: {sorted(props)})"
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            problem = check_arguments(schema["items"], item, f"{path}[{i}]")
            if problem:
                return problem
    return None


def _is_type(value: Any, name: str) -> bool:
    if name in ("integer", "number") and isinstance(value, bool):
        return False  # JSON true/false are not numbers, though Python's bool is an int
    if name == "integer" and isinstance(value, float):
        return value.is_integer()
    return isinstance(value, _JSON_TYPES.get(name, ()))


def _json_type(value: Any) -> str:
    for name in ("null", "boolean", "integer", "number", "string", "array", "object"):
        if _is_type(value, name) and not (name == "integer" and isinstance(value, float)):
            return name
    return type(value).__name__


def render_tools(tools: Sequence[Tool]) -> str:
    """The block appended to the system prompt: how to call a tool, then one entry per tool."""
    lines = [
        "You can call a tool by replying with exactly one call of this form:",
        '<tool>{"name": "TOOL_NAME", "arguments": {...}}</tool>',
        'Its result comes back as the next message ("tool result: ..." or "tool error: ...").',
        "Tools:",
    ]
    for tool in tools:
        lines.append(f"- {tool.name}: {tool.description}")
        lines.append(f"  arguments (JSON schema): {json.dumps(tool.parameters, separators=(', ', ': '))}")
    return "\n".join(lines)


def _result_text(result: Any) -> str:
    if isinstance(result, str):
        text = result
    else:
        try:
            text = json.dumps(result)
        except (TypeError, ValueError):
            text = str(result)
    if len(text) > MAX_RESULT_CHARS:
        text = text[:MAX_RESULT_CHARS] + " ...[truncated]"
    return text


class ToolDispatcher:
    """Runs the tool calls of one episode at a time and counts them against a budget.

    Compose one into an environment (reset it in `reset`, try `handle` first in `step`) or use
    `ToolEnv`, which does exactly that around any environment.
    """

    def __init__(self, tools: Sequence[Tool], max_tool_calls: int = DEFAULT_MAX_TOOL_CALLS) -> None:
        if max_tool_calls < 0:
            raise EnvError(f"max_tool_calls must be >= 0, got {max_tool_calls}")
        self.tools: dict[str, Tool] = {}
        for tool in tools:
            if not isinstance(tool, Tool):
                raise EnvError(f"tools must be earl_stream.env.tools.Tool instances, got {type(tool).__name__}")
            if tool.name in self.tools:
                raise EnvError(f"duplicate tool name {tool.name!r}")
            self.tools[tool.name] = tool
        self.max_tool_calls = max_tool_calls
        self.calls = 0

    def reset(self) -> None:
        """Start a new episode: the call budget is full again."""
        self.calls = 0

    async def handle(self, text: str) -> StepResult | None:
        """If `text` is a tool call, run it and return the step to report; None if it is not one.

        A non-terminal result has reward 0 and info {"tool": name} or {"tool_error": kind}; past the
        budget the result is terminal with reward 0 and info outcome "too_many_tool_calls".
        """
        parsed = parse_tool_call(text)
        if parsed is None:
            return None
        self.calls += 1
        if self.calls > self.max_tool_calls:
            return StepResult(
                f"tool error: too many tool calls (limit {self.max_tool_calls})", 0.0, True,
                {"outcome": "too_many_tool_calls", "tool_calls": self.calls},
            )
        if isinstance(parsed, ToolCallError):
            return StepResult(parsed.observation(), 0.0, False, {"tool_error": parsed.kind.value})
        outcome = await self.run(parsed)
        if isinstance(outcome, ToolCallError):
            return StepResult(outcome.observation(), 0.0, False, {"tool_error": outcome.kind.value})
        return StepResult(f"tool result: {outcome}", 0.0, False, {"tool": parsed.name})

    async def run(self, call: ToolCall) -> str | ToolCallError:
        """Run one parsed call: its result as text, or why it could not run."""
        tool = self.tools.get(call.name)
        if tool is None:
            known = ", ".join(sorted(self.tools)) or "none"
            return ToolCallError(ToolErrorKind.UNKNOWN_TOOL, f"unknown tool {call.name!r}; available: {known}")
        problem = check_arguments(tool.parameters, call.arguments)
        if problem:
            return ToolCallError(ToolErrorKind.BAD_ARGUMENTS, f"{call.name}: {problem}")
        try:
            result = tool.fn(**call.arguments)
            if inspect.isawaitable(result):
                result = await result
        except Exception as exc:  # tool code is user code: its failure is the model's observation
            logger.debug("tool %s failed on %r", call.name, call.arguments, exc_info=True)
            return ToolCallError(ToolErrorKind.TOOL_FAILED, f"{call.name} failed: {exc}")
        return _result_text(result)


class ToolEnv:
    """Wraps an environment so that replies which are tool calls run a tool instead of a step.

    Tools come from `tools` or else from the wrapped env's `tools` attribute. The system prompt is the
    wrapped env's plus `render_tools(tools)`; `max_turn_tokens` is at least `tool_turn_tokens` so a
    call fits in one turn. The wrapped env's terminal info gains "tool_calls" (calls this episode).
    """

    handles_tool_calls = True

    def __init__(self, env: object, tools: Sequence[Tool] | None = None,
                 max_tool_calls: int = DEFAULT_MAX_TOOL_CALLS,
                 tool_turn_tokens: int = DEFAULT_TOOL_TURN_TOKENS) -> None:
        if tools is None:
            tools = list(getattr(env, "tools", None) or [])
        if not tools:
            raise EnvError(f"ToolEnv({type(env).__name__}) needs tools: pass tools= or declare env.tools")
        self.inner = env
        self.tools: list[Tool] = list(tools)
        self._dispatcher = ToolDispatcher(self.tools, max_tool_calls)
        inner = env_options(env)
        block = render_tools(self.tools)
        self.system_prompt: str = f"{inner.system_prompt}\n\n{block}" if inner.system_prompt else block
        self.max_turn_tokens: int = max(inner.max_turn_tokens, tool_turn_tokens)
        self.max_episode_tokens: int | None = inner.max_episode_tokens
        self._done = True

    async def reset(self, seed: int) -> str | Observation:
        """Reset the wrapped env (sync or async) and the tool-call budget."""
        self._dispatcher.reset()
        observation = await env_reset(self.inner, seed)
        self._done = False
        return observation

    async def step(self, action_text: str) -> StepResult:
        """Run a tool call, or else step the wrapped env with `action_text`."""
        if self._done:
            raise EnvError(f"ToolEnv({type(self.inner).__name__}).step() on a finished episode; call reset(seed)")
        result = await self._dispatcher.handle(action_text)
        if result is None:
            result = await env_step(self.inner, action_text)
            if result.done:
                result = StepResult(result.observation, result.reward, True,
                                    {**result.info, "tool_calls": self._dispatcher.calls})
        self._done = result.done
        return result


# The name the design notes use for the same wrapper.
ToolUsingEnv = ToolEnv


def with_tools(env: Environment, max_tool_calls: int = DEFAULT_MAX_TOOL_CALLS) -> Environment:
    """`env` itself if it declares no tools or handles them itself (`handles_tool_calls`), else ToolEnv(env)."""
    if getattr(env, "handles_tool_calls", False) or not getattr(env, "tools", None):
        return env
    return ToolEnv(env, max_tool_calls=max_tool_calls)

