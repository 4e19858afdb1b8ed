"""Versioned weights through the shard store: round trip of every dtype, buckets, timeouts."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch

from earl_stream.errors import StoreError
from earl_stream.store import ShardClient, ShardNode
from earl_stream.store.weights import drop_weights, publish_weights, pull_weights

torch.set_num_threads(1)


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(64, 16, generator=g, dtype=torch.bfloat16),
        "layers.0.attn.q_proj.weight": torch.randn(16, 16, generator=g),
        "layers.0.norm.weight": torch.randn(16, generator=g, dtype=torch.float16),
        "step": torch.tensor(7, dtype=torch.int64),
        "mask": torch.rand(33, generator=g) > 0.5,
        "empty": torch.empty(0, 4),
        "transposed": torch.randn(8, 5, generator=g).t(),  # non-contiguous on the trainer side
    }


@pytest.fixture
def node() -> Iterator[ShardNode]:
    with ShardNode() as n:
        yield n


@pytest.fixture
def client() -> Iterator[ShardClient]:
    with ShardClient(timeout_s=10.0) as c:
        yield c


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("bucket_bytes", [64 << 20, 1000, 7])
def test_round_trip_every_dtype_and_bucket_size(node: ShardNode, client: ShardClient, bucket_bytes: int) -> None:
    state = _state()
    manifest = publish_weights(node, 3, state)
    assert manifest.version == 3 and manifest.total_bytes == sum(t.numel() * t.element_size() for t in state.values())
    got = pull_weights(client, node.address, 3, bucket_bytes=bucket_bytes)
    _assert_same(got, state)
    assert got["embed.weight"].dtype == torch.bfloat16


def test_published_weights_are_a_snapshot(node: ShardNode, client: ShardClient) -> None:
    w = torch.ones(10)
    publish_weights(node, 1, {"w": w})
    w.add_(1.0)  # the trainer's next optimizer step
    assert torch.equal(pull_weights(client, node.address, 1)["w"], torch.ones(10))


def test_subset_versions_and_drop(node: ShardNode, client: ShardClient) -> None:
    publish_weights(node, 1, {"a": torch.zeros(3), "b": torch.ones(2)})
    publish_weights(node, 10, {"a": torch.full((3,), 10.0)})
    got = pull_weights(client, node.address, 1, names=["b"])
    assert list(got) == ["b"] and torch.equal(got["b"], torch.ones(2))
    with pytest.raises(StoreError, match="no tensors"):
        pull_weights(client, node.address, 1, names=["zzz"])
    freed = drop_weights(node, 1)
    assert freed >= 20 and all(k.startswith("w/10/") for k in node.keys())  # "w/1/" does not match "w/10/"
    assert torch.equal(pull_weights(client, node.address, 10)["a"], torch.full((3,), 10.0))


def test_missing_version_times_out_naming_version_and_peer(node: ShardNode, client: ShardClient) -> None:
    t0 = time.monotonic()
    with pytest.raises(StoreError, match=f"weights version 5 from {node.address}"):
        pull_weights(client, node.address, 5, timeout_s=0.3)
    assert time.monotonic() - t0 < 2.0


def test_waits_for_a_version_published_meanwhile(node: ShardNode, client: ShardClient) -> None:
    threading.Timer(0.2, publish_weights, args=(node, 2, {"x": torch.arange(5)})).start()
    got = pull_weights(client, node.address, 2, timeout_s=10.0)
    assert torch.equal(got["x"], torch.arange(5))


def test_unreachable_trainer_is_an_explicit_error(client: ShardClient) -> None:
    node = ShardNode()
    address = node.address
    node.close()
    with pytest.raises(StoreError, match=f"weights version 1 from {address}"):
        pull_weights(client, address, 1, timeout_s=1.0)


def test_reserved_names_are_refused(node: ShardNode) -> None:
    with pytest.raises(StoreError, match="reserved"):
        publish_weights(node, 1, {".manifest": torch.zeros(1)})


def test_blocks_published_by_several_nodes_are_assembled(client: ShardClient) -> None:
    """A sharded trainer: each rank's node holds its blocks (FSDP rows x tp columns), rank 0's
    manifest names the peers; one pull gets whole tensors back, bit-equal."""
    from earl_stream.store.weights import WeightPiece

    g = torch.Generator().manual_seed(3)
    whole = {"w": torch.randn(6, 8, generator=g), "b": torch.randn(5, generator=g), "n": torch.randn(4, generator=g)}
    blocks = [[WeightPiece("w", whole["w"][:3, :4], (6, 8), (0, 0)), WeightPiece("b", whole["b"][:3], (5,), (0,)),
               WeightPiece("n", whole["n"], (4,), (0,))],
              [WeightPiece("w", whole["w"][:3, 4:], (6, 8), (0, 4)), WeightPiece("b", whole["b"][3:], (5,), (3,))],
              [WeightPiece("w", whole["w"][3:, :4], (6, 8), (3, 0))],
              [WeightPiece("w", whole["w"][3:, 4:], (6, 8), (3, 4)), WeightPiece("b", whole["b"][5:], (5,), (5,))]]
    with ShardNode() as n0, ShardNode() as n1, ShardNode() as n2, ShardNode() as n3:
        nodes = [n0, n1, n2, n3]
        for i in (3, 2, 1):  # the peers first, as every rank publishes before rank 0 announces
            publish_weights(nodes[i], 4, blocks[i])
        manifest = publish_weights(n0, 4, blocks[0], peers=[n.address for n in nodes[1:]])
        assert manifest.peers and manifest.tensors[0].full_shape == [6, 8]
        got = pull_weights(client, n0.address, 4, timeout_s=10.0)
        assert sorted(got) == sorted(whole)
        for name, tensor in whole.items():
            assert torch.equal(got[name], tensor), name
        assert torch.equal(pull_weights(client, n0.address, 4, names=["b"], timeout_s=10.0)["b"], whole["b"])
        with pytest.raises(StoreError, match="no tensors"):
            pull_weights(client, n0.address, 4, names=["nope"], timeout_s=10.0)
