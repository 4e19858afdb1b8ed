"""The supervisor's environment registry: the set of environments prompts are drawn from, which can
change while a run is live (`earl-stream env attach/detach`).

Every change bumps a version. Rollout workers learn the new set from their heartbeat replies, import
new environments, and report any that fail to import; a failing environment stops receiving new
prompts and the error is shown to the user. Detached environments stay known to workers so that
episodes already in flight finish.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from typing import Any

from earl_stream.config import GROUP_SEEDS, EnvSpec, config_to_dict
from earl_stream.errors import ConfigError


@dataclasses.dataclass
class EnvEntry:
    spec: EnvSpec
    active: bool = True
    added_version: int = 0
    errors: dict[str, str] = dataclasses.field(default_factory=dict)  # worker id -> why it cannot load it

    @property
    def usable(self) -> bool:
        return self.active and not self.errors and self.spec.weight > 0


class EnvRegistry:
    def __init__(self, specs: Iterable[EnvSpec]) -> None:
        self.version = 0
        self.entries: dict[str, EnvEntry] = {}
        for spec in specs:
            if spec.display_name in self.entries:
                raise ConfigError(f"envs: two environments are named {spec.display_name!r}; give one a `name`")
            self.entries[spec.display_name] = EnvEntry(spec)

    def attach(self, spec: str, name: str, weight: float, params: dict[str, Any], group_seed: str = "auto") -> EnvEntry:
        if group_seed not in GROUP_SEEDS:
            raise ConfigError(f"--group-seed must be one of {', '.join(GROUP_SEEDS)}, got {group_seed!r}")
        env = EnvSpec(spec=spec, name=name, weight=weight, params=dict(params), group_seed=group_seed)
        key = env.display_name
        if key in self.entries and self.entries[key].active:
            raise ConfigError(f"an environment named {key!r} is already attached; detach it or pick another --name")
        if weight < 0:
            raise ConfigError(f"--weight must be >= 0, got {weight}")
        self.version += 1
        self.entries[key] = EnvEntry(env, added_version=self.version)
        return self.entries[key]

    def detach(self, name: str) -> None:
        entry = self.entries.get(name)
        if entry is None or not entry.active:
            known = ", ".join(k for k, e in self.entries.items() if e.active) or "none"
            raise ConfigError(f"no attached environment named {name!r}; attached: {known}")
        entry.active = False
        self.version += 1

    def report(self, worker_id: str, errors: dict[str, str]) -> bool:
        """Record a worker's import failures; True if that changed what prompts may use."""
        changed = False
        for name, message in errors.items():
            entry = self.entries.get(name)
            if entry is not None and entry.errors.get(worker_id) != message:
                was_usable = entry.usable
                entry.errors[worker_id] = message
                changed |= was_usable
        if changed:
            self.version += 1
        return changed

    def usable_specs(self) -> list[EnvSpec]:
        return [e.spec for e in self.entries.values() if e.usable]

    def specs_json(self) -> str:
        """Every environment a worker may be asked to play (detached ones too: their episodes finish)."""
        return json.dumps([config_to_dict(e.spec) for e in self.entries.values()])

    def describe(self, loaded_versions: dict[str, int], episodes: dict[str, int]) -> list[dict[str, Any]]:
        out = []
        for name, e in self.entries.items():
            loaded = sum(1 for wid, v in loaded_versions.items() if v >= e.added_version and wid not in e.errors)
            out.append({"name": name, "spec": e.spec.spec, "weight": e.spec.weight, "params": e.spec.params,
                        "group_seed": e.spec.group_seed,
                        "active": e.active, "usable": e.usable, "loaded_by_workers": loaded, "errors": e.errors,
                        "episodes": episodes.get(name, 0)})
        return out
