"""Hosting the instances of one environment for episodes driven from elsewhere: the messages that open, step
and close an episode (`EnvOpen`/`EnvOpened`, `EnvStep`/`EnvStepped`, `EnvClose`/`EnvClosed`, `EnvFailed`) and
`EnvHost`, which keeps one instance per episode id, answers those messages and drops instances left idle.

Transports are the callers': `earl_stream.env.server` serves a host on ZMQ with signed frames (`earl-stream env
serve`), `earl_stream.workers.env_runner` in a sandboxed child over a socket pair. Both send msgspec messages,
never pickles; their failures come back as `EnvFailed`.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import msgspec

from earl_stream.env import Environment, env_options, env_reset, env_step, make_env
from earl_stream.env.api import DEFAULT_AGENT_TIMEOUT_S, StepResult, is_agent_env
from earl_stream.env.images import Image, Observation, join_observation, received_images, split_observation
from earl_stream.env.tools import with_tools
from earl_stream.errors import EnvError
from earl_stream.protocol import Msg

__all__ = ["EnvClose", "EnvClosed", "EnvFailed", "EnvHost", "EnvOpen", "EnvOpened", "EnvStep", "EnvStepped",
           "failure", "opened_observation", "out_of_memory", "stepped_result"]

log = logging.getLogger(__name__)


class EnvOpen(Msg, tag="env_open", frozen=True):
    episode: str = ""
    seed: int = 0


class EnvOpened(Msg, tag="env_opened", frozen=True):
    observation: str = ""
    images: tuple[Image, ...] = ()  # shown before `observation`'s text (PNG bytes: see earl_stream.env.images)
    system_prompt: str | None = None
    max_turn_tokens: int = 32
    max_episode_tokens: int | None = None


class EnvStep(Msg, tag="env_step", frozen=True):
    episode: str = ""
    action: str = ""


class EnvStepped(Msg, tag="env_stepped", frozen=True):
    observation: str = ""
    images: tuple[Image, ...] = ()
    reward: float = 0.0
    done: bool = False
    info_json: str = "{}"


class EnvClose(Msg, tag="env_close", frozen=True):
    episode: str = ""


class EnvClosed(Msg, tag="env_closed", frozen=True):
    pass


class EnvFailed(Msg, tag="env_failed", frozen=True):
    message: str = ""


EnvRequest = EnvOpen | EnvStep | EnvClose
EnvReply = EnvOpened | EnvStepped | EnvClosed | EnvFailed


def opened_observation(opened: EnvOpened, sender: str) -> str | Observation:
    """The first observation a host sent (its images decoded again: the host may not be trusted)."""
    return join_observation(opened.observation, received_images(opened.images, sender))


def stepped_result(stepped: EnvStepped, sender: str) -> StepResult:
    """The step result a host sent (its images decoded again: the host may not be trusted)."""
    observation = join_observation(stepped.observation, received_images(stepped.images, sender))
    return StepResult(observation, stepped.reward, stepped.done, json.loads(stepped.info_json))


def failure(exc: BaseException) -> EnvFailed:
    """The reply for a request that raised `exc`: an environment's failure is its episode's, never the host's."""
    if isinstance(exc, (msgspec.DecodeError, msgspec.ValidationError)):
        return EnvFailed(message=f"not an environment-server message: {exc}")
    if isinstance(exc, EnvError):
        return EnvFailed(message=str(exc))
    return EnvFailed(message=f"{type(exc).__name__}: {exc}")


def out_of_memory(exc: BaseException) -> bool:
    """Whether `exc` is, or was raised from, a MemoryError (an allocation refused by an address-space limit)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, MemoryError):
            return True
        seen = seen.__cause__
    return False


class EnvHost:
    """The instances of environment `spec` (built with `params`), one per open episode; an instance not used for
    `idle_s` is dropped by `reap` (its driver died). Requests may be handled concurrently. An agent environment
    (`agent`; its `timeout_s`) is made once, to check it; its episodes are played elsewhere (`agent_runner`)."""

    def __init__(self, spec: str, params: dict[str, Any] | None = None, *, idle_s: float = 600.0) -> None:
        self.spec, self.params, self.idle_s = spec, dict(params or {}), idle_s
        probe = make_env(spec, self.params)  # fail now, at start, if it cannot be built
        flag = getattr(probe, "seed_per_episode", False)
        self.seed_per_episode = flag if isinstance(flag, bool) else False  # (what a driver's proxy can show)
        self.agent = is_agent_env(probe)
        timeout = getattr(probe, "timeout_s", DEFAULT_AGENT_TIMEOUT_S)
        self.timeout_s = float(timeout) if isinstance(timeout, (int, float)) else DEFAULT_AGENT_TIMEOUT_S
        self._envs: dict[str, tuple[Environment, float]] = {}

    @property
    def open_episodes(self) -> int:
        return len(self._envs)

    def reap(self) -> list[str]:
        """Drop the instances idle for longer than `idle_s`; their episode ids."""
        now = time.monotonic()
        dropped = [k for k, (_, seen) in self._envs.items() if now - seen > self.idle_s]
        for key in dropped:
            del self._envs[key]
            log.info("dropped idle episode %s", key)
        return dropped

    async def handle(self, msg: Any) -> EnvReply:
        """The reply to `msg`; raises what the environment raised (`failure` makes the reply of it)."""
        if isinstance(msg, EnvOpen):
            env = with_tools(make_env(self.spec, self.params))
            options = env_options(env)
            text, images = split_observation(await env_reset(env, msg.seed))
            self._envs[msg.episode] = (env, time.monotonic())
            return EnvOpened(observation=text, images=images, system_prompt=options.system_prompt,
                             max_turn_tokens=options.max_turn_tokens, max_episode_tokens=options.max_episode_tokens)
        if isinstance(msg, EnvStep):
            held = self._envs.get(msg.episode)
            if held is None:
                raise EnvError(f"episode {msg.episode!r} is not open on this server (dropped as idle, or never opened)")
            self._envs[msg.episode] = (held[0], time.monotonic())
            result = await env_step(held[0], msg.action)
            if result.done:
                self._envs.pop(msg.episode, None)
            text, images = split_observation(result.observation)
            return EnvStepped(observation=text, images=images, reward=float(result.reward), done=result.done,
                              info_json=json.dumps(result.info, default=str))
        if isinstance(msg, EnvClose):
            self._envs.pop(msg.episode, None)
            return EnvClosed()
        raise EnvError(f"unexpected message {type(msg).__name__}")
