"""OpenEnv environments (`openenv-core`) as text environments: the environment runs as an OpenEnv server
(its own process or container, FastAPI + WebSocket), the rollout worker plays it as a client.

`OpenEnvEnv(base_url="http://127.0.0.1:8000")` (registry name `openenv`) opens one WebSocket session per
episode with OpenEnv's `GenericEnvClient`: `reset(seed)` sends `reset(seed=...)`, `step(text)` sends the
action `{action_field: text}` (default field `message`; `action_extra` adds constant fields). The
observation shown to the model is the observation's `observation_field` if given, else its fields as
JSON (without `reward`, `done` and `metadata`). Rewards are OpenEnv's (None counts as 0); `info` on the
last step has "outcome" ("done" or "too_many_turns") and "return". Calls are blocking WebSocket calls,
run in a thread with `timeout_s`, so a server that hangs fails only its episodes. Needs `pip install
'openenv-core[core]'` (tested with 0.2.1).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from earl_stream.env import StepResult
from earl_stream.errors import EnvError

__all__ = ["OpenEnvEnv"]


class OpenEnvEnv:
    """One OpenEnv environment server, played over its WebSocket protocol (see the module docstring)."""

    def __init__(self, base_url: str, action_field: str = "message", observation_field: str | None = None,
                 action_extra: dict[str, Any] | None = None, system_prompt: str | None = None,
                 max_turn_tokens: int = 64, max_turns: int = 50, timeout_s: float = 30.0) -> None:
        try:
            from openenv.core import GenericEnvClient
        except ImportError:
            raise EnvError("the OpenEnv adapter needs openenv-core: pip install 'openenv-core[core]'") from None
        self._client_cls = GenericEnvClient
        self.base_url, self.action_field, self.observation_field = base_url, action_field, observation_field
        self.action_extra = dict(action_extra or {})
        self.system_prompt = system_prompt
        self.max_turn_tokens, self.max_turns, self.timeout_s = int(max_turn_tokens), int(max_turns), float(timeout_s)
        self._client: Any = None
        self._turns, self._return, self._done = 0, 0.0, True

    async def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return await asyncio.wait_for(asyncio.to_thread(fn, *args, **kwargs), self.timeout_s)
        except asyncio.TimeoutError:
            raise EnvError(f"OpenEnv server {self.base_url} did not answer within {self.timeout_s:.0f}s") from None
        except (ConnectionError, RuntimeError, OSError, ValueError) as exc:
            raise EnvError(f"OpenEnv server {self.base_url}: {exc}") from None

    def _text(self, observation: Any) -> str:
        if not isinstance(observation, dict):
            return str(observation)
        if self.observation_field is not None:
            if self.observation_field not in observation:
                raise EnvError(f"OpenEnv observation has no field {self.observation_field!r}: {sorted(observation)}")
            return str(observation[self.observation_field])
        shown = {k: v for k, v in observation.items() if k not in ("reward", "done", "metadata")}
        return json.dumps(shown, default=str)

    async def reset(self, seed: int) -> str:
        await self.close()
        self._client = self._client_cls(base_url=self.base_url, connect_timeout_s=self.timeout_s,
                                        message_timeout_s=self.timeout_s)
        result = await self._call(self._client.reset, seed=seed)
        self._turns, self._return, self._done = 0, 0.0, False
        return self._text(result.observation)

    async def step(self, action_text: str) -> StepResult:
        if self._done or self._client is None:
            raise EnvError("OpenEnvEnv.step() on a finished episode; call reset(seed)")
        self._turns += 1
        result = await self._call(self._client.step, {**self.action_extra, self.action_field: action_text})
        reward = float(result.reward or 0.0)
        self._return += reward
        done = bool(result.done) or self._turns >= self.max_turns
        if not done:
            return StepResult(self._text(result.observation), reward, False)
        self._done = True
        await self.close()
        outcome = "done" if result.done else "too_many_turns"
        return StepResult(self._text(result.observation), reward, True, {"outcome": outcome, "return": self._return})

    async def close(self) -> None:
        """End the WebSocket session (the server forgets the episode)."""
        client, self._client = self._client, None
        if client is not None:
            await asyncio.to_thread(client.close)
