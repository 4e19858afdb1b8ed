"""Loading a run's config: defaults < YAML file < dotted overrides (`trainer.lr=3e-4`), built into the
frozen `RunConfig`, validated once (every field's rule, then `validate`'s cross-field rules), every
problem reported in one `ConfigError`; and back, to a dict, JSON or YAML. The supervisor hands the
effective config of a run to every worker that registers as that dict.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path
from typing import Any

import yaml

from earl_stream.config.fields import apply_override, build
from earl_stream.config.fields import field_help as _field_help
from earl_stream.config.fields import to_dict as config_to_dict
from earl_stream.config.rollout import EnvSpec
from earl_stream.config.run import RunConfig
from earl_stream.config.validate import cross_field_problems
from earl_stream.errors import ConfigError

# Keys that moved to another section: named in the error rather than silently dropped.
_MOVED = {f"trainer.{k}": f"algo.{k}" for k in ("tis_cap", "kl_coef", "entropy_coef", "grad_clip")}
_MOVED["trainer.clip_eps"] = "algo.clip_eps_low and algo.clip_eps_high"
_LIST_DEFAULTS = {"envs": lambda: [config_to_dict(EnvSpec())]}  # `envs.0.spec=X` edits the default environment


def load_config(path: str | Path | None = None, overrides: typing.Sequence[str] = ()) -> RunConfig:
    """Build the effective config: defaults < YAML file < dotted overrides. Raises ConfigError."""
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {p} is not valid YAML: {exc}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {p} must hold a mapping at the top level, got {type(loaded).__name__}")
        raw = loaded or {}
    errors: list[str] = []
    for item in overrides:
        apply_run_override(raw, item, errors)
    return _checked(build(RunConfig, raw, "", errors, _MOVED), errors)


def _checked(cfg: RunConfig, errors: list[str]) -> RunConfig:
    """`cfg` with the fields left to `auto` resolved, once every problem is known (ConfigError when any)."""
    errors.extend(cross_field_problems(cfg))
    if errors:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(errors))
    return resolve_auto(cfg)


def resolve_auto(cfg: RunConfig) -> RunConfig:
    """The fields whose default depends on the rest of the config, resolved: `security.encrypt` unset (or
    `auto`) is on when the launcher places processes on other hosts (any launcher but local) and off for a
    local run, which keeps the fast path (shared memory, UCX, plain HTTP)."""
    if cfg.security.encrypt is None:
        encrypt = cfg.launcher.kind != "local"
        if encrypt and cfg.store.transport == "ucx":
            raise ConfigError(f"invalid configuration:\n  store.transport=ucx sends unencrypted bytes, and launcher "
                              f"{cfg.launcher.kind} encrypts by default (security.encrypt=auto, the pools span hosts): "
                              "set security.encrypt=false to use UCX between hosts, or store.transport=auto")
        cfg = dataclasses.replace(cfg, security=dataclasses.replace(cfg.security, encrypt=encrypt))
    return cfg


def config_from_dict(raw: dict[str, Any]) -> RunConfig:
    errors: list[str] = []
    return _checked(build(RunConfig, raw, "", errors, _MOVED), errors)


def field_help(cls: type = RunConfig, prefix: str = "") -> list[tuple[str, str]]:
    """(dotted name, help) for every leaf field, for `config show --fields`."""
    return _field_help(cls, prefix)


def config_to_json(cfg: RunConfig) -> str:
    return json.dumps(config_to_dict(cfg), sort_keys=True)


def config_to_yaml(cfg: RunConfig) -> str:
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False)


def replace(cfg: RunConfig, *overrides: str) -> RunConfig:
    """A copy of `cfg` with dotted overrides applied (validated like a load)."""
    raw = config_to_dict(cfg)
    errors: list[str] = []
    for item in overrides:
        apply_run_override(raw, item, errors)
    if errors:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(errors))
    return config_from_dict(raw)


def apply_run_override(raw: dict[str, Any], item: str, errors: list[str]) -> None:
    """One dotted override (`trainer.lr=3e-4`) of a run's raw config; `envs.0.spec=X` edits the default
    environment when `raw` names none."""
    apply_override(raw, item, errors, _LIST_DEFAULTS)
