"""Gymnasium environments as text environments: any Gymnasium id with a discrete action space.

`GymnasiumEnv(id="Taxi-v3")` (registry name `gymnasium`, `params: {id: <Gymnasium id>, ...}`; other
params go to `gymnasium.make`) shows the model the environment's ANSI rendering where it has one
(`render_mode="ansi"`: Taxi, FrozenLake, CliffWalking, ...), else the observation itself as text, plus
the list of actions. With `render_mode: rgb_array` (for a vision-language model) each observation is
the environment's rendered frame as an image, with the line "Your action?" instead of text. The
reply's action is the first action number in range, or the first action name it mentions (the names
of the toy-text environments are known; any other id uses numbers). A reply with no action gets a
reminder and costs a turn; `max_invalid` of them in a row end the episode. Rewards are Gymnasium's,
summed over the episode; `info` on the last step has "outcome" ("terminated", "truncated",
"too_many_turns" or "invalid") and "return".

ANSI colours carry state (the taxi, the player): a cell with a coloured background is shown as
`[x]`, coloured text as `(x)`, so the text the model reads keeps them. Needs `pip install gymnasium`.
"""

from __future__ import annotations

import re
from typing import Any

from earl_stream.env import Observation, StepResult
from earl_stream.errors import EnvError

__all__ = ["ACTION_NAMES", "GymnasiumEnv", "ansi_to_text"]

ACTION_NAMES: dict[str, list[str]] = {
    "Taxi": ["south", "north", "east", "west", "pickup", "dropoff"],
    "FrozenLake": ["left", "down", "right", "up"],
    "CliffWalking": ["up", "right", "down", "left"],
    "Blackjack": ["stick", "hit"],
}
_SGR = re.compile(r"\x1b\[([0-9;]*)m")


def ansi_to_text(rendered: str) -> str:
    """ANSI-coloured text as plain text: background-coloured spans as [x], foreground-coloured as (x)."""
    out: list[str] = []
    span: list[str] = []
    mark, pos = "", 0
    for m in _SGR.finditer(rendered):
        text = rendered[pos:m.start()]
        (span if mark else out).append(text)
        codes = {c for c in m.group(1).split(";") if c}
        if not codes or codes == {"0"}:
            if mark:
                out.append(mark[0] + "".join(span) + mark[1])
            mark, span = "", []
        elif any(c.startswith("4") and len(c) == 2 for c in codes):
            mark = "[]"
        elif any(c.startswith("3") and len(c) == 2 for c in codes) and not mark:
            mark = "()"
        pos = m.end()
    (span if mark else out).append(rendered[pos:])
    if mark:
        out.append(mark[0] + "".join(span) + mark[1])
    return "".join(out).strip("\n")


class GymnasiumEnv:
    """One Gymnasium environment (see the module docstring)."""

    max_turn_tokens = 16

    def __init__(self, id: str, max_turns: int = 50, max_invalid: int = 3, render_mode: str | None = None,
                 **make_kwargs: Any) -> None:
        try:
            import gymnasium
        except ImportError:
            raise EnvError("the gymnasium adapter needs the gymnasium package: pip install 'earl_stream[envs]'") from None
        self.id, self.max_turns, self.max_invalid = id, int(max_turns), int(max_invalid)
        if render_mode not in (None, "ansi", "rgb_array"):
            raise EnvError(f"GymnasiumEnv render_mode must be ansi or rgb_array (or unset), got {render_mode!r}")
        try:
            self._env = gymnasium.make(id, **make_kwargs)
            modes = self._env.metadata.get("render_modes", [])
        except Exception as exc:
            raise EnvError(f"gymnasium.make({id!r}) failed: {type(exc).__name__}: {exc}") from None
        if render_mode is not None and render_mode not in modes:
            raise EnvError(f"{id} cannot render as {render_mode} (its render modes: {modes})")
        self._rgb = render_mode == "rgb_array"
        self._ansi = not self._rgb and "ansi" in modes  # text the model can read; otherwise the observation itself
        if self._rgb or self._ansi:
            self._env.close()
            try:
                self._env = gymnasium.make(id, render_mode="rgb_array" if self._rgb else "ansi", **make_kwargs)
            except Exception as exc:
                raise EnvError(f"gymnasium.make({id!r}) failed: {type(exc).__name__}: {exc}") from None
        space = self._env.action_space
        if not isinstance(space, gymnasium.spaces.Discrete):
            raise EnvError(f"{id} has action space {space}; the gymnasium adapter needs a Discrete one")
        self._n, self._start = int(space.n), int(space.start)
        names = ACTION_NAMES.get(id.split("-")[0].split("/")[-1], [])
        self._names = names if len(names) == self._n else []
        listed = ", ".join(f"{self._start + i}: {n}" for i, n in enumerate(self._names)) if self._names else \
            f"{self._start} to {self._start + self._n - 1}"
        self.system_prompt = (f"You are playing the Gymnasium environment {id}. Each turn, reply with one action "
                              f"({listed}).")
        self._turns = self._invalid = 0
        self._return = 0.0
        self._done = True

    def _show(self, observation: Any) -> str | Observation:
        if self._rgb:  # the frame as an image (checked and PNG-encoded by Observation)
            return Observation("Your action?", [self._env.render()])
        if self._ansi:
            rendered: Any = self._env.render()
            if isinstance(rendered, str) and rendered.strip():
                return ansi_to_text(rendered)
        return observation if isinstance(observation, str) else f"observation: {observation}"

    async def reset(self, seed: int) -> str | Observation:
        observation, _ = self._env.reset(seed=seed)
        self._env.action_space.seed(seed)
        self._turns = self._invalid = 0
        self._return = 0.0
        self._done = False
        return self._show(observation)

    def parse_action(self, text: str) -> int | None:
        """The action a reply names: the first in-range number or action name, by position; None if none."""
        found: list[tuple[int, int]] = []
        for m in re.finditer(r"-?\d+", text):
            if self._start <= int(m.group()) < self._start + self._n:
                found.append((m.start(), int(m.group())))
                break
        for i, name in enumerate(self._names):
            named = re.search(rf"\b{re.escape(name)}\b", text, re.IGNORECASE)
            if named:
                found.append((named.start(), self._start + i))
        return min(found)[1] if found else None

    async def step(self, action_text: str) -> StepResult:
        if self._done:
            raise EnvError(f"GymnasiumEnv({self.id}).step() on a finished episode; call reset(seed)")
        self._turns += 1
        action = self.parse_action(action_text)
        if action is None:
            self._invalid += 1
            if self._invalid >= self.max_invalid:
                return self._finish("invalid", "no valid action")
            if self._turns >= self.max_turns:
                return self._finish("too_many_turns", "out of turns")
            return StepResult(f"That is not an action. {self.system_prompt.split('. ', 1)[1]}", 0.0, False)
        self._invalid = 0
        observation, reward, terminated, truncated, _ = self._env.step(action)
        self._return += float(reward)
        text = self._show(observation)
        if terminated or truncated or self._turns >= self.max_turns:
            outcome = "terminated" if terminated else "truncated" if truncated else "too_many_turns"
            return self._finish(outcome, text, float(reward))
        return StepResult(text, float(reward), False)

    def _finish(self, outcome: str, observation: str | Observation, reward: float = 0.0) -> StepResult:
        self._done = True
        return StepResult(observation, reward, True, {"outcome": outcome, "return": self._return})
