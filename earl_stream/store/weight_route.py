"""Whom a rollout worker pulls a new weight version from (`store.weight_sync`), torch-free.

Owns `WEIGHT_SYNC_MODES`, `resolve_weight_sync` and `weight_route`, which the supervisor calls per
heartbeat to fill `HeartbeatReply.weights_via` / `weights_relay`. Moving the bytes is `relay.py`'s
(relay) and `weights.py`'s (direct pulls from the trainer ranks).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from earl_stream.errors import StoreError

WEIGHT_SYNC_MODES = ("auto", "direct", "relay")


@dataclass(frozen=True)
class WeightRoute:
    """`relay`: pull with `pull_weights_relay` and serve the version onwards; `via`: the rollout worker's
    shard node to pull it from ("" = the trainer ranks). Without relay: `pull_weights` from the trainer."""

    relay: bool = False
    via: str = ""


def resolve_weight_sync(mode: str, hosts: int, trainer_hosts: int = 1) -> str:
    """'direct' or 'relay' for `store.weight_sync=mode` with a rollout pool on `hosts` distinct hosts and a
    trainer pool on `trainer_hosts`. auto relays once the rollout pool spans more hosts than the trainer's:
    direct pulls load each trainer link with hosts / trainer_hosts copies, the relay costs about one copy
    plus a chunk time per hop. bench/dispatch_cluster.py (64 MiB, 2 trainer hosts) measured direct pulls
    and the relay even at 2 rollout hosts (1.20 / 1.25 s) and the relay faster from 4 on (1.4 / 2.3 s at 4,
    2.2 / 9.1 s at 16)."""
    if mode not in WEIGHT_SYNC_MODES:
        raise StoreError(f"store.weight_sync={mode!r}: expected one of {', '.join(WEIGHT_SYNC_MODES)}")
    if mode == "auto":
        return "relay" if hosts >= 2 and hosts > max(1, trainer_hosts) else "direct"
    return mode


def weight_route(mode: str, pool: Sequence[tuple[str, str]], me: str, trainer_hosts: int = 1) -> WeightRoute:
    """How rollout worker `me` (its shard address) gets a new version. `pool`: (host, shard address) of the
    live rollout workers in join order; `trainer_hosts`: distinct hosts of the trainer pool. With relay,
    each pulls from the worker before it (a chain: a parent always joined earlier, so no cycle can form
    however the pool changes between heartbeats)."""
    addresses = [address for _, address in pool]
    hosts = len({host for host, _ in pool})
    if me not in addresses or resolve_weight_sync(mode, hosts, trainer_hosts) != "relay":
        return WeightRoute()
    i = addresses.index(me)
    return WeightRoute(relay=True, via=addresses[i - 1] if i else "")
