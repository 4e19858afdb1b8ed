"""`earl-stream keys show|derive ROLE|revoke ROLE|WORKER_ID`: the scoped keys derived from a run's cluster secret
(earl_stream/security/keys.py).

`show` lists every role's key and what it allows; `derive ROLE` prints one (or writes it to a file only this
user can read), for a worker, a dashboard, an operator or an agent program that should not hold the cluster
secret; both derive the current generation of the run whose RUN_DIR/keys/revoked.json they find. `revoke`
asks the supervisor (operator key or secret) to revoke a role's key or one worker id. The secret is found as
every command finds it (`--secret-file`, $EARL_STREAM_SECRET_FILE, or the run in this directory whose ready
file names `--supervisor`).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from earl_stream import protocol as P
from earl_stream.cli.local_run import RUN_DIR_HELP
from earl_stream.errors import ConfigError
from earl_stream.security.keys import ROLE_KEYS, KeyRole, agent_key, key_for, role_of, role_token, write_key_file
from earl_stream.security.secret import SECRET_ENV, load_secret
from earl_stream.supervisor.revocation import generations_in

WHAT = {
    KeyRole.WORKER: "what rollout workers and trainer ranks need: their control messages, the data plane, "
                    "environment servers, agent keys (never scale, env attach|detach, stop or keys revoke)",
    KeyRole.OPERATOR: "scale, env attach|detach, stopping the run, keys revoke; and what the read-only key may do",
    KeyRole.READONLY: "status, env list, episodes tail|export (metadata), metrics scraping (the bearer token)",
    KeyRole.AGENT: "one episode's requests to the OpenAI endpoint until it expires (keys derive agent --episode ID)",
}
ROLE_CHOICES = [r.value for r in ROLE_KEYS] + [KeyRole.AGENT.value]


def add_parser(sub: Any, add_secret_arg: Any) -> None:
    p = sub.add_parser("keys", help="print the scoped keys derived from the cluster secret; revoke one",
                       description="Keys derived from the run's cluster secret, each allowing only its role: worker, "
                                   "operator, readonly (status, episodes, metrics) and agent (one episode's requests "
                                   "to the OpenAI endpoint). Give a role key to a command with --secret-file: it "
                                   "signs with it, and the supervisor refuses what that role may not do. `keys revoke` "
                                   "retires a role's key or one worker.")
    ksub = p.add_subparsers(dest="keys_command", required=True)
    show = ksub.add_parser("show", help="print every role's key and what it allows")
    derive = ksub.add_parser("derive", help="print (or write) one role's key",
                             description="Print ROLE's key, or write it to --out (mode 0600). An agent key is for "
                                         "one episode (--episode) and expires after --ttl seconds.")
    derive.add_argument("role", choices=ROLE_CHOICES, metavar="ROLE", help=f"one of {ROLE_CHOICES}")
    derive.add_argument("--out", metavar="PATH", help="write the key here (readable only by you) instead of printing it")
    derive.add_argument("--episode", metavar="ID", help="agent only: the episode id its requests carry (X-Episode-Id)")
    derive.add_argument("--ttl", type=float, default=3600.0, metavar="SECONDS", help="agent only: lifetime (default 3600)")
    revoke = ksub.add_parser("revoke", help="revoke a role's key or one worker (operator key or cluster secret)",
                             description="Revoke ROLE's key (worker, operator: the supervisor refuses the old one from "
                                         "its next message on; workers `up` started take the new worker key from "
                                         "RUN_DIR/keys/worker) or one WORKER_ID (refused and evicted like a dead "
                                         "worker; its prompts are re-issued).")
    revoke.add_argument("target", metavar="ROLE|WORKER_ID", help="worker, operator, or a worker id from `status`")
    for q in (show, derive, revoke):
        q.add_argument("--supervisor", metavar="tcp://HOST:PORT",
                       help="find the secret of the run in this directory whose ready file names this address")
        q.add_argument("--run-dir", metavar="RUN_DIR", help="the run whose secret to derive from (default, when no "
                       "secret and no --supervisor is given: " + RUN_DIR_HELP.partition("(default: ")[2])
        add_secret_arg(q)


def _secret() -> bytes:
    secret = load_secret()
    if secret is None:
        raise ConfigError("no cluster secret: pass --secret-file PATH (or --supervisor ADDR in the directory of "
                          "the run), or set EARL_STREAM_SECRET_FILE")
    held = role_of(secret)
    if held is not KeyRole.CLUSTER:
        raise ConfigError(f"keys are derived from the cluster secret; the file given holds the {held.value if held else '?'} "
                          "key, from which no other key can be derived")
    return secret


write_key = write_key_file  # `key` in a new file readable only by this user


def _generations(args: argparse.Namespace) -> dict[KeyRole, int]:
    """The key generations of the run these keys are for: its RUN_DIR (found by --run-dir or --supervisor, else the
    directory of the secret file, which `up` keeps in RUN_DIR) holds them (supervisor/revocation.py)."""
    local = getattr(args, "local_run", None)
    run_dir = local.run_dir if local is not None else Path(os.environ.get(SECRET_ENV, ".")).parent
    return generations_in(Path(run_dir))


def _revoke(args: argparse.Namespace) -> int:
    if not args.supervisor:
        raise ConfigError("keys revoke asks the run's supervisor: pass --supervisor ADDR (or --run-dir)")
    client = P.ControlClient(args.supervisor, timeout_s=10, secret=key_for(load_secret(), KeyRole.OPERATOR))
    try:
        reply = client.call(P.RevokeKey(target=args.target))
    finally:
        client.close()
    print(reply.message)
    return 0


def run_keys_command(args: argparse.Namespace) -> int:
    if args.keys_command == "revoke":
        return _revoke(args)
    secret = _secret()
    generations = _generations(args)
    if args.keys_command == "show":
        for role in ROLE_KEYS:
            print(f"{role.value:9s} {role_token(secret, role, generations.get(role, 0)).decode()}\n          {WHAT[role]}")
        print(f"{'agent':9s} (per episode: earl-stream keys derive agent --episode ID)\n          {WHAT[KeyRole.AGENT]}")
        return 0
    role = KeyRole(args.role)
    if role is KeyRole.AGENT:
        if not args.episode:
            raise ConfigError("an agent key is for one episode: pass --episode ID")
        key = agent_key(secret, args.episode, args.ttl).encode()
    else:
        key = role_token(secret, role, generations.get(role, 0))
    if args.out:
        print(f"wrote the {role.value} key to {write_key(Path(args.out), key)}")
    else:
        print(key.decode())
    return 0
