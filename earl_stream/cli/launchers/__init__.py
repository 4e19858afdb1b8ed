"""Launchers: how `earl-stream up` places the processes of a run. One plug-in kind, one Protocol.

A launcher only places processes and hands them what they need to join the run: the supervisor's
address, the cluster secret and, for trainer ranks, the torch.distributed rank environment (RANK,
LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Every process runs the same
entry point under every launcher (`earl-stream supervisor`, `earl-stream worker --role ...`) and
never depends on how it was started; the run's state, the live view and the summary stay in
`cli/up.py`, which drives any launcher the same way:

    launcher = make_launcher(run)                     # run: RunSpec (config, secret, bind, resume, restart)
    sup, address = launcher.start_supervisor()        # waits, with a timeout, until it listens
    workers = [launcher.start_rollout_worker(i, address) for i in range(cfg.rollout.workers)]
    trainer = launcher.start_trainer_pool(address)    # every rank; poll() is 0 once all ranks finished
    ... poll() every process; a dead one: launcher.revive(it, address) or stop with its describe_exit()
    launcher.stop()                                   # always: the trainer, rollout workers, supervisor

Built in: `local` (child processes of `up`, cli/launchers/local.py), `ray` (actors on a Ray cluster,
trainer ranks in a placement group, cli/launchers/ray.py) and `slurm` (cli/launchers/slurm.py: a
placeholder until `earl-stream slurm render|submit` gains a launcher body). Others register with
`register_launcher(name, factory)`, through the `earl_stream.launchers` entry point group, or are named
as `module:Name` in `launcher.kind`. A factory is called with the RunSpec and returns a Launcher.
Contract test: tests/cli/test_launcher_contract.py runs every implementation that can run here.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, runtime_checkable

from earl_stream.config import RunConfig
from earl_stream.errors import ConfigError
from earl_stream.security.encryption import ENCRYPT_ENV

ENTRY_POINT_GROUP = "earl_stream.launchers"
_BUILTIN = {"local": "earl_stream.cli.launchers.local:LocalLauncher",
            "ray": "earl_stream.cli.launchers.ray:RayLauncher",
            "slurm": "earl_stream.cli.launchers.slurm:SlurmLauncher"}


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """What `up` hands a launcher: everything it needs to place a run's processes."""

    cfg: RunConfig
    config_file: Path  # the run's effective config (YAML), written by `up` in run_dir on this host
    secret_file: Path  # the cluster secret on this host: the supervisor's only (a launcher copies it where that runs)
    bind: str = "127.0.0.1:0"  # the supervisor's HOST:PORT as asked for (port 0 = any free one)
    resume: bool = False  # every process of an earlier `up` of this run_dir is gone: don't wait for them
    restart: int = 0  # times a dead trainer pool (from its checkpoint), rollout worker or supervisor restarts

    def worker_key_file(self) -> Path:
        """What every worker gets instead of the secret: the worker key at the run's current generation in
        RUN_DIR/keys/worker (`up` writes it, a launcher used without `up` here; the supervisor rewrites it on
        `keys revoke worker`: security/keys.py)."""
        from earl_stream.security.keys import WORKER_KEY_FILE
        from earl_stream.security.secret import load_secret
        from earl_stream.supervisor.revocation import write_worker_key

        path = Path(self.cfg.run_dir) / WORKER_KEY_FILE
        secret = load_secret(str(self.secret_file))
        if not path.is_file() and secret is not None:
            write_worker_key(Path(self.cfg.run_dir), secret)
        return path

    def encrypt_env(self) -> dict[str, str]:
        """In every process's environment: whether it encrypts its planes (security.encrypt) and serves its HTTP
        endpoints over TLS with which files (earl_stream/security/tls.py), since a worker connects and starts its metrics
        endpoint before it has the run's config."""
        from earl_stream.security.tls import tls_env

        return {ENCRYPT_ENV: "1" if self.cfg.security.encrypt else "0", **tls_env(self.cfg.security)}


@runtime_checkable
class Placed(Protocol):
    """One placed process, or the trainer pool (all its ranks)."""

    name: str

    def poll(self) -> int | None:
        """Its exit code; None while it runs (or while its launcher restarts it). A pool: 0 once every
        rank finished, the code of the first failed rank otherwise."""
        ...

    def describe_exit(self) -> str:
        """One line for an error: what it was, how it ended, where its log is (and its last lines)."""
        ...


@runtime_checkable
class Launcher(Protocol):
    """Places the processes of one run. Every wait is bounded and fails with what it waited for."""

    def start_supervisor(self) -> tuple[Placed, str]:
        """Start the supervisor and return it with its address (tcp://HOST:PORT) once it listens."""
        ...

    def start_rollout_worker(self, index: int, address: str) -> Placed:
        """Start rollout worker `index` against the supervisor at `address`."""
        ...

    def start_trainer_pool(self, address: str) -> Placed:
        """Start cfg.trainer.nproc trainer ranks forming one torch.distributed group."""
        ...

    def revive(self, placed: Placed, address: str) -> None:
        """Start a dead process again in its place: the supervisor on the same address (from its state)."""
        ...

    def stop(self) -> None:
        """Stop everything this launcher started: the trainer pool first, given trainer.stop_grace_s to finish
        its step and checkpoint it, then the rollout workers, then the supervisor; safe to call twice."""
        ...


LauncherFactory = Callable[[RunSpec], Launcher]
_registry: dict[str, LauncherFactory] = {}


def register_launcher(name: str, factory: LauncherFactory) -> None:
    """Register a launcher under `name` in this process (ConfigError for a duplicate or a bad name)."""
    if not name or ":" in name or name.strip() != name:
        raise ConfigError(f"invalid launcher name {name!r}: use a non-empty name without ':' or spaces")
    if name in _registry or name in _BUILTIN:
        raise ConfigError(f"launcher {name!r} is already registered")
    _registry[name] = factory


def unregister_launcher(name: str) -> None:
    if _registry.pop(name, None) is None:
        raise ConfigError(f"launcher {name!r} is not registered in this process")


def known_launchers() -> list[str]:
    names = set(_BUILTIN) | set(_registry)
    names.update(ep.name for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))
    return sorted(names)


def resolve_launcher(kind: str) -> LauncherFactory:
    """The factory `launcher.kind` names: a registered name, an entry point, a built-in, or module:Name."""
    if kind in _registry:
        return _registry[kind]
    target = _BUILTIN.get(kind)
    if target is None and ":" not in kind:
        ep = next((e for e in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP) if e.name == kind), None)
        if ep is None:
            raise ConfigError(f"unknown launcher {kind!r} (launcher.kind, up --launcher); known launchers: "
                              f"{', '.join(known_launchers())}, or module:Name")
        target = ep.value
    module_name, _, attr = (target or kind).partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"launcher {kind!r} ({target or kind}) failed to load: {type(exc).__name__}: {exc}") from exc
    if not callable(factory):
        raise ConfigError(f"launcher {kind!r} ({target or kind}) is not callable")
    return factory


def make_launcher(run: RunSpec) -> Launcher:
    return resolve_launcher(run.cfg.launcher.kind)(run)
