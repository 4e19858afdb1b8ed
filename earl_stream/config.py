"""Typed, frozen configuration of a run: one dataclass per subsystem, loaded from YAML plus dotted
overrides (`trainer.lr=3e-4`), validated once, every problem reported in one `ConfigError`.

The supervisor owns the effective config of a run and hands it to every worker that registers, so a
worker started on another host needs nothing but the supervisor's address.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from earl_stream.errors import ConfigError


def _f(default: Any, help: str, *, choices: tuple[Any, ...] = (), minimum: float | None = None) -> Any:
    """A config field with its one-line help and its validation rule."""
    meta = {"help": help, "choices": choices, "min": minimum}
    if isinstance(default, (list, dict, tuple)) and not isinstance(default, tuple):
        return dataclasses.field(default_factory=lambda: default, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    path: str = _f("", "directory of a Hugging Face causal LM + tokenizer; empty = the embedded tiny model")
    warm_start_steps: int = _f(450, "supervised warm-start steps of the embedded model (built once)", minimum=0)
    warm_start_seconds: float = _f(900.0, "upper bound on the warm start's wall time", minimum=0)


@dataclasses.dataclass(frozen=True)
class EnvSpec:
    spec: str = _f("tictactoe", "entry-point name, module:Class or path/to/file.py:Class")
    name: str = _f("", "name shown in metrics and status; empty = spec")
    weight: float = _f(1.0, "relative share of prompts sampled from this environment", minimum=0)
    params: dict[str, Any] = _f({}, "keyword arguments for the environment's constructor")

    @property
    def display_name(self) -> str:
        return self.name or self.spec.rsplit(":", 1)[-1].lower()


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    workers: int = _f(2, "rollout worker processes started by `up`", minimum=0)
    engine: str = _f("torch", "inference engine backend", choices=("torch", "vllm", "sglang"))
    groups_in_flight: int = _f(8, "prompt groups each worker plays concurrently", minimum=1)
    max_batch_size: int = _f(64, "sequences per engine forward pass", minimum=1)
    temperature: float = _f(1.0, "sampling temperature", minimum=0)
    top_p: float = _f(1.0, "nucleus sampling threshold", minimum=0)
    top_k: int = _f(0, "top-k sampling (0 = off)", minimum=0)
    threads: int = _f(1, "torch threads per rollout worker", minimum=1)
    cpus: str = _f("", "CPU ids each rollout worker is pinned to, e.g. '0' or '0,2-3' (torch threads = their "
                   "count); empty = no pinning")


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
    nproc: int = _f(1, "trainer ranks (torch.distributed, gloo on CPU)", minimum=1)
    lr: float = _f(5e-4, "AdamW learning rate", minimum=0)
    weight_decay: float = _f(0.0, "AdamW weight decay", minimum=0)
    groups_per_step: int = _f(8, "prompt groups per training step", minimum=1)
    group_size: int = _f(8, "episodes per prompt group (GRPO)", minimum=2)
    max_staleness: int = _f(1, "refuse samples older than this many policy versions", minimum=0)
    clip_eps: float = _f(0.2, "PPO clip range of the importance ratio", minimum=0)
    tis_cap: float = _f(2.0, "truncated importance weight cap C: each token's policy gradient is weighted by "
                        "min(exp(trainer - engine log-prob), C) (off-policy correction); 0 = off", minimum=0)
    kl_coef: float = _f(0.0, "weight of the KL penalty to the initial (reference) policy", minimum=0)
    # 0.01 with lr 5e-4: Tic-Tac-Toe win rate holds ~0.9 instead of collapsing (bench/results/learning.json)
    entropy_coef: float = _f(0.01, "weight of the entropy bonus (keeps GRPO groups from collapsing to one "
                             "answer, which zeroes their advantages)", minimum=0)
    grad_clip: float = _f(1.0, "max global gradient norm (0 = off)", minimum=0)
    micro_batch_tokens: int = _f(8192, "token budget of one micro-batch", minimum=1)
    threads: int = _f(1, "torch threads per trainer rank", minimum=1)
    cpus: str = _f("", "CPU ids each trainer rank is pinned to, e.g. '1' or '0-1' (torch threads = their count); "
                   "empty = no pinning")
    checkpoint_every: int = _f(100, "write a checkpoint every this many steps (and at the end)", minimum=1)
    claim_timeout_s: float = _f(600.0, "give up waiting for a step's samples after this long", minimum=1)


@dataclasses.dataclass(frozen=True)
class StoreConfig:
    dispatch: str = _f("pull", "pull: consumers pull from producers; central: via one process", choices=("pull", "central"))
    max_bytes_per_node: int = _f(1 << 30, "bytes a shard node holds before producers block", minimum=1 << 20)
    transport: str = _f("auto", "data-plane transport per peer: auto = shared memory on one host, else UCX when "
                        "both sides have ucxx, else TCP", choices=("auto", "shm", "ucx", "tcp"))


@dataclasses.dataclass(frozen=True)
class SupervisorConfig:
    heartbeat_s: float = _f(1.0, "worker heartbeat period", minimum=0.05)
    lease_s: float = _f(10.0, "a worker silent this long is declared dead", minimum=0.1)
    stats_window: int = _f(512, "episodes in the sliding window of reward/length statistics", minimum=1)


@dataclasses.dataclass(frozen=True)
class SelectorConfig:
    enabled: bool = _f(True, "reselect pool plans from observed context-length percentiles")
    context_window: int = _f(512, "episodes in the sliding window of context-length percentiles", minimum=16)
    percentile: str = _f("p99", "statistic that drives re-plans", choices=("p50", "p90", "p99", "max"))
    upper_factor: float = _f(0.9, "re-plan up when the percentile exceeds this x the plan's design length", minimum=0)
    lower_factor: float = _f(0.4, "re-plan down when the percentile falls below this x the design length", minimum=0)
    headroom: float = _f(1.25, "a new plan's design length is the next power of two >= headroom x percentile", minimum=1)
    min_episodes_between: int = _f(64, "episodes between re-plans (a percentile past the design length skips it)",
                                   minimum=0)
    initial_seq_len: int = _f(256, "design length of the plan adopted before any episode finishes", minimum=16)
    trainer_memory_bytes: int = _f(0, "per-rank memory budget; 0 = this machine's RAM / 4", minimum=0)
    reserve_bytes: int = _f(1 << 30, "memory kept free for what the model does not count (runtime, allocator)",
                            minimum=0)
    cost_model_path: str = _f("", "JSON of a step cost-model calibration to start from (StepCostModel.to_dict(), "
                              "or a file with it under \"cost_model\" like bench/results/selector.json); empty = defaults")
    cost_model_min_steps: int = _f(8, "refit the cost model from the trainer's measured step times after this many "
                                   "steps, and as often again after that; 0 = never", minimum=0)
    cost_model_window: int = _f(64, "most recent measured training steps the cost model is refit on", minimum=2)


@dataclasses.dataclass(frozen=True)
class RunConfig:
    steps: int = _f(0, "training steps; 0 = run until stopped", minimum=0)
    seed: int = _f(0, "seed of prompts, sampling and initialisation")
    run_dir: str = _f("runs/latest", "where checkpoints, logs and summaries go")
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    envs: tuple[EnvSpec, ...] = dataclasses.field(default_factory=lambda: (EnvSpec(),))
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    trainer: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)
    store: StoreConfig = dataclasses.field(default_factory=StoreConfig)
    supervisor: SupervisorConfig = dataclasses.field(default_factory=SupervisorConfig)
    selector: SelectorConfig = dataclasses.field(default_factory=SelectorConfig)


def parse_cpus(text: str) -> list[int]:
    """CPU ids from '0', '0,1' or '0-3,6' (a `cpus` field); [] for ''. Raises ConfigError."""
    out: list[int] = []
    for part in filter(None, (p.strip() for p in str(text).split(","))):
        lo, _, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi or lo)
        except ValueError:
            raise ConfigError(f"cpus: {part!r} is not a CPU id or a range like 0-3") from None
        if first < 0 or last < first:
            raise ConfigError(f"cpus: {part!r} is not a valid CPU range")
        out.extend(range(first, last + 1))
    return sorted(set(out))


# ---------------------------------------------------------------------------------------------------
# Loading


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
        _apply_override(raw, item, errors)
    cfg = _build(RunConfig, raw, "", errors)
    if errors:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(errors))
    return cfg


def config_from_dict(raw: dict[str, Any]) -> RunConfig:
    errors: list[str] = []
    cfg = _build(RunConfig, raw, "", errors)
    if errors:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(errors))
    return cfg


def config_to_dict(cfg: Any) -> Any:
    if dataclasses.is_dataclass(cfg):
        return {f.name: config_to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, tuple):
        return [config_to_dict(v) for v in cfg]
    return cfg


def config_to_json(cfg: RunConfig) -> str:
    return json.dumps(config_to_dict(cfg), sort_keys=True)


def config_to_yaml(cfg: RunConfig) -> str:
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False)


def replace(cfg: RunConfig, *overrides: str) -> RunConfig:
    """A copy of `cfg` with dotted overrides applied (validated like a load)."""
    raw = config_to_dict(cfg)
    errors: list[str] = []
    for item in overrides:
        _apply_override(raw, item, errors)
    if errors:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(errors))
    return config_from_dict(raw)


def field_help(cls: type = RunConfig, prefix: str = "") -> list[tuple[str, str]]:
    """(dotted name, help) for every leaf field, for `config show --help-fields`."""
    out: list[tuple[str, str]] = []
    for f in dataclasses.fields(cls):
        name = prefix + f.name
        hint = typing.get_type_hints(cls)[f.name]
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            out.extend(field_help(hint, name + "."))
        elif typing.get_origin(hint) is tuple:
            out.extend(field_help(typing.get_args(hint)[0], name + ".N."))
        else:
            out.append((name, f.metadata.get("help", "")))
    return out


def _apply_override(raw: dict[str, Any], item: str, errors: list[str]) -> None:
    if "=" not in item:
        errors.append(f"override {item!r} must look like section.field=value")
        return
    key, _, text = item.partition("=")
    try:
        value = yaml.safe_load(text) if text else ""
    except yaml.YAMLError:
        value = text
    node: Any = raw
    parts = key.strip().split(".")
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if isinstance(node, list):
            if not part.isdigit() or int(part) > len(node):
                errors.append(f"{key}: {part!r} is not an index of a list of {len(node)}")
                return
            idx = int(part)
            if idx == len(node):
                node.append({})
            if last:
                node[idx] = value
            else:
                node = node[idx]
            continue
        if not isinstance(node, dict):
            errors.append(f"{key}: {'.'.join(parts[:i])} is not a section")
            return
        if last:
            node[part] = value
        else:
            if part == "envs" and part not in node:
                node[part] = [config_to_dict(EnvSpec())]
            node = node.setdefault(part, {})


def _build(cls: type, raw: Any, prefix: str, errors: list[str]) -> Any:
    if not isinstance(raw, dict):
        errors.append(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {raw!r}")
        return cls()
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in names:
            errors.append(f"{prefix}{key}: unknown field; allowed: {', '.join(sorted(names))}")
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name not in raw:
            continue
        kwargs[f.name] = _convert(hints[f.name], raw[f.name], prefix + f.name, f.metadata, errors)
    try:
        return cls(**kwargs)
    except TypeError as exc:
        errors.append(f"{prefix.rstrip('.') or 'config'}: {exc}")
        return cls()


def _convert(hint: Any, value: Any, name: str, meta: Any, errors: list[str]) -> Any:
    origin = typing.get_origin(hint)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _build(hint, value, name + ".", errors)
    if origin is tuple:
        item_cls = typing.get_args(hint)[0]
        if not isinstance(value, list) or not value:
            errors.append(f"{name}: expected a non-empty list")
            return ()
        return tuple(_build(item_cls, v, f"{name}.{i}.", errors) for i, v in enumerate(value))
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            errors.append(f"{name}: expected a mapping, got {value!r}")
            return {}
        return dict(value)
    if origin in (typing.Union, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if hint in (int, float) and isinstance(value, str):
        try:  # YAML 1.1 reads "3e-4" as a string
            value = hint(value)
        except ValueError:
            pass
    ok = isinstance(value, hint) and (hint is bool or not isinstance(value, bool))
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        value, ok = float(value), True
    if hint is str and value is None:
        value, ok = "", True
    if name.endswith(".cpus") and isinstance(value, (int, list)) and not isinstance(value, bool):
        value, ok = ",".join(str(v) for v in (value if isinstance(value, list) else [value])), True  # `cpus=1`, `[0,1]`
    if name.endswith(".cpus") and isinstance(value, str):
        try:
            parse_cpus(value)
        except ConfigError as exc:
            errors.append(f"{name}: {str(exc).partition(': ')[2]}")
    if not ok:
        errors.append(f"{name}: expected {hint.__name__}, got {value!r}")
        return None
    choices, minimum = meta.get("choices") or (), meta.get("min")
    if choices and value not in choices:
        errors.append(f"{name}: {value!r} is not allowed; choose one of {', '.join(map(str, choices))}")
    if minimum is not None and value < minimum:
        errors.append(f"{name}: {value!r} is below the minimum {minimum}")
    return value
