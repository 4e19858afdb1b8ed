"""Held-out items of an environment: items the environment built with the training params never poses.

An environment offers them with a class-level hook

    @classmethod
    def held_out(cls, params: dict, problems: int) -> tuple[dict, list[int]]

returning the params of an environment that poses the held-out items and the `reset` seeds of
`problems` of them (`envs/reasoning_gym_env.py`: another dataset seed, questions of the training
dataset removed). An environment without that hook (a game whose seeds only draw an opponent's moves,
like Tic-Tac-Toe) is evaluated with its training params on seeds no run ever issues for training: the
evaluation half of the seed space (`earl_stream.env.seeds`), the same items in every run. A set says
which it is (`items`: "held_out" or "eval_seeds"). An environment that cannot be loaded, or whose hook
fails, is refused with the reason (`HeldOutUnavailable`), at config load (`check_held_out`) and on the
command line.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from earl_stream.env import resolve_env
from earl_stream.env.seeds import EVAL_SEEDS, eval_seeds
from earl_stream.errors import ConfigError, EnvError

# outcomes (`info["outcome"]` of an episode's last step) that count as a success
SUCCESS_OUTCOMES = ("correct", "win")
HELD_OUT = "held_out"  # items of the environment's own held_out() hook
EVAL_SEED_ITEMS = "eval_seeds"  # the training params on evaluation seeds (earl_stream.env.seeds)


class HeldOutUnavailable(ConfigError):
    """An environment cannot give held-out items; the message says why."""


@dataclasses.dataclass(frozen=True)
class HeldOutSet:
    """`seeds` of held-out items of `spec` built with `params` (the held-out params; for `items` = "eval_seeds",
    the training params on evaluation seeds)."""

    name: str
    spec: str
    params: dict[str, Any]
    seeds: tuple[int, ...]
    success_outcomes: tuple[str, ...] = SUCCESS_OUTCOMES
    items: str = HELD_OUT  # or EVAL_SEED_ITEMS

    def describe(self) -> str:
        """Where the items come from, in words (the eval command's summary, the supervisor's log)."""
        if self.items == EVAL_SEED_ITEMS:
            return f"evaluation seeds {self.seeds[0]}.. (never issued for training)"
        return "held-out items"


def _hook(spec: str, name: str) -> Any:
    """The environment's held_out() classmethod, or None where it defines none."""
    try:
        factory = resolve_env(spec)
    except EnvError as exc:
        raise HeldOutUnavailable(f"eval environment {name} ({spec}) cannot be loaded: {exc}") from None
    hook = getattr(factory, "held_out", None)
    return hook if callable(hook) else None


def check_held_out(spec: str, name: str = "") -> None:
    """HeldOutUnavailable unless the environment `spec` can be loaded (imports it; builds nothing): one without
    a held_out() hook is evaluated on evaluation seeds."""
    _hook(spec, name or spec)


def held_out_set(spec: str, params: dict[str, Any], problems: int, name: str = "") -> HeldOutSet:
    """`problems` held-out items of `spec` trained with `params`. HeldOutUnavailable says why not."""
    name = name or spec.rsplit(":", 1)[-1].lower()
    if problems < 1:
        raise HeldOutUnavailable(f"eval environment {name}: problems must be >= 1, got {problems}")
    hook = _hook(spec, name)
    if hook is None:
        if problems > len(EVAL_SEEDS):
            raise HeldOutUnavailable(f"eval environment {name}: at most {len(EVAL_SEEDS)} evaluation seeds")
        return HeldOutSet(name=name, spec=spec, params=dict(params), seeds=tuple(eval_seeds(problems)),
                          items=EVAL_SEED_ITEMS)
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
