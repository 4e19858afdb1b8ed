"""Agent environments: an episode is a program that talks to the policy through the OpenAI API.

An agent environment has `task(seed)` (one task of its dataset, drawn by the prompt's seed) and
`async run(client, task) -> float` (plays the task with an `openai.AsyncOpenAI` client pointed at the
rollout worker's own endpoint and returns the reward). It owns no tokens: the endpoint records what
the model saw and generated (`earl_stream.openai_api`), and the worker turns that and the reward into
a sample (`earl_stream.workers.agent_episode`). The protocol (`AgentEnvironment`, `is_agent_env`) is
`earl_stream.env.api`'s, registry lookup `earl_stream.env.registry`'s.

`AgentFunction` (registry name `agent`) brings a plain function and a dataset without a class:
`params: {run: path/to/agent.py:run, tasks: path/to/tasks.jsonl}` (or a module:function, and tasks as a
list in the config). `EnvAsAgent` (registry name `env_agent`) plays any text environment as an OpenAI-API
agent would: the same episodes as the built-in loop, through the endpoint (to check and measure it).
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

from earl_stream.env.api import DEFAULT_AGENT_TIMEOUT_S, env_options, env_reset, env_step
from earl_stream.env.images import openai_content
from earl_stream.env.registry import _import_module, _load_file, make_env
from earl_stream.env.tools import with_tools
from earl_stream.errors import EnvError

__all__ = ["AgentFunction", "EnvAsAgent"]


def _load_callable(spec: str) -> Any:
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise EnvError(f"agent run={spec!r} must look like 'path/to/file.py:function' or 'module:function'")
    module = _load_file(Path(target)) if target.endswith(".py") or "/" in target else _import_module(target, spec)
    fn = getattr(module, attr, None)
    if not inspect.iscoroutinefunction(fn):
        raise EnvError(f"agent run={spec!r} must name an `async def run(client, task) -> float`")
    return fn


def _load_tasks(tasks: Any) -> list[Any]:
    if isinstance(tasks, str):
        path = Path(tasks).expanduser()
        if not path.is_file():
            raise EnvError(f"agent tasks file {path} does not exist")
        try:
            rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        except ValueError as exc:
            raise EnvError(f"agent tasks file {path} is not JSON lines: {exc}") from None
    elif isinstance(tasks, list):
        rows = list(tasks)
    else:
        raise EnvError("agent tasks must be a JSON-lines file path or a list")
    if not rows:
        raise EnvError("agent tasks are empty")
    return rows


class AgentFunction:
    """An agent environment made of an `async def run(client, task)` and a list of tasks."""

    def __init__(self, run: str, tasks: Any, model: str = "policy", timeout_s: float = DEFAULT_AGENT_TIMEOUT_S) -> None:
        self._run = _load_callable(run)
        self._tasks = _load_tasks(tasks)
        self.model = model
        self.timeout_s = float(timeout_s)

    def task(self, seed: int) -> Any:
        """Task `seed` modulo the dataset's size."""
        return self._tasks[seed % len(self._tasks)]

    async def run(self, client: Any, task: Any) -> float:
        return float(await self._run(client, task))


class EnvAsAgent:
    """Any registered text environment played through the OpenAI API: `params: {env: SPEC, params: {...}}`.

    The conversation is the built-in loop's (system prompt, observations as user turns, replies as
    assistant turns, `max_turn_tokens` per reply), so with greedy decoding both give the same tokens.
    """

    def __init__(self, env: str, params: dict[str, Any] | None = None, model: str = "policy",
                 temperature: float | None = None, timeout_s: float = DEFAULT_AGENT_TIMEOUT_S) -> None:
        self.spec, self.params = env, dict(params or {})
        make_env(env, self.params)  # fail at load, not in every episode
        self.model, self.temperature, self.timeout_s = model, temperature, float(timeout_s)

    def task(self, seed: int) -> int:
        return seed

    async def run(self, client: Any, task: int) -> float:
        env = with_tools(make_env(self.spec, self.params))
        observation = await env_reset(env, int(task))
        options = env_options(env)
        messages: list[dict[str, Any]] = [{"role": "system", "content": options.system_prompt}] if options.system_prompt else []
        messages.append({"role": "user", "content": openai_content(observation)})
        extra = {} if self.temperature is None else {"temperature": self.temperature}
        reward = 0.0
        while True:
            out = await client.chat.completions.create(model=self.model, messages=messages,
                                                       max_tokens=options.max_turn_tokens, **extra)
            reply = out.choices[0].message.content or ""
            step = await env_step(env, reply)
            reward += float(step.reward)
            if step.done:
                return reward
            messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": openai_content(step.observation)}]
