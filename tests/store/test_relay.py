"""Weights relayed between rollout workers (store/relay.py): a chain of real shard nodes on loopback
pulls a sharded trainer's version, each worker serving the chunks it holds to the next; a relay peer
that is absent or stalls falls back to the trainer; the supervisor's choice of whom to pull from."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import msgspec
import numpy as np
import pytest
import torch

from earl_stream.errors import StoreError
from earl_stream.store import ShardClient, ShardNode
from earl_stream.store.relay import RelayManifest, plan_relay, pull_weights_relay, relay_key, sync_weights
from earl_stream.store.weight_route import WeightRoute, resolve_weight_sync, weight_route
from earl_stream.store.weights import MANIFEST_NAME, WeightPiece, drop_weights, publish_weights

torch.set_num_threads(1)
CHUNK = 1000  # bytes: every tensor below spans several chunks
Trainer = tuple[ShardNode, ShardNode, dict[str, torch.Tensor]]


def _whole() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {"w": torch.randn(40, 24, generator=g), "b": torch.randn(30, generator=g, dtype=torch.float64),
            "e": torch.randn(50, 8, generator=g).to(torch.bfloat16), "empty": torch.empty(0, 3), "step": torch.tensor(3)}


@pytest.fixture
def trainer() -> Iterator[Trainer]:
    """Two trainer ranks, FSDP-style: each holds half the rows of the 2-D tensors; rank 0 the rest."""
    whole = _whole()
    with ShardNode(shm=False) as r0, ShardNode(shm=False) as r1:
        halves = [[WeightPiece(n, whole[n][:h], tuple(whole[n].shape), (0, 0)) for n, h in (("w", 20), ("e", 25))],
                  [WeightPiece(n, whole[n][h:], tuple(whole[n].shape), (h, 0)) for n, h in (("w", 20), ("e", 25))]]
        for name in ("b", "empty", "step"):
            halves[0].append(WeightPiece(name, whole[name], tuple(whole[name].shape), (0,) * whole[name].dim()))
        publish_weights(r1, 1, halves[1])
        publish_weights(r0, 1, halves[0], peers=[r1.address])
        yield r0, r1, whole


@pytest.fixture
def client() -> Iterator[ShardClient]:
    with ShardClient(timeout_s=10.0, shm=False) as c:
        yield c


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def test_chain_serves_later_workers_after_the_trainer_dropped_the_version(trainer: Trainer, client: ShardClient) -> None:
    r0, r1, whole = trainer
    with ShardNode(shm=False) as a, ShardNode(shm=False) as b, ShardNode(shm=False) as c:
        _assert_same(pull_weights_relay(client, a, r0.address, 1, chunk_bytes=CHUNK), whole)
        plan = msgspec.json.decode(_blob(client, a.address, relay_key(1, MANIFEST_NAME)), type=RelayManifest)
        assert plan.sources == [r0.address, r1.address] and len(plan.chunks) > len(plan.tensors)
        drop_weights(r0, 1)
        drop_weights(r1, 1)  # from here on, only the relay holds version 1
        _assert_same(pull_weights_relay(client, b, r0.address, 1, via=a.address, chunk_bytes=CHUNK, stall_s=2), whole)
        _assert_same(pull_weights_relay(client, c, r0.address, 1, via=b.address, chunk_bytes=CHUNK, stall_s=2), whole)
        assert sum(k.startswith("wr/1/") for k in c.keys()) == len(plan.chunks) + 1


def test_a_follower_pulls_over_several_connections_with_the_cluster_secret(trainer: Trainer) -> None:
    """The follower's extra streams to its relay peer authenticate as its own client does; the trainer's
    copy is gone, so a stream that could not would fail the pull instead of falling back."""
    r0, r1, whole = trainer
    with ShardClient(secret=b"s3", timeout_s=10.0, shm=False) as own, ShardNode(secret=b"s3", shm=False) as a, \
            ShardNode(secret=b"s3", shm=False) as b:
        with ShardClient(timeout_s=10.0, shm=False) as open_client:  # the trainer nodes need no secret
            _assert_same(pull_weights_relay(open_client, a, r0.address, 1, chunk_bytes=CHUNK), whole)
        drop_weights(r0, 1)
        drop_weights(r1, 1)
        _assert_same(pull_weights_relay(own, b, r0.address, 1, via=a.address, chunk_bytes=CHUNK, stall_s=2), whole)


def test_chain_pulls_concurrently_while_the_head_is_still_pulling(trainer: Trainer, client: ShardClient) -> None:
    r0, _, whole = trainer
    with ShardNode(shm=False) as a, ShardNode(shm=False) as b, ShardNode(shm=False) as c:
        got: dict[str, dict[str, torch.Tensor]] = {}
        errors: list[BaseException] = []

        def pull(name: str, node: ShardNode, via: str) -> None:
            try:
                with ShardClient(timeout_s=10.0, shm=False) as own:
                    got[name] = pull_weights_relay(own, node, r0.address, 1, via=via, chunk_bytes=CHUNK, stall_s=5)
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=pull, args=args) for args in
                   (("c", c, b.address), ("b", b, a.address), ("a", a, ""))]  # the tail starts first and waits
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not errors, errors
        for name in "abc":
            _assert_same(got[name], whole)


def test_absent_relay_peer_falls_back_to_the_trainer(trainer: Trainer, client: ShardClient) -> None:
    r0, _, whole = trainer
    with ShardNode(shm=False) as idle, ShardNode(shm=False) as me:  # `idle` never pulls version 1
        start = time.monotonic()
        _assert_same(pull_weights_relay(client, me, r0.address, 1, via=idle.address, chunk_bytes=CHUNK, stall_s=0.3), whole)
        assert time.monotonic() - start < 5
        assert relay_key(1, MANIFEST_NAME) in me.keys()  # and it serves the version onwards


def test_stalled_relay_peer_mid_stream_falls_back_for_the_rest(trainer: Trainer, client: ShardClient) -> None:
    r0, _, whole = trainer
    with ShardNode(shm=False) as stuck, ShardNode(shm=False) as me:
        plan = plan_relay(client, r0.address, 1, CHUNK, time.monotonic() + 10, 10)
        stuck.put(relay_key(1, MANIFEST_NAME), np.frombuffer(msgspec.json.encode(plan), np.uint8).copy())
        first = plan.chunks[0]
        # a wrong first chunk at the stalled peer proves the follower took what the peer had served
        stuck.put(relay_key(1, "0"), np.zeros(first.end - first.start, np.uint8))
        got = pull_weights_relay(client, me, r0.address, 1, via=stuck.address, chunk_bytes=CHUNK, stall_s=0.3)
        name = plan.tensors[first.entry].name
        assert not torch.equal(got[name], whole[name])
        assert got[name].flatten().view(torch.uint8)[: first.end].count_nonzero() == 0
        for other in set(whole) - {name}:
            assert torch.equal(got[other], whole[other]), other


def test_older_versions_leave_the_relay_node(trainer: Trainer, client: ShardClient) -> None:
    r0, r1, whole = trainer
    for v in (2, 3):
        publish_weights(r0, v, whole)
    with ShardNode(shm=False) as me:
        for v in (1, 2, 3):
            pull_weights_relay(client, me, r0.address, v, chunk_bytes=CHUNK, keep_versions=2)
        assert {k.split("/")[1] for k in me.keys()} == {"2", "3"}


def test_missing_version_times_out_naming_it(client: ShardClient) -> None:
    with ShardNode(shm=False) as r0, ShardNode(shm=False) as me:
        with pytest.raises(StoreError, match="version 9"):
            pull_weights_relay(client, me, r0.address, 9, timeout_s=0.3)


def test_route_is_a_chain_in_join_order_once_the_pool_outgrows_the_trainer() -> None:
    pool = [("h1", "h1:1"), ("h2", "h2:1"), ("h3", "h3:1"), ("h3", "h3:2")]
    assert [weight_route("auto", pool, a).via for _, a in pool] == ["", "h1:1", "h2:1", "h3:1"]
    assert all(weight_route("auto", pool, a).relay for _, a in pool)
    assert weight_route("relay", pool, "nobody:1") == WeightRoute()
    assert [weight_route("direct", pool, a) for _, a in pool] == [WeightRoute()] * 4
    # 3 rollout hosts pull directly from as many trainer hosts (each trainer link carries one copy)
    assert [weight_route("auto", pool, a, trainer_hosts=3) for _, a in pool] == [WeightRoute()] * 4
    one_host = [("h1", "h1:1"), ("h1", "h1:2")]
    assert weight_route("auto", one_host, "h1:2") == WeightRoute()
    assert weight_route("relay", one_host, "h1:2") == WeightRoute(relay=True, via="h1:1")
    assert [resolve_weight_sync("auto", n) for n in (1, 2, 3)] == ["direct", "relay", "relay"]
    assert [resolve_weight_sync("auto", n, trainer_hosts=2) for n in (2, 3, 8)] == ["direct", "relay", "relay"]
    with pytest.raises(StoreError, match="weight_sync"):
        resolve_weight_sync("rank0", 2)


def test_sync_weights_follows_the_route(trainer: Trainer, client: ShardClient) -> None:
    r0, _, whole = trainer
    with ShardNode(shm=False) as a, ShardNode(shm=False) as b:
        _assert_same(sync_weights(client, a, r0.address, 1, WeightRoute()), whole)
        assert not a.keys()  # a direct pull serves nothing onwards
        _assert_same(sync_weights(client, a, r0.address, 1, WeightRoute(relay=True)), whole)
        _assert_same(sync_weights(client, b, r0.address, 1, WeightRoute(relay=True, via=a.address)), whole)
        assert relay_key(1, MANIFEST_NAME) in a.keys() and relay_key(1, MANIFEST_NAME) in b.keys()


def _blob(client: ShardClient, address: str, key: str) -> bytes:
    (entry,) = [e for e in client.manifest(address, key) if e.key == key]
    (arr,) = client.pull(address, [(key, 0, entry.shape[0])])
    return arr.tobytes()
