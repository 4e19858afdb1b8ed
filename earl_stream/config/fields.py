"""How the config dataclasses are declared and built: a field with its help and validation rule
(`field`), raw YAML (plus dotted overrides, `apply_override`) turned into frozen dataclasses with every
problem collected (`build`), and back (`to_dict`, `field_help`). What the fields are is the sections'
(`training.py`, `rollout.py`, `cluster.py`: the run), `cli/slurm.py`'s (the `slurm:` section of `slurm render|submit`).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

import yaml

from earl_stream.errors import ConfigError


def field(default: Any, help: str, *, choices: tuple[Any, ...] = (), minimum: float | None = None) -> Any:
    """A config field with its one-line help and its validation rule."""
    meta = {"help": help, "choices": choices, "min": minimum}
    if isinstance(default, (list, dict, tuple)) and not isinstance(default, tuple):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


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


def to_dict(cfg: Any) -> Any:
    """A config dataclass as plain dicts and lists (tuples become lists)."""
    if dataclasses.is_dataclass(cfg):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, tuple):
        return [to_dict(v) for v in cfg]
    return cfg


def field_help(cls: type, prefix: str = "") -> list[tuple[str, str]]:
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


def apply_override(raw: dict[str, Any], item: str, errors: list[str],
                   list_defaults: Mapping[str, Callable[[], Any]] | None = None) -> None:
    """Set the dotted `item` (`section.field=value`, list items by index) in `raw`; problems go to `errors`.
    A list section missing from `raw` starts from `list_defaults[name]()` (e.g. the default environment)."""
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
            if list_defaults and part in list_defaults and part not in node:
                node[part] = list_defaults[part]()
            node = node.setdefault(part, {})


def build(cls: type, raw: Any, prefix: str, errors: list[str], moved: Mapping[str, str] | None = None) -> Any:
    """An instance of dataclass `cls` from `raw`, every field converted and checked; problems go to `errors`.
    `moved`: dotted names of fields that moved, with their new place (named in the error)."""
    moved = moved or {}
    if not isinstance(raw, dict):
        errors.append(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {raw!r}")
        return cls()
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in raw:
        if f"{prefix}{key}" in moved:
            errors.append(f"{prefix}{key}: moved to {moved[prefix + key]}")
        elif key not in names:
            errors.append(f"{prefix}{key}: unknown field; allowed: {', '.join(sorted(names))}")
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name not in raw:
            continue
        kwargs[f.name] = _convert(hints[f.name], raw[f.name], prefix + f.name, f.metadata, errors, moved)
    try:
        return cls(**kwargs)
    except TypeError as exc:
        errors.append(f"{prefix.rstrip('.') or 'config'}: {exc}")
        return cls()


def _convert(hint: Any, value: Any, name: str, meta: Any, errors: list[str], moved: Mapping[str, str]) -> Any:
    origin = typing.get_origin(hint)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return build(hint, value, name + ".", errors, moved)
    if origin is tuple:
        item_cls = typing.get_args(hint)[0]
        if not isinstance(value, list) or not value:
            errors.append(f"{name}: expected a non-empty list")
            return ()
        return tuple(build(item_cls, v, f"{name}.{i}.", errors, moved) for i, v in enumerate(value))
    if origin is list:
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            errors.append(f"{name}: expected a list of non-empty strings, got {value!r}")
            return []
        return list(value)
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            errors.append(f"{name}: expected a mapping, got {value!r}")
            return {}
        return dict(value)
    if origin in (typing.Union, types.UnionType):
        if value is None or value == "auto":  # an optional field left to its resolution (`auto`)
            return None
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
