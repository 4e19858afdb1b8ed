"""A training step whose every group was lost (producers gone) leaves the weights alone: Adam's
momentum must not move them without data."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from earl_stream.config import load_config
from earl_stream.model import load_model
from earl_stream.store.client import ShardClient
from earl_stream.store.layout import Layout
from earl_stream.store.node import ShardNode
from earl_stream.store.schema import SCHEMA_VERSION, SampleMeta
from earl_stream.workers.train_step import train_step


def test_a_step_with_every_group_lost_does_not_move_the_weights(tiny_model_dir: Path) -> None:
    torch.set_num_threads(1)
    model, _ = load_model(tiny_model_dir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for p in model.parameters():  # give Adam momentum, as after earlier steps
        p.grad = torch.ones_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with ShardNode("127.0.0.1") as node:  # a live producer that no longer holds these samples
        metas = [SampleMeta(schema_version=SCHEMA_VERSION, sample_id=f"g0.0-{i}", prompt_ordinal=0, episode_id=str(i),
                            group_id="g0.0", env="tictactoe", turns=1, prompt_tokens=4, response_tokens=4,
                            total_tokens=8, reward=float(i), advantage=None, policy_version_min=0,
                            policy_version_max=0, producer_id="w", producer_address=node.address, checksum=0,
                            created_at=time.time(), info_json="{}") for i in range(2)]
        client = ShardClient(timeout_s=5)
        try:
            result = train_step(model, optimizer, metas, Layout(), client, load_config(None).trainer)
        finally:
            client.close()
    assert sorted(result.lost_sample_ids) == ["g0.0-0", "g0.0-1"] and result.samples == 0
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
