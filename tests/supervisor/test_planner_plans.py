"""The supervisor's plans as the pools and `earl-stream status --json` see them: a two-rank pool moves
from replicas to FSDP to tensor parallelism as contexts grow, the config decides what the selector may
use, plans travel with claims and heartbeats, the trainer's PlanAdopted builds `plans.trainer_history`,
refusals are in `plans.refused`, and a restarted supervisor keeps the history and the plan versions.
All in-process: the Planner and the Supervisor's message handler, no sockets."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

from earl_stream import protocol as P
from earl_stream.config import load_config
from earl_stream.errors import ConfigError
from earl_stream.store.schema import SCHEMA_VERSION, SampleMeta
from earl_stream.supervisor.memory_model import Precision
from earl_stream.supervisor.planning import Planner
from earl_stream.supervisor.selector import layout_name
from earl_stream.supervisor.server import Supervisor

MIB = 1 << 20
BUDGET = 1590 * MIB  # per rank (~230 MiB of it: the two policy versions a rank keeps published)
# a 57M-parameter Qwen2: its fp32 states (16 bytes per parameter) dominate a small per-rank budget
SMALL = {"model_type": "qwen2", "hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8,
         "num_key_value_heads": 2, "intermediate_size": 1536, "vocab_size": 32000}
SMOLLM2 = {"model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
           "num_key_value_heads": 3, "intermediate_size": 1536, "vocab_size": 49152, "tie_word_embeddings": True}


def _cfg(tmp_path: Path, *overrides: str, model: dict[str, Any] = SMALL) -> Any:
    (tmp_path / "config.json").write_text(json.dumps(model))
    return load_config(None, [f"model.path={tmp_path}", f"run_dir={tmp_path / 'run'}", "trainer.nproc=2",
                              "selector.context_window=16", "selector.initial_seq_len=256",
                              "selector.min_episodes_between=0", "selector.reserve_bytes=0",
                              f"selector.trainer_memory_bytes={BUDGET}", *overrides])


def test_a_two_rank_pool_moves_from_replicas_to_fsdp_to_tensor_parallel_as_contexts_grow(tmp_path: Path) -> None:
    planner = Planner(_cfg(tmp_path))  # 64 episodes per step (8 groups of 8)
    seen = [planner.trainer_wire]
    for step, length in enumerate((300, 700, 1500), 1):
        planner.stats.add_many([length] * 16)
        planner.on_step(step)
        seen.append(planner.trainer_wire)
    assert all(p is not None for p in seen)
    plans = [p for p in seen if p is not None]
    assert [p.design_seq_len for p in plans] == [256, 512, 1024, 2048]
    assert [p.version for p in plans] == [1, 2, 3, 4]
    # replicas while the states fit twice; their shards when activations grow; tensor parallel (which
    # splits the logits and activations too) at the longest; recomputation where it must
    assert [(p.name, p.recompute) for p in plans] == [("dp2", False), ("fsdp2", False), ("fsdp2", True),
                                                     ("tp2", True)]
    for p in plans:
        assert p.world == 2 and p.dtype == "fp32" and p.predicted_peak_bytes <= BUDGET
        assert p.micro_batch_tokens >= p.design_seq_len and "design length" in p.reason
    assert planner.last_infeasible == "" and planner.status()["refused"] == []


def test_the_config_decides_what_the_selector_may_use(tmp_path: Path) -> None:
    pool = Planner(_cfg(tmp_path)).trainer
    assert pool is not None and pool.allow_fsdp and pool.allow_tp and pool.allow_sp
    assert pool.base.precision is Precision.FP32
    one = Planner(_cfg(tmp_path, "trainer.nproc=1", f"selector.trainer_memory_bytes={2000 * MIB}")).trainer
    assert one is not None and not (one.allow_fsdp or one.allow_tp or one.allow_sp)
    off = Planner(_cfg(tmp_path, "selector.allow_fsdp=false", "selector.allow_tp=false"))
    assert off.trainer is not None and not (off.trainer.allow_fsdp or off.trainer.allow_tp) and off.trainer.allow_sp
    bf16 = Planner(_cfg(tmp_path, "trainer.dtype=bf16"))
    assert bf16.trainer is not None and bf16.trainer.base.precision is Precision.AUTOCAST_BF16
    assert bf16.trainer_wire is not None and bf16.trainer_wire.dtype == "bf16"



def test_dynamic_sp_keeps_the_sharding_to_dp_and_fsdp_and_checks_the_heads_at_start(tmp_path: Path) -> None:
    """`trainer.dynamic_sp_tokens`: the trainer picks the sp degree per micro-batch, so the selector offers no
    tp or sp plan (a mid-run switch to one would stop the run); a model whose heads the pool does not divide is
    refused when the run starts, not at its first long row."""
    dyn = Planner(_cfg(tmp_path, "trainer.dynamic_sp_tokens=1024")).trainer
    assert dyn is not None and dyn.allow_fsdp and not (dyn.allow_tp or dyn.allow_sp or dyn.allow_ep)
    assert {layout_name(p) for p in dyn.layouts(4096)} <= {"dp2", "dp2+rc", "fsdp2", "fsdp2+rc"}
    (tmp_path / "smollm2").mkdir()
    with pytest.raises(ConfigError, match=r"dynamic_sp_tokens.*9 attention heads"):
        Planner(_cfg(tmp_path / "smollm2", "trainer.dynamic_sp_tokens=1024", model=SMOLLM2))

def test_refused_layouts_are_in_the_status(tmp_path: Path) -> None:
    status = Planner(_cfg(tmp_path, f"selector.trainer_memory_bytes={4096 * MIB}", model=SMOLLM2)).status()
    assert [r["plan"] for r in status["refused"]] == ["sp2", "tp2"]
    assert "num_attention_heads=9 is not divisible by tp*sp=2" in status["refused"][1]["reason"]
    assert status["trainer"]["name"] in ("dp2", "fsdp2")


def _rows(prompt: P.Prompt, tokens: int) -> list[SampleMeta]:
    return [SampleMeta(schema_version=SCHEMA_VERSION, sample_id=f"{prompt.group_id}-{i}",
                       prompt_ordinal=prompt.prompt_ordinal, episode_id=str(i), group_id=prompt.group_id,
                       env=prompt.env, turns=1, prompt_tokens=3, response_tokens=tokens - 3, total_tokens=tokens,
                       reward=float(i), advantage=None, policy_version_min=0, policy_version_max=0, producer_id="w",
                       producer_address="127.0.0.1:1", checksum=0, created_at=time.time(), info_json="{}")
            for i in range(prompt.group_size)]


def _wire(sup: Supervisor, msg: P.Msg) -> Any:
    """One request through the supervisor, both ways over the wire encoding."""
    return P.decode(P.encode(sup.handle(P.decode(P.encode(msg)), time.monotonic())))


def test_plans_travel_are_adopted_and_survive_a_supervisor_restart(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "trainer.groups_per_step=8", "trainer.group_size=2")
    sup = Supervisor(cfg)
    rollout = _wire(sup, P.Register(role=P.Role.ROLLOUT, host="h", pid=1, shard_address="127.0.0.1:1")).worker_id
    trainer = _wire(sup, P.Register(role=P.Role.TRAINER, host="h", pid=2, rank=0)).worker_id
    beat = _wire(sup, P.Heartbeat(worker_id=rollout))
    assert isinstance(beat.plan, P.RolloutPlan) and beat.plan.version == 1 and beat.plan.design_seq_len == 256
    for prompt in _wire(sup, P.RequestPrompts(worker_id=rollout, max_groups=8)).prompts:
        _wire(sup, P.PutMeta(worker_id=rollout, rows=_rows(prompt, 700)))
    claimed = _wire(sup, P.Claim(worker_id=trainer, step=0, num_groups=8))
    plan = claimed.plan
    assert claimed.ready and isinstance(plan, P.TrainerPlan)
    assert plan.version == 2 and plan.design_seq_len == 1024 and "p99 context 700" in plan.reason
    assert isinstance(_wire(sup, P.PlanAdopted(worker_id=trainer, version=plan.version, step=0)), P.Ack)
    _wire(sup, P.PlanAdopted(worker_id=trainer, version=plan.version, step=0))  # a retry: recorded once
    status = json.loads(_wire(sup, P.StatusRequest()).status_json)["plans"]
    current = status["trainer"]
    assert {k: current[k] for k in ("version", "dp", "fsdp", "tp", "sp", "micro_batch_tokens", "recompute", "name",
                                    "design_seq_len", "reason")} == {
        "version": 2, "dp": plan.dp, "fsdp": plan.fsdp, "tp": plan.tp, "sp": plan.sp,
        "micro_batch_tokens": plan.micro_batch_tokens, "recompute": plan.recompute, "name": plan.name,
        "design_seq_len": 1024, "reason": plan.reason}
    assert status["trainer_history"] == [{"version": 2, "step": 0, "plan": plan.to_dict(), "reason": plan.reason}]
    assert status["trainer_history"][0]["plan"]["name"] == plan.name

    again = Supervisor(cfg)  # restarted from the write-ahead state
    again.restore(sup.snapshot(), time.monotonic())
    restored = json.loads(_wire(again, P.StatusRequest()).status_json)["plans"]
    assert restored["trainer_history"] == status["trainer_history"] and restored["trainer"] == current
    assert _wire(again, P.Heartbeat(worker_id=rollout)).plan == _wire(sup, P.Heartbeat(worker_id=rollout)).plan
    _wire(again, P.PlanAdopted(worker_id=trainer, version=9, step=4))  # not a version we sent: kept, unnamed
    last = json.loads(_wire(again, P.StatusRequest()).status_json)["plans"]["trainer_history"][-1]
    assert last == {"version": 9, "step": 4, "plan": None, "reason": ""}
    # a snapshot written before plans were persisted still restores (the plans start afresh)
    old = msgspec.msgpack.decode(sup.snapshot())
    del old["plans"]
    fresh = Supervisor(cfg)
    fresh.restore(msgspec.msgpack.encode(old), time.monotonic())
    assert fresh.planner.trainer_history == [] and fresh.planner.trainer_wire is not None


def test_a_restored_plan_the_pool_cannot_run_is_replaced_by_a_later_version(tmp_path: Path) -> None:
    two = Planner(_cfg(tmp_path))
    two.stats.add_many([700] * 16)
    two.on_step(1)
    assert two.trainer_wire is not None and two.trainer_wire.version == 2 and two.trainer_wire.world == 2
    same = Planner(_cfg(tmp_path))
    same.restore(two.snapshot())
    assert same.trainer_wire == two.trainer_wire and same.rollout_wire == two.rollout_wire
    one = Planner(_cfg(tmp_path, "trainer.nproc=1", f"selector.trainer_memory_bytes={2000 * MIB}"))  # resumed on one rank
    one.restore(two.snapshot())
    assert one.trainer_wire is not None and one.trainer_wire.version == 3 and one.trainer_wire.world == 1
    assert one.trainer_wire.reason.startswith("resumed after plan v2 (not admissible here)")
