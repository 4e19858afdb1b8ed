"""`earl-stream scale --role rollout --replicas N [--supervisor ADDR]`: resize the rollout pool of a live run.

The supervisor holds the desired size and decides (`earl_stream.supervisor.pools`); this command only
asks and reports. Scaling down drains: the leaving workers take no new prompts and exit once every
sample they produced is trained and released, so nothing is lost or played twice. Scaling up cancels
drains first; the workers still missing are started by the run's launcher (`up` starts them itself)
or by hand with the printed command.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from earl_stream import protocol as P
from earl_stream.cli.local_run import add_run_args
from earl_stream.errors import ControlPlaneTimeout
from earl_stream.security.keys import KeyRole, key_for
from earl_stream.security.secret import load_secret


def add_parser(sub: Any, add_secret_arg: Any) -> None:
    p = sub.add_parser("scale", help="resize the rollout pool of a live run (scale-down drains; default: the run in runs/latest)",
                       description="Set the rollout pool's size. Workers above it drain: no new prompts, they exit "
                                   "once their samples are trained and released. Below it, drains are cancelled "
                                   "first, then `up` starts the missing workers (elsewhere: start them with the "
                                   "printed command).")
    p.add_argument("--role", default="rollout", choices=("rollout",), help="the pool (only rollout scales live)")
    p.add_argument("--replicas", type=int, required=True, metavar="N", help="the pool's new size (>= 0)")
    add_run_args(p)
    p.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                   help="wait until the draining workers have left (0 = return at once)")
    add_secret_arg(p)


def run_scale(args: argparse.Namespace) -> int:
    client = P.ControlClient(args.supervisor, timeout_s=10, secret=key_for(load_secret(), KeyRole.OPERATOR))
    try:
        reply = client.call(P.Scale(role=P.Role(args.role), replicas=args.replicas), what="scale")
        print(f"{args.role} pool: {reply.replicas} wanted, {reply.active} active")
        if reply.draining:
            print(f"draining {', '.join(reply.draining)}: no new prompts; each leaves once its samples are trained "
                  "and released")
        if reply.undrained:
            print(f"drain cancelled for {', '.join(reply.undrained)}: taking prompts again")
        if reply.to_start:
            print(f"{reply.to_start} worker(s) to start: `earl-stream up` starts them; a run started by hand needs "
                  f"`earl-stream worker --role rollout --supervisor {client.address}` on a host, {reply.to_start} time(s)")
        if args.wait > 0 and reply.draining:
            _wait_drained(client, set(reply.draining), args.wait)
    finally:
        client.close()
    return 0


def _wait_drained(client: P.ControlClient, ids: set[str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        status = json.loads(client.call(P.StatusRequest(), what="status").status_json)
        left = {w["id"] for w in status["workers"] if w["id"] in ids and not w["alive"]}
        if left == ids:
            print(f"drained and left: {', '.join(sorted(ids))}")
            return
        if time.monotonic() > deadline:
            raise ControlPlaneTimeout(f"after {timeout_s:.0f}s still draining: {', '.join(sorted(ids - left))} (they "
                                      "leave once the trainer has trained and checkpointed their samples)")
        time.sleep(0.5)
