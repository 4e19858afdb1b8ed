"""Held-out items of an environment: items the environment built with the training params never poses.

An environment offers them with a class-level hook

    @classmethod
    def held_out(cls, params: dict, problems: int) -> tuple[dict, list[int]]

returning the params of an environment that poses the held-out items and the `reset` seeds of
`problems` of them (`envs/reasoning_gym_env.py`: another dataset seed, questions of the training
dataset removed). An environment without that hook (a game whose seeds only draw an opponent's moves)
cannot be evaluated on held-out items, and asking for it is refused with that reason
(`HeldOutUnavailable`), at config load (`check_held_out`) and on the command line.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from earl_stream.env import resolve_env
from earl_stream.errors import ConfigError, EnvError

# outcomes (`info["outcome"]` of an episode's last step) that count as a success
SUCCESS_OUTCOMES = ("correct", "win")


class HeldOutUnavailable(ConfigError):
    """An environment cannot give held-out items; the message says why."""


@dataclasses.dataclass(frozen=True)
class HeldOutSet:
    """`seeds` of held-out items of `spec` built with `params` (the held-out params, not the training ones)."""

    name: str
    spec: str
    params: dict[str, Any]
    seeds: tuple[int, ...]
    success_outcomes: tuple[str, ...] = SUCCESS_OUTCOMES


def _hook(spec: str, name: str) -> Any:
    try:
        factory = resolve_env(spec)
    except EnvError as exc:
        raise HeldOutUnavailable(f"eval environment {name} ({spec}) cannot be loaded: {exc}") from None
    hook = getattr(factory, "held_out", None)
    if not callable(hook):
        raise HeldOutUnavailable(
            f"eval environment {name} ({spec}) cannot give held-out items: {getattr(factory, '__name__', spec)} "
            "defines no held_out(params, problems) classmethod, so no item is known to be outside the training "
            "set (evaluate an environment that has one, e.g. reasoning_gym; see earl_stream/evaluation/heldout.py)")
    return hook


def check_held_out(spec: str, name: str = "") -> None:
    """HeldOutUnavailable unless the environment `spec` offers held-out items (imports it; builds nothing)."""
    _hook(spec, name or spec)


def held_out_set(spec: str, params: dict[str, Any], problems: int, name: str = "") -> HeldOutSet:
    """`problems` held-out items of `spec` trained with `params`. HeldOutUnavailable says why not."""
    name = name or spec.rsplit(":", 1)[-1].lower()
    if problems < 1:
        raise HeldOutUnavailable(f"eval environment {name}: problems must be >= 1, got {problems}")
    hook = _hook(spec, name)
    try:
        held_params, seeds = hook(dict(params), problems)
    except EnvError as exc:
        raise HeldOutUnavailable(f"eval environment {name} ({spec}) gives no held-out items: {exc}") from None
    except Exception as exc:  # environment code: any failure is a reason, not a crash
        raise HeldOutUnavailable(f"eval environment {name} ({spec}): its held_out() raised "
                                 f"{type(exc).__name__}: {exc}") from None
    seeds = [int(s) for s in seeds]
    if len(seeds) != problems or len(set(seeds)) != len(seeds):
        raise HeldOutUnavailable(f"eval environment {name} ({spec}): held_out() gave {len(set(seeds))} distinct "
                                 f"items, not {problems}")
    return HeldOutSet(name=name, spec=spec, params=dict(held_params), seeds=tuple(seeds))
