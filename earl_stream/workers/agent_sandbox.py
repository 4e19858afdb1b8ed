"""The sandbox a rollout worker's agent processes run in (`sandbox.*`, `earl_stream.sandbox`), and what an agent
environment's process needs to see in it.

`agent_sandbox(cfg)`: the spec every agent process of the worker starts from (the mode resolved: bwrap falls back
to process, with the warning to log), or None under `sandbox.mode=none`. `EnvSource.of(spec)`: for one agent
environment's registry spec and parameters, what its process is given: the spec and parameters as they resolve
inside (a `file.py:attr` named relative to the worker's folder made absolute), the paths it must read (that file's
folder, the folder of a module that is not installed, e.g. one importable from the worker's working directory)
and the import path that finds them, and each file a parameter names (made absolute). An installed package or
entry point needs nothing: the sandbox shows the interpreter's packages. Folders named in parameters are not shown:
the process works in its own empty folder. `runs_sandboxed(spec, params)`: whether an environment is code from
outside this project, told from its spec without importing it.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from earl_stream.env.registry import ENTRY_POINT_GROUP, is_registered
from earl_stream.sandbox import Limits, SandboxMode, SandboxSpec, resolve_mode
from earl_stream.sandbox.launch import visible_roots

if TYPE_CHECKING:
    from earl_stream.config import RunConfig

log = logging.getLogger(__name__)

_OURS = ("earl_stream", "earl_stream_envs")


def agent_sandbox(cfg: RunConfig, what: str = "agent programs") -> SandboxSpec | None:
    """The spec of the worker's agent processes (their wall time is each episode's timeout, not a limit here);
    `what` runs in them, for the warning under `sandbox.mode=none` (the environment runners' spec starts here too)."""
    s = cfg.sandbox
    mode, warning = resolve_mode(s.mode)
    if warning:
        log.warning("%s", warning)
    if mode is SandboxMode.NONE:
        log.warning("sandbox.mode=none: %s run without limits, as this worker's user", what)
        return None
    limits = Limits(cpu_seconds=s.cpu_seconds, wall_seconds=365 * 86400.0, memory_bytes=s.memory_bytes,
                    processes=s.processes)
    return SandboxSpec(mode=mode, limits=limits)


def env_sandbox(base: SandboxSpec, limits: Mapping[str, float], network: Sequence[str]) -> SandboxSpec:
    """`base` with an environment's own `limits` (`EnvSpec.limits`, checked at load) and `network` (`EnvSpec.network`)."""
    if not limits and not network:
        return base
    changed = dataclasses.replace(base.limits, **{k: type(getattr(base.limits, k))(v) for k, v in limits.items()})
    return dataclasses.replace(base, limits=changed, network=(*base.network, *network))


@dataclasses.dataclass(frozen=True)
class EnvSource:
    spec: str  # the registry spec as the agent process resolves it
    params: dict[str, Any]  # its parameters, code references in them made absolute
    read_only: tuple[str, ...] = ()  # what it must be able to read
    python_path: tuple[str, ...] = ()  # prepended to its PYTHONPATH

    @property
    def view(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """What its process sees besides the packages: processes with the same view serve each other's episodes."""
        return self.read_only, self.python_path

    @classmethod
    def of(cls, spec: str, params: dict[str, Any]) -> EnvSource:
        """The spec and every string in `params` that names code or a file: a `file.py:attr` reference (the `agent`
        environment's `run`) is made absolute and its folder shown, a module that is not installed is shown with
        the import path that finds it, and an existing file (the `agent` environment's `tasks.jsonl`) is made
        absolute and shown alone. Folders are never shown (a parameter naming the run directory would show it
        all)."""
        seen: list[str] = []
        python_path: list[str] = []
        spec = _reference(spec, seen, python_path)
        params = _walk(params, seen, python_path)
        return cls(spec, params, tuple(dict.fromkeys(seen)), tuple(dict.fromkeys(python_path)))


def _walk(value: Any, seen: list[str], python_path: list[str]) -> Any:
    if isinstance(value, str):
        if value and not value.startswith("-") and ":" not in value and os.path.isfile(value):
            path = os.path.realpath(os.path.expanduser(value))  # a data file the config names: that file alone
            seen.append(path)
            return path
        return _reference(value, seen, python_path)
    if isinstance(value, dict):
        return {k: _walk(v, seen, python_path) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_walk(v, seen, python_path) for v in value)
    return value


def _reference(text: str, seen: list[str], python_path: list[str]) -> str:
    """`text` as the sandboxed process must see it, when it names code (`file.py:attr`, `module:attr`)."""
    target, colon, attr = text.rpartition(":")
    if not colon or not target or not attr.isidentifier():
        return text  # a name (registered by an installed package, an entry point), or not code at all
    if target.endswith(".py"):
        path = Path(target).expanduser().resolve()
        if not path.is_file():
            return text  # the process says it does not exist, as the worker would
        seen.append(str(path.parent))
        return f"{path}:{attr}"
    if not all(part.isidentifier() for part in target.split(".")):
        return text
    try:
        found = importlib.util.find_spec(target.split(".")[0])
    except (ImportError, ValueError):
        return text
    where = None
    if found is not None:
        where = found.submodule_search_locations[0] if found.submodule_search_locations else found.origin
    if where is not None and not _visible(where):
        package = os.path.realpath(where)
        seen.append(package)
        python_path.append(os.path.dirname(package))
    return text


def _visible(path: str) -> bool:
    real = os.path.realpath(path)
    return real.startswith("/usr/") or any(real == root or real.startswith(root + "/") for root in visible_roots())


def runs_sandboxed(spec: str, params: Mapping[str, Any] | None = None) -> bool:
    """Whether environment `spec` (`params`) is code from outside this project, told from its spec alone (nothing is
    imported here): a file (`path.py:Class`), a module of another package (`module:Class`), another package's entry
    point, or one of this project's environments whose `params` name such code (`agent`'s `run: file.py:run`,
    `env_agent`'s `env`). Not names registered in this process (`register_env`: a child could not make them)."""
    spec = spec.strip()
    if not spec or is_registered(spec):
        return False
    return _outside(spec) or any(_outside(text, in_params=True) for text in _strings(params or {}))


def _outside(text: str, *, in_params: bool = False) -> bool:
    target, colon, attr = text.rpartition(":")
    if not colon:
        if in_params:
            return False
        found = [ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP) if ep.name == text]
        return bool(found) and found[0].module.split(".")[0] not in _OURS
    if not target or not attr.isidentifier():
        return False  # not code (an address, a URL)
    if target.endswith(".py") or (not in_params and ("/" in target or "\\" in target)):
        return True  # a file (in a parameter, only `file.py:attr` names code: `org/model:tag` does not)
    top = target.split(".")[0]
    if not all(part.isidentifier() for part in target.split(".")) or top in _OURS:
        return False
    if not in_params:
        return True
    try:  # a parameter only names code where its package exists (finding it runs none of it)
        return importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):
        return False


def _strings(value: Any) -> Iterable[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _strings(v)
