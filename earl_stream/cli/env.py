"""`earl-stream env attach|detach|list`: change the environments of a running system; `env serve`: run
an environment as a server of its own (`earl_stream.env.server`) for `env attach NAME --address`."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import time
from pathlib import Path
from typing import Any

from earl_stream import protocol as P
from earl_stream.cli.flags import add_param_args, params_of
from earl_stream.config import EnvSpec
from earl_stream.errors import EnvError
from earl_stream.files import write_durably
from earl_stream.security.keys import KeyRole, key_for
from earl_stream.security.secret import load_secret


def _print(envs: list[dict[str, Any]]) -> None:
    for e in envs:
        state = "attached" if e["active"] else "detached"
        if e["errors"]:
            state = "FAILED"
        print(f"{e['name']:16s} {state:9s} weight {e['weight']:<5g} episodes {e['episodes']:<7d} "
              f"workers {e['loaded_by_workers']}  group seed {e.get('group_seed', 'auto')}  {e['spec']}")
        for worker, message in e["errors"].items():
            print(f"    {worker}: {message}")


log = logging.getLogger(__name__)


def add_serve_parser(esub: Any) -> argparse.ArgumentParser:
    """`env serve SPEC --bind HOST:PORT [--param K=V] [--params JSON] [--ready-file PATH]` (the caller adds --secret-file)."""
    es = esub.add_parser("serve", help="run an environment as its own server, for `env attach NAME --address`",
                         description="Serves SPEC (a registry name, module:Class or path/to/file.py:Class) over the "
                                     "control plane's framing, guarded by the cluster secret.")
    es.add_argument("spec", metavar="SPEC")
    es.add_argument("--bind", default="127.0.0.1:0", metavar="HOST:PORT", help="where to listen (port 0 = any free port)")
    add_param_args(es, "constructor arguments as one JSON object")
    es.add_argument("--ready-file", metavar="PATH", help="write {address} here once listening")
    return es


def _serve(args: argparse.Namespace) -> int:
    from earl_stream.env.server import EnvServer

    secret = load_secret()
    if secret is None:
        log.warning("no cluster secret: the environment server is open to anyone who reaches %s", args.bind)
    server = EnvServer(args.spec, params_of(args), bind=args.bind, secret=secret)
    if args.ready_file:
        write_durably(Path(args.ready_file), json.dumps({"address": server.address}).encode())  # whole or absent
    print(f"serving {args.spec} at {server.address}", flush=True)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await server.serve(stop)

    asyncio.run(main())
    return 0


def run_env_command(args: argparse.Namespace) -> int:
    if args.env_command == "serve":
        return _serve(args)
    role = KeyRole.READONLY if args.env_command == "list" else KeyRole.OPERATOR
    client = P.ControlClient(args.supervisor, timeout_s=10, secret=key_for(load_secret(), role))
    if args.env_command == "list":
        _print(json.loads(client.call(P.EnvList()).envs_json))
        return 0
    if args.env_command == "detach":
        _print(json.loads(client.call(P.EnvDetach(name=args.name)).envs_json))
        return 0
    spec, name, params = args.spec, args.name, params_of(args)
    if args.address:  # a served environment: SPEC is its name here
        spec, name, params = "remote", args.name or args.spec, {**params, "address": args.address}
    client.call(P.EnvAttach(spec=spec, name=name, weight=args.weight, params=params, group_seed=args.group_seed))
    name = EnvSpec(spec=spec, name=name).display_name
    deadline = time.monotonic() + args.wait
    while args.wait > 0:
        entry = next(e for e in json.loads(client.call(P.EnvList()).envs_json) if e["name"] == name)
        if entry["errors"]:
            _print([entry])
            raise EnvError(f"rollout workers could not load {spec!r}; it gets no prompts (the run goes on)")
        if entry["loaded_by_workers"] > 0:
            _print([entry])
            return 0
        if time.monotonic() > deadline:
            raise EnvError(f"no rollout worker loaded {spec!r} within {args.wait:.0f}s (are workers running?)")
        time.sleep(0.3)
    return 0
