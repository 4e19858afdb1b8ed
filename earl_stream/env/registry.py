"""The environment registry: how a spec string becomes an environment class or factory.

`register_env` / `unregister_env` (in-process names), the entry-point group `earl_stream.envs`, the
built-in names (`_BUILTIN_ENVS`, which also work from an uninstalled source tree), and `resolve_env` /
`make_env`. What an environment *is* (`Environment`, `StepResult`, `env_options`, ...) is
`earl_stream.env.api`'s; running episodes is the agent loop's; concrete games live in the package
`earl_stream_envs` (the envs/ folder).

A spec is one of:
  * a registered name (`register_env`), or a name in the entry-point group `earl_stream.envs`;
  * `package.module:Class`;
  * `path/to/file.py:Class` (the file is imported once per resolved path).

A spec may also name an agent environment (`earl_stream.env.agent`: `task(seed)` and `async run(client,
task)`, played through the rollout worker's OpenAI endpoint) or an environment served by another
process (`remote`, params {address}; see `earl_stream.env.server`).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import logging
import sys
import threading
import time
from pathlib import Path
from typing import Any

from earl_stream.env.api import EnvFactory, Environment, is_agent_env
from earl_stream.errors import EnvError

__all__ = [
    "ENTRY_POINT_GROUP",
    "is_registered",
    "known_envs",
    "make_env",
    "register_env",
    "resolve_env",
    "unregister_env",
]

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "earl_stream.envs"

# Names that must resolve even when the project is run from a source tree without being installed
# (then the entry points of pyproject.toml are not visible to importlib.metadata).
_BUILTIN_ENVS: dict[str, str] = {
    "tictactoe": "earl_stream_envs.tictactoe:TicTacToe",
    "connect_four": "earl_stream_envs.connect_four:ConnectFour",
    "tictactoe_image": "earl_stream_envs.board_images:TicTacToeImage",
    "connect_four_image": "earl_stream_envs.board_images:ConnectFourImage",
    "calculator": "earl_stream_envs.calculator:Calculator",
    "reasoning_gym": "earl_stream_envs.reasoning_gym_env:ReasoningGymEnv",
    "textarena": "earl_stream_envs.textarena_env:TextArenaEnv",
    "long_recall": "earl_stream_envs.long_recall:LongRecall",
    "tictactoe_match": "earl_stream_envs.tictactoe_match:TicTacToeMatch",
    "agent": "earl_stream.env.agent:AgentFunction",
    "env_agent": "earl_stream.env.agent:EnvAsAgent",
    "calculator_agent": "earl_stream_envs.calculator_agent:CalculatorAgent",
    "remote": "earl_stream.env.server:RemoteEnv",
    "gymnasium": "earl_stream_envs.gymnasium_env:GymnasiumEnv",
    "verifiers": "earl_stream_envs.verifiers_env:VerifiersEnv",
    "openenv": "earl_stream_envs.openenv_env:OpenEnvEnv",
}

# Modules of the environment API that moved into the package earl_stream.env: a spec naming the old path is refused
# with the new one.
_MOVED_MODULES: dict[str, str] = {
    "earl_stream.agent_env": "earl_stream.env.agent",
    "earl_stream.env_server": "earl_stream.env.server",
    "earl_stream.tools": "earl_stream.env.tools",
}

_registry: dict[str, EnvFactory] = {}
_registry_lock = threading.Lock()
_file_modules: dict[Path, Any] = {}


def register_env(name: str, factory: EnvFactory) -> None:
    """Register `factory` (a class or a callable returning an Environment) under `name`, in-process.

    Raises EnvError if the name is already registered, is not a plain identifier-like name, or if
    `factory` is not callable.
    """
    if not name or ":" in name or name.strip() != name:
        raise EnvError(f"invalid environment name {name!r}: use a non-empty name without ':' or spaces")
    if not callable(factory):
        raise EnvError(f"environment factory for {name!r} must be callable, got {type(factory).__name__}")
    with _registry_lock:
        if name in _registry:
            raise EnvError(f"environment {name!r} is already registered ({_registry[name]!r})")
        _registry[name] = factory


def unregister_env(name: str) -> None:
    """Remove an in-process registration (EnvError if `name` was not registered with register_env)."""
    with _registry_lock:
        if _registry.pop(name, None) is None:
            raise EnvError(f"environment {name!r} is not registered in this process")


def is_registered(name: str) -> bool:
    """Whether `name` is registered in this process (`register_env`); imports nothing."""
    with _registry_lock:
        return name.strip() in _registry


_ENTRY_POINTS_TTL_S = 10.0
_entry_points_cache: tuple[float, dict[str, importlib.metadata.EntryPoint]] = (-_ENTRY_POINTS_TTL_S, {})


def _entry_points(refresh: bool = False) -> dict[str, importlib.metadata.EntryPoint]:
    """The group's entry points, re-read at most every 10 s unless `refresh`: scanning the installed
    distributions takes ~10 ms, and a worker builds environments for every episode."""
    global _entry_points_cache
    read_at, found = _entry_points_cache
    if refresh or time.monotonic() - read_at > _ENTRY_POINTS_TTL_S:
        found = {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}
        _entry_points_cache = (time.monotonic(), found)
    return found


def known_envs() -> list[str]:
    """Every name `resolve_env` accepts without a ':' (registered, entry points, built-ins), sorted."""
    with _registry_lock:
        names = set(_registry)
    names.update(_entry_points(refresh=True))
    names.update(_BUILTIN_ENVS)
    return sorted(names)


def resolve_env(spec: str) -> EnvFactory:
    """Turn a spec (see the module docstring) into the environment class or factory it names.

    Lookup order for a plain name: in-process registry, entry points, built-ins. Raises EnvError
    with the known names for an unknown name, and with the cause for an import failure.
    """
    spec = spec.strip()
    if not spec:
        raise EnvError(f"empty environment spec; known environments: {', '.join(known_envs())}")
    with _registry_lock:
        registered = _registry.get(spec)
    if registered is not None:
        return registered
    if ":" not in spec:
        return _resolve_name(spec)
    target, _, attr = spec.rpartition(":")
    if not target or not attr:
        raise EnvError(f"environment spec {spec!r} must look like 'module:Class' or 'file.py:Class'")
    if target.endswith(".py") or "/" in target or "\\" in target:
        module = _load_file(Path(target))
    else:
        module = _import_module(target, spec)
    return _get_factory(module, attr, spec)


def _resolve_name(name: str) -> EnvFactory:
    ep = _entry_points().get(name)
    if ep is None and name not in _BUILTIN_ENVS:  # installed since the last read?
        ep = _entry_points(refresh=True).get(name)
    if ep is not None:
        try:
            if ep.value.startswith("earl_stream_envs."):
                _source_tree_envs()
            factory = ep.load()
        except Exception as exc:
            raise EnvError(
                f"environment {name!r} (entry point {ep.value}) failed to import: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        return _check_factory(factory, f"entry point {name}={ep.value}")
    builtin = _BUILTIN_ENVS.get(name)
    if builtin is None:
        raise EnvError(f"unknown environment {name!r}; known environments: {', '.join(known_envs())}")
    module_name, _, attr = builtin.partition(":")
    try:
        if module_name.startswith("earl_stream_envs."):
            _source_tree_envs()
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise EnvError(f"built-in environment {name!r} failed to import: {exc}; install the project "
                       "(pip install -e .)") from exc
    return _get_factory(module, attr, builtin)


def _source_tree_envs() -> bool:
    """An uninstalled checkout run with only its root on sys.path: the envs/ folder beside earl_stream/ is the
    package `earl_stream_envs` (what the install maps it to). Registers it; False when there is no such folder."""
    if "earl_stream_envs" in sys.modules or importlib.util.find_spec("earl_stream_envs") is not None:
        return True
    folder = Path(__file__).resolve().parents[2] / "envs"
    if not (folder / "__init__.py").is_file():
        return False
    spec = importlib.util.spec_from_file_location("earl_stream_envs", folder / "__init__.py",
                                                  submodule_search_locations=[str(folder)])
    if spec is None or spec.loader is None:
        return False
    module = importlib.util.module_from_spec(spec)
    sys.modules["earl_stream_envs"] = module
    spec.loader.exec_module(module)
    return True


def _import_module(module_name: str, spec: str) -> Any:
    moved = _MOVED_MODULES.get(module_name)
    if moved is not None:
        raise EnvError(f"environment spec {spec!r}: module {module_name} is {moved} since 0.2.0: "
                       f"use {spec.replace(module_name, moved, 1)!r}")
    try:
        if module_name.split(".")[0] == "earl_stream_envs":
            _source_tree_envs()
        return importlib.import_module(module_name)
    except Exception as exc:
        if module_name.split(".")[0] == "envs" and isinstance(exc, ModuleNotFoundError):
            raise EnvError(f"environment spec {spec!r}: the built-in environments are the package earl_stream_envs "
                           f"since 0.2.0: use {spec.replace('envs.', 'earl_stream_envs.', 1)!r}") from exc
        raise EnvError(
            f"environment spec {spec!r}: cannot import module {module_name!r}: {type(exc).__name__}: {exc}"
        ) from exc


def _load_file(path: Path) -> Any:
    resolved = path.expanduser().resolve()
    with _registry_lock:
        cached = _file_modules.get(resolved)
    if cached is not None:
        return cached
    if not resolved.is_file():
        raise EnvError(f"environment file {path} does not exist")
    digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:12]
    module_name = f"earl_stream_envfile_{resolved.stem}_{digest}"
    module_spec = importlib.util.spec_from_file_location(module_name, resolved)
    if module_spec is None or module_spec.loader is None:
        raise EnvError(f"environment file {path} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    # Registered before exec so that dataclasses/pickling inside the file can find their module.
    sys.modules[module_name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(module_name, None)
        raise EnvError(f"environment file {path} failed to import: {type(exc).__name__}: {exc}") from exc
    with _registry_lock:
        module = _file_modules.setdefault(resolved, module)
    logger.debug("loaded environment file %s as %s", resolved, module_name)
    return module


def _get_factory(module: Any, attr: str, spec: str) -> EnvFactory:
    try:
        factory = getattr(module, attr)
    except AttributeError:
        raise EnvError(f"environment spec {spec!r}: {module.__name__} has no attribute {attr!r}") from None
    return _check_factory(factory, spec)


def _check_factory(factory: Any, where: str) -> EnvFactory:
    if not callable(factory):
        raise EnvError(f"{where} is {type(factory).__name__}, not a class or factory")
    if inspect.isclass(factory) and not (all(callable(getattr(factory, m, None)) for m in ("reset", "step"))
                                         or is_agent_env(factory)):
        raise EnvError(f"{where}: class {factory.__name__} lacks reset() and step() (or task() and run() of an "
                       "agent environment); it is not an Environment")
    return factory


def make_env(spec: str, params: dict[str, Any] | None = None) -> Environment:
    """Resolve `spec` and instantiate it with `params` as keyword arguments.

    Raises EnvError if the spec does not resolve, the constructor rejects the params, or the result
    lacks reset()/step().
    """
    factory = resolve_env(spec)
    kwargs = dict(params or {})
    try:
        env = factory(**kwargs)
    except EnvError:
        raise
    except Exception as exc:
        raise EnvError(
            f"environment {spec!r} could not be created with params {sorted(kwargs)}: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(env, Environment) and not is_agent_env(env):
        raise EnvError(f"environment {spec!r} built a {type(env).__name__}, which lacks reset()/step() "
                       "(or task()/run() of an agent environment)")
    return env
