"""Tensor-parallel weight slices: each rank pulls only its slice, and the slices reassemble exactly."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from earl_stream.errors import StoreError
from earl_stream.store import ShardClient, ShardNode
from earl_stream.store.weights import publish_weights, pull_weights_tp, tp_split_dim

torch.set_num_threads(1)
HIDDEN, INTER, VOCAB, KV = 24, 40, 101, 8  # vocab 101 and tp=3: uneven shares on purpose


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    r = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    state = {"model.embed_tokens.weight": r(VOCAB, HIDDEN).to(torch.bfloat16), "model.norm.weight": r(HIDDEN)}
    for i in range(2):
        p = f"model.layers.{i}."
        state |= {
            p + "self_attn.q_proj.weight": r(HIDDEN, HIDDEN), p + "self_attn.q_proj.bias": r(HIDDEN),
            p + "self_attn.k_proj.weight": r(KV, HIDDEN), p + "self_attn.k_proj.bias": r(KV),
            p + "self_attn.v_proj.weight": r(KV, HIDDEN), p + "self_attn.v_proj.bias": r(KV),
            p + "self_attn.o_proj.weight": r(HIDDEN, HIDDEN),
            p + "mlp.gate_proj.weight": r(INTER, HIDDEN), p + "mlp.up_proj.weight": r(INTER, HIDDEN),
            p + "mlp.down_proj.weight": r(HIDDEN, INTER),
            p + "input_layernorm.weight": r(HIDDEN), p + "post_attention_layernorm.weight": r(HIDDEN),
        }
    state["lm_head.weight"] = r(VOCAB, HIDDEN)
    return state


@pytest.fixture
def published() -> Iterator[tuple[ShardNode, dict[str, torch.Tensor]]]:
    with ShardNode() as node:
        state = _state()
        publish_weights(node, 5, state)
        yield node, state


def test_split_dims_follow_megatron_sharding() -> None:
    assert tp_split_dim("model.layers.0.self_attn.q_proj.weight", [8, 8]) == 0
    assert tp_split_dim("model.layers.0.self_attn.v_proj.bias", [8]) == 0
    assert tp_split_dim("model.layers.0.mlp.up_proj.weight", [8, 8]) == 0
    assert tp_split_dim("model.layers.0.self_attn.o_proj.weight", [8, 8]) == 1
    assert tp_split_dim("model.layers.0.mlp.down_proj.weight", [8, 8]) == 1
    assert tp_split_dim("model.layers.0.mlp.down_proj.bias", [8]) is None
    assert tp_split_dim("model.embed_tokens.weight", [8, 8]) == 0 and tp_split_dim("lm_head.weight", [8, 8]) == 0
    assert tp_split_dim("model.layers.0.input_layernorm.weight", [8]) is None


@pytest.mark.parametrize("tp, shm, bucket", [(2, True, 64 << 20), (3, True, 100), (4, False, 1000)])
def test_slices_reassemble_exactly(published: tuple[ShardNode, dict[str, torch.Tensor]], tp: int, shm: bool, bucket: int) -> None:
    node, state = published
    with ShardClient(timeout_s=10.0, shm=shm) as client:
        slices = [pull_weights_tp(client, node.address, 5, r, tp, bucket_bytes=bucket) for r in range(tp)]
    for name, full in state.items():
        dim = tp_split_dim(name, list(full.shape))
        parts = [s[name] for s in slices]
        assert all(p.dtype == full.dtype for p in parts), name
        if dim is None:
            assert all(torch.equal(p, full) for p in parts), name
            continue
        assert sum(p.shape[dim] for p in parts) == full.shape[dim]
        assert max(p.shape[dim] for p in parts) - min(p.shape[dim] for p in parts) <= 1, name
        assert torch.equal(torch.cat(parts, dim=dim), full), name
    moved = sum(t.numel() * t.element_size() for t in slices[0].values())
    total = sum(t.numel() * t.element_size() for t in state.values())
    assert moved < total / tp * 1.1  # only the slice moves (norms are tiny)


def test_names_subset_and_errors(published: tuple[ShardNode, dict[str, torch.Tensor]]) -> None:
    node, state = published
    name = "model.layers.1.self_attn.o_proj.weight"
    with ShardClient(timeout_s=10.0) as client:
        got = pull_weights_tp(client, node.address, 5, 1, 2, names=[name])
        assert list(got) == [name] and torch.equal(got[name], state[name][:, HIDDEN // 2 :])
        with pytest.raises(StoreError, match=r"tp_rank=2 must be in \[0, tp_size=2\)"):
            pull_weights_tp(client, node.address, 5, 2, 2)
        with pytest.raises(StoreError, match=r"timed out after 0.3s waiting for weights version 6 \(tp slice 0/2\)"):
            pull_weights_tp(client, node.address, 6, 0, 2, timeout_s=0.3)
        with pytest.raises(StoreError, match="no tensors"):
            pull_weights_tp(client, node.address, 5, 0, 2, names=["nope"])
