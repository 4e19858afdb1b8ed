"""`earl-stream env attach|detach|list`: change the environments of a running system."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import yaml

from earl_stream import protocol as P
from earl_stream.config import EnvSpec
from earl_stream.errors import ConfigError, EnvError
from earl_stream.security import load_secret


def _params(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--param {item!r} must look like key=value")
        out[key] = yaml.safe_load(value) if value else ""
    return out


def _print(envs: list[dict[str, Any]]) -> None:
    for e in envs:
        state = "attached" if e["active"] else "detached"
        if e["errors"]:
            state = "FAILED"
        print(f"{e['name']:16s} {state:9s} weight {e['weight']:<5g} episodes {e['episodes']:<7d} "
              f"workers {e['loaded_by_workers']}  {e['spec']}")
        for worker, message in e["errors"].items():
            print(f"    {worker}: {message}")


def run_env_command(args: argparse.Namespace) -> int:
    client = P.ControlClient(args.supervisor, timeout_s=10, secret=load_secret())
    if args.env_command == "list":
        _print(json.loads(client.call(P.EnvList()).envs_json))
        return 0
    if args.env_command == "detach":
        _print(json.loads(client.call(P.EnvDetach(name=args.name)).envs_json))
        return 0
    client.call(P.EnvAttach(spec=args.spec, name=args.name, weight=args.weight, params=_params(args.param)))
    name = EnvSpec(spec=args.spec, name=args.name).display_name
    deadline = time.monotonic() + args.wait
    while args.wait > 0:
        entry = next(e for e in json.loads(client.call(P.EnvList()).envs_json) if e["name"] == name)
        if entry["errors"]:
            _print([entry])
            raise EnvError(f"rollout workers could not load {args.spec!r}; it gets no prompts (the run goes on)")
        if entry["loaded_by_workers"] > 0:
            _print([entry])
            return 0
        if time.monotonic() > deadline:
            raise EnvError(f"no rollout worker loaded {args.spec!r} within {args.wait:.0f}s (are workers running?)")
        time.sleep(0.3)
    return 0
