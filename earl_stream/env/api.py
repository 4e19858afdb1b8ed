"""What an environment is to earl_stream: the protocols, their result type, and how they are driven.

`Environment` (a multi-turn text environment: `reset(seed)`, `step(text)` -> `StepResult`) and
`AgentEnvironment` (an episode that is a program talking to the policy through the OpenAI API:
`task(seed)`, `async run(client, task)`); how an environment's optional attributes are read
(`env_options`, `seeds_per_episode`); how sync or async implementations are driven (`env_reset`,
`env_step`, and `run_now` for a caller without an event loop). How a spec string becomes a class is `earl_stream.env.registry`'s.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, runtime_checkable

from earl_stream.env.images import Observation, split_observation
from earl_stream.errors import EnvError

__all__ = [
    "DEFAULT_AGENT_TIMEOUT_S",
    "DEFAULT_MAX_TURN_TOKENS",
    "AgentEnvironment",
    "EnvFactory",
    "EnvOptions",
    "Environment",
    "Observation",
    "StepResult",
    "env_options",
    "env_reset",
    "env_step",
    "is_agent_env",
    "run_now",
    "seeds_per_episode",
]
T = TypeVar("T")

DEFAULT_AGENT_TIMEOUT_S = 300.0
DEFAULT_MAX_TURN_TOKENS = 32


@dataclass(frozen=True)
class StepResult:
    """What one environment step returns.

    observation: what the model is shown next, text or an `Observation` (text and images); ignored by the agent
        loop once `done`.
    reward: float reward of this step; an episode's return is the sum over its steps.
    done: True on the terminal step.
    info: small JSON-able dict (e.g. {"outcome": "win"} on the terminal step).
    """

    observation: str | Observation
    reward: float
    done: bool
    info: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Environment(Protocol):
    """A multi-turn environment: text in, text (or text and images, an `Observation`) out.

    Required: `reset(seed)` returns the first observation (a str, or an `Observation` with images); `step(action_text)` applies the model's
    decoded reply. Both may be `async def` (preferred) or plain methods; drive them with
    `env_reset` / `env_step`. Optional attributes, read with `env_options`:
    `system_prompt: str | None` (None), `max_turn_tokens: int` (32),
    `max_episode_tokens: int | None` (None, no limit beyond the engine's);
    `seed_per_episode: bool` (False; read with `seeds_per_episode`): True where the seed only draws chance,
    not the task, so the episodes of a group may each get their own.
    """

    async def reset(self, seed: int) -> str | Observation: ...

    async def step(self, action_text: str) -> StepResult: ...


EnvFactory = Callable[..., Environment]


@dataclass(frozen=True)
class EnvOptions:
    """The optional attributes of an environment, with defaults filled in."""

    system_prompt: str | None = None
    max_turn_tokens: int = DEFAULT_MAX_TURN_TOKENS
    max_episode_tokens: int | None = None


def env_options(env: object) -> EnvOptions:
    """Read an environment's optional attributes (see `Environment`), checking their types."""
    name = type(env).__name__
    system_prompt = getattr(env, "system_prompt", None)
    if system_prompt is not None and not isinstance(system_prompt, str):
        raise EnvError(f"{name}.system_prompt must be a str or None, got {type(system_prompt).__name__}")
    max_turn = getattr(env, "max_turn_tokens", DEFAULT_MAX_TURN_TOKENS)
    if not isinstance(max_turn, int) or isinstance(max_turn, bool) or max_turn < 1:
        raise EnvError(f"{name}.max_turn_tokens must be a positive int, got {max_turn!r}")
    max_episode = getattr(env, "max_episode_tokens", None)
    if max_episode is not None and (not isinstance(max_episode, int) or max_episode < 1):
        raise EnvError(f"{name}.max_episode_tokens must be a positive int or None, got {max_episode!r}")
    return EnvOptions(system_prompt, max_turn, max_episode)


def seeds_per_episode(group_seed: str, env: object) -> bool:
    """Whether the episodes of a group reset `env` with a seed each (`EnvSpec.group_seed`): `auto` asks the
    environment's `seed_per_episode` attribute before its reset (a served environment's proxy has none: shared)."""
    if group_seed != "auto":
        return group_seed == "per_episode"
    flag = getattr(env, "seed_per_episode", False)
    if not isinstance(flag, bool):
        raise EnvError(f"{type(env).__name__}.seed_per_episode must be a bool, got {flag!r}")
    return flag


async def _call(env: object, method: str, arg: object) -> object:
    fn = getattr(env, method, None)
    if fn is None or not callable(fn):
        raise EnvError(f"{type(env).__name__} has no callable {method}(); it is not an Environment")
    try:
        result = fn(arg)
        if inspect.isawaitable(result):
            result = await result
    except EnvError:
        raise
    except Exception as exc:  # an environment's own bug: typed so the agent loop can fail the episode
        raise EnvError(f"{type(env).__name__}.{method}() raised {type(exc).__name__}: {exc}") from exc
    return result


async def env_reset(env: object, seed: int) -> str | Observation:
    """Reset `env` (sync or async `reset`) and return its first observation (checked to be a str or an
    `Observation`, whose images were checked when it was made)."""
    observation = await _call(env, "reset", seed)
    split_observation(observation, f"{type(env).__name__}.reset()'s first observation")
    return observation  # type: ignore[return-value]  # checked just above


async def env_step(env: object, action: str) -> StepResult:
    """Step `env` (sync or async `step`) with the decoded action text; the result must be a StepResult."""
    result = await _call(env, "step", action)
    if not isinstance(result, StepResult):
        raise EnvError(
            f"{type(env).__name__}.step() must return earl_stream.env.StepResult, "
            f"got {type(result).__name__}"
        )
    split_observation(result.observation, f"{type(env).__name__}.step()'s observation")
    return result


@runtime_checkable
class AgentEnvironment(Protocol):
    """An environment whose episode is an agent program: `task(seed)` draws one task of its dataset, `run(client,
    task)` plays it with an `openai.AsyncOpenAI` client on the rollout worker's endpoint and returns the reward
    (see `earl_stream.env.agent`).

    Optional attribute: `timeout_s: float` (300): an episode still running after it fails.
    """

    def task(self, seed: int) -> Any: ...

    async def run(self, client: Any, task: Any) -> float: ...


def is_agent_env(env: object) -> bool:
    """Whether `env` is played as an agent (has `run` and `task`, and no `step`)."""
    return callable(getattr(env, "run", None)) and callable(getattr(env, "task", None)) and not hasattr(env, "step")


def run_now(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine that never suspends (`env_reset` / `env_step` of a game whose methods never await) to its
    result without an event loop; works inside a running event loop too, where asyncio.run would refuse. EnvError
    if it suspends (an environment that awaits needs an event loop)."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    coro.close()
    raise EnvError("the environment suspended: this caller drives environments that never await")
