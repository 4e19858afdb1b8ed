"""The rollout plan sized from the rollout engine's own memory and rollout.dtype,
and episodes longer than any plan can run (bad input) stopped and counted.

In-process: the Planner and the Supervisor's message handler, no sockets."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from earl_stream import protocol as P
from earl_stream.cli.up import make_summary
from earl_stream.config import load_config
from earl_stream.errors import ConfigError
from earl_stream.store.schema import SCHEMA_VERSION, SampleMeta
from earl_stream.supervisor import planning
from earl_stream.supervisor.memory_model import ModelShape, predict_kv_cache_bytes
from earl_stream.supervisor.planning import Planner
from earl_stream.supervisor.rollout_memory import engine_transient
from earl_stream.supervisor.rollout_selector import engine_kv_capacity, fused_copy_params
from earl_stream.supervisor.selector import Infeasible
from earl_stream.supervisor.server import Supervisor
from earl_stream.workers.engines.memory import EngineMemory

MIB = 1 << 20
SMALL = {"model_type": "qwen2", "hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8,
         "num_key_value_heads": 2, "intermediate_size": 1536, "vocab_size": 32000}
ROLLOUT_MEMORY = 600 * MIB


def _cfg(tmp_path: Path, *overrides: str) -> Any:
    (tmp_path / "config.json").write_text(json.dumps(SMALL))
    return load_config(None, [f"model.path={tmp_path}", f"run_dir={tmp_path / 'run'}", "trainer.nproc=2",
                              "selector.context_window=16", "selector.initial_seq_len=256",
                              "selector.min_episodes_between=0", "selector.reserve_bytes=0",
                              f"selector.trainer_memory_bytes={1600 * MIB}", "rollout.max_batch_size=4096",
                              *overrides])


def test_the_kv_budget_comes_from_the_engines_memory_and_dtype(tmp_path: Path) -> None:
    plans = {}
    for dtype in ("fp32", "bf16"):
        planner = Planner(_cfg(tmp_path, f"rollout.dtype={dtype}", f"rollout.memory_bytes={ROLLOUT_MEMORY}"))
        assert planner.rollout_plan is not None
        plans[dtype] = planner.rollout_plan
    fp32, bf16 = plans["fp32"], plans["bf16"]
    shape = ModelShape.from_hf(SMALL)
    weights = shape.num_params() + fused_copy_params(shape)  # the built-in engine's fused copies count
    for plan, nbytes in ((fp32, 4), (bf16, 2)):
        per_token = predict_kv_cache_bytes(shape, 1, dtype_bytes=nbytes)
        # ... and so do its prefill and decode transients at the rows the plan runs at once
        transient = engine_transient(shape, design_seq_len=256, rows=plan.max_concurrent_sequences, dtype_bytes=nbytes)
        assert plan.kv_budget_tokens == (ROLLOUT_MEMORY - weights * nbytes - transient.peak_bytes) // per_token
        assert "transient" in plan.sizing
        assert plan.memory_bytes == ROLLOUT_MEMORY and plan.predicted_peak_bytes <= ROLLOUT_MEMORY
        assert "rollout.memory_bytes" in plan.sizing and f"{plan.kv_budget_tokens} tokens" in plan.sizing
    # half the bytes per KV element, and half the weights: more than twice the tokens on the same memory
    assert bf16.kv_budget_tokens >= 2 * fp32.kv_budget_tokens
    assert bf16.max_concurrent_sequences >= 2 * fp32.max_concurrent_sequences


def test_the_rollout_plan_follows_the_smallest_memory_the_workers_report(tmp_path: Path) -> None:
    sup = Supervisor(_cfg(tmp_path))  # rollout.memory_bytes=0: derived; before any report, this host's share
    first = sup.planner.rollout_wire
    assert first is not None and ("host RAM" in first.sizing or "RLIMIT_AS" in first.sizing)

    def wire(msg: P.Msg) -> Any:
        return P.decode(P.encode(sup.handle(P.decode(P.encode(msg)), time.time())))  # both ways over the wire

    ids = [wire(P.Register(role=P.Role.ROLLOUT, host="h", pid=i, shard_address=f"127.0.0.1:{i}")).worker_id
           for i in (1, 2)]
    plan = wire(P.Heartbeat(worker_id=ids[0], stats={"memory_bytes": float(ROLLOUT_MEMORY)})).plan
    assert plan.memory_bytes == ROLLOUT_MEMORY and plan.version == first.version + 1
    assert f"reported by {ids[0]}" in plan.sizing and "engine memory now 600 MiB" in plan.reason
    smaller = wire(P.Heartbeat(worker_id=ids[1], stats={"memory_bytes": float(ROLLOUT_MEMORY // 2)})).plan
    assert smaller.memory_bytes == ROLLOUT_MEMORY // 2 and smaller.kv_budget_tokens < plan.kv_budget_tokens
    again = wire(P.Heartbeat(worker_id=ids[0], stats={"memory_bytes": float(ROLLOUT_MEMORY)})).plan
    assert again == smaller  # the smallest still rules: no new version
    assert sup.status(time.time())["plans"]["rollout_memory"]["bytes"] == ROLLOUT_MEMORY // 2


def test_a_supervisor_host_too_small_for_the_model_waits_for_the_workers_memory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Derived memory on the supervisor's host is only a guess (the workers may have GPUs): a guess too
    small is no start-up failure; the first worker's report makes the plan."""
    monkeypatch.setattr(planning, "host_share", lambda processes: EngineMemory(50 * MIB, "a small host"))
    sup = Supervisor(_cfg(tmp_path))
    assert sup.planner.rollout_wire is None and "does not fit" in sup.status(time.time())["plans"]["infeasible"]
    worker = sup.handle(P.Register(role=P.Role.ROLLOUT, host="h", pid=1, shard_address="127.0.0.1:1"),
                        time.time()).worker_id
    plan = sup.handle(P.Heartbeat(worker_id=worker, stats={"memory_bytes": float(ROLLOUT_MEMORY)}), time.time()).plan
    assert plan is not None and plan.version == 1 and plan.memory_bytes == ROLLOUT_MEMORY and plan.design_seq_len == 256
    assert sup.status(time.time())["plans"]["infeasible"] is None


def test_configured_memory_is_not_overridden_and_a_too_small_engine_fails_at_start(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, f"rollout.memory_bytes={ROLLOUT_MEMORY}")
    planner = Planner(cfg)
    planner.on_rollout_memory({"rollout-0": ROLLOUT_MEMORY // 4})
    assert planner.rollout_plan is not None and planner.rollout_plan.memory_bytes == ROLLOUT_MEMORY
    assert engine_kv_capacity(cfg, tmp_path, ROLLOUT_MEMORY, "test") == planner.rollout_plan.kv_budget_tokens
    with pytest.raises(ConfigError, match=r"holds no plan: .*need [0-9.]+ MiB"):
        engine_kv_capacity(cfg, tmp_path, 100 * MIB, "test")  # less than the fp32 weights
    with pytest.raises(ConfigError, match="no rollout plan fits"):
        Planner(_cfg(tmp_path, f"rollout.memory_bytes={100 * MIB}"))


def _rows(prompt: P.Prompt, info: list[dict[str, Any]], version: int = 0) -> list[SampleMeta]:
    return [SampleMeta(schema_version=SCHEMA_VERSION, sample_id=f"{prompt.group_id}-{i}",
                       prompt_ordinal=prompt.prompt_ordinal, episode_id=str(i), group_id=prompt.group_id,
                       env=prompt.env, turns=1, prompt_tokens=3, response_tokens=97, total_tokens=100,
                       reward=float(i), advantage=None, policy_version_min=version, policy_version_max=version,
                       producer_id="w",
                       producer_address="127.0.0.1:1", checksum=0, created_at=time.time(),
                       info_json=json.dumps(info[i % len(info)]))
            for i in range(prompt.group_size)]


def test_episodes_longer_than_any_plan_are_bounded_and_counted(tmp_path: Path) -> None:
    sup = Supervisor(_cfg(tmp_path, f"rollout.memory_bytes={ROLLOUT_MEMORY}"))
    plan, largest = sup.planner.rollout_wire, sup.planner.max_trainable_tokens
    assert plan is not None and 2048 <= largest < 1 << 20  # the trainer's 1600 MiB per rank bound it
    assert plan.max_episode_tokens == min(largest, plan.kv_budget_tokens)
    trainer = sup.planner.trainer
    assert trainer is not None  # the longest to 64 tokens: a plan fits it, none fits 64 more
    assert not isinstance(trainer.plan_for(largest), Infeasible) and isinstance(trainer.plan_for(largest + 64), Infeasible)
    worker = sup.handle(P.Register(role=P.Role.ROLLOUT, host="h", pid=1, shard_address="127.0.0.1:1"),
                        time.time()).worker_id
    prompt = sup.handle(P.RequestPrompts(worker_id=worker, max_groups=1), time.time()).prompts[0]
    too_long = {"outcome": "truncated", "too_long": "stopped after 3 turns: its context reached the bound"}
    sup.handle(P.PutMeta(worker_id=worker, rows=_rows(prompt, [too_long, {"outcome": "win"}])), time.time())
    sup.handle(P.PutMeta(worker_id=worker, rows=_rows(prompt, [too_long])), time.time())  # a retry: counted once
    status = sup.status(time.time())
    assert status["samples_too_long"] == (prompt.group_size + 1) // 2
    assert status["plans"]["max_trainable_tokens"] == largest
    assert make_summary(status, wall=1.0)["samples_too_long"] == status["samples_too_long"]


def test_a_group_refused_whole_is_dropped_not_played_again(tmp_path: Path) -> None:
    """Every episode of a group refused before its first turn (its prompt alone longer than any plan):
    no model token (policy versions -1), nothing to train; played again it would be refused again."""
    sup = Supervisor(_cfg(tmp_path, f"rollout.memory_bytes={ROLLOUT_MEMORY}", "trainer.groups_per_step=1"))
    worker = sup.handle(P.Register(role=P.Role.ROLLOUT, host="h", pid=1, shard_address="127.0.0.1:1"),
                        time.time()).worker_id
    refused, played = sup.handle(P.RequestPrompts(worker_id=worker, max_groups=2), time.time()).prompts
    too_long = {"outcome": "truncated", "too_long": "refused after 0 turns: its context reached the bound"}
    sup.handle(P.PutMeta(worker_id=worker, rows=_rows(refused, [too_long], version=-1)), time.time())
    waiting = sup.handle(P.Claim(worker_id=worker, step=0, num_groups=1, min_policy_version=0), time.time())
    assert not waiting.ready and "samples_too_long" in waiting.waiting  # what a trainer's claim timeout names
    sup.handle(P.PutMeta(worker_id=worker, rows=_rows(played, [{"outcome": "win"}])), time.time())
    claimed = sup.handle(P.Claim(worker_id=worker, step=0, num_groups=1, min_policy_version=0), time.time())
    assert claimed.ready
    status = sup.status(time.time())
    assert status["samples_filtered"] == refused.group_size and status["samples_stale"] == 0
    assert status["samples_too_long"] == refused.group_size and status["prompts_reissued"] == 0
