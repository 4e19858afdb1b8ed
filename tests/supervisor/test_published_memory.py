"""The memory model counts the weights a trainer rank keeps published for the rollout pool as
`workers.sharding.shard_pieces` lays them out: whole tensors shared out over the ranks by bytes (no rank
holds a replica per version under data parallelism), a tied LM head not at all (it is the embedding), and
the fullest rank's bytes are what `param_tensors.published_share_bytes` predicts, exactly, for a tied and an
untied model."""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from earl_stream.store.layout import Layout
from earl_stream.supervisor.memory_model import TrainPlan, predict_train_memory, published_bytes
from earl_stream.supervisor.model_shape import ModelShape
from earl_stream.workers.sharding import shard_pieces


def _published(tied: bool, world: int) -> tuple[LlamaConfig, dict[str, torch.Tensor], list[list[Any]]]:
    config = LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=300, tie_word_embeddings=tied)
    torch.manual_seed(0)
    state = LlamaForCausalLM(config).state_dict()
    per_rank = [shard_pieces(state, types.SimpleNamespace(layout=Layout.from_rank(r, dp=world), world=world))
                for r in range(world)]
    return config, state, per_rank


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_replicated_weights_are_shared_out_each_tensor_once(tied: bool, world: int) -> None:
    _, state, per_rank = _published(tied, world)
    names = [p.name for pieces in per_rank for p in pieces]
    expected = sorted(k for k in state if not (tied and k == "lm_head.weight"))
    assert sorted(names) == expected and len(names) == len(set(names))  # every tensor once in the pool
    held = [sum(p.tensor.numel() * p.tensor.element_size() for p in pieces) for pieces in per_rank]
    whole = sum(state[k].numel() * state[k].element_size() for k in expected)
    assert sum(held) == whole
    if world > 1:
        assert max(held) < whole * 0.75  # shared out, not one rank holding the replica


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_the_memory_model_predicts_the_fullest_rank(tied: bool, world: int) -> None:
    config, _, per_rank = _published(tied, world)
    held = [sum(p.tensor.numel() * p.tensor.element_size() for p in pieces) for pieces in per_rank]
    shape = ModelShape.from_hf(config.to_dict())
    plan = TrainPlan(1, 128, dp=world)
    assert published_bytes(shape, plan) == max(held)
    kept = predict_train_memory(shape, dataclasses.replace(plan, published_versions=2))
    assert kept.published_bytes == 2 * max(held)
    assert kept.total_bytes == predict_train_memory(shape, plan).total_bytes + 2 * max(held)
