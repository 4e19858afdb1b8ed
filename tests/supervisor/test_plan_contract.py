"""The typed plan contract: `protocol.TrainerPlan` / `RolloutPlan` on the wire (names, sizes, bad plans
refused at decode), and the one conversion from the selector's decisions (`PlanDecision.to_wire`)."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest

from earl_stream import protocol as P
from earl_stream.errors import ConfigError, ProtocolError
from earl_stream.supervisor.decisions import PlanDecision, RolloutDecision
from earl_stream.supervisor.memory_model import Precision, Recompute, TrainPlan


def _plan(**kw: object) -> P.TrainerPlan:
    fields: dict = dict(version=3, dp=1, fsdp=1, tp=1, sp=1, micro_batch_tokens=4096, recompute=False, dtype="fp32",
                        design_seq_len=1024, predicted_peak_bytes=1 << 30, reason="p99 context 900 > 0.9 x 512",
                        step=7)
    return P.TrainerPlan(**{**fields, **kw})


@pytest.mark.parametrize(("degrees", "name"), [
    ({}, "dp1"), ({"dp": 2}, "dp2"), ({"fsdp": 2}, "fsdp2"), ({"tp": 2}, "tp2"), ({"sp": 2}, "sp2"),
    ({"fsdp": 2, "sp": 2}, "fsdp2_sp2"), ({"dp": 2, "tp": 2}, "dp2_tp2"), ({"dp": 2, "fsdp": 2, "tp": 2, "sp": 2},
                                                                            "dp2_fsdp2_tp2_sp2"),
])
def test_trainer_plan_name_world_and_rank_budget(degrees: dict, name: str) -> None:
    plan = _plan(**degrees)
    assert plan.name == name
    d = {"dp": 1, "fsdp": 1, "tp": 1, "sp": 1, **degrees}
    assert plan.world == d["dp"] * d["fsdp"] * d["tp"] * d["sp"] and plan.data_ranks == d["dp"] * d["fsdp"]
    assert plan.rank_micro_batch_tokens == 4096 // d["sp"]
    shown = plan.to_dict()
    assert shown["name"] == name and shown["world"] == plan.world
    assert {k: shown[k] for k in ("dp", "fsdp", "tp", "sp", "micro_batch_tokens", "recompute")} == {
        **{k: d[k] for k in ("dp", "fsdp", "tp", "sp")}, "micro_batch_tokens": 4096, "recompute": False}


def test_plans_cross_the_wire_as_typed_structs() -> None:
    plan = _plan(fsdp=2, sp=2, recompute=True, dtype="bf16")
    claimed = P.decode(P.encode(P.Claimed(step=7, ready=True, plan=plan)))
    assert isinstance(claimed.plan, P.TrainerPlan) and claimed.plan == plan and claimed.plan.name == "fsdp2_sp2"
    assert P.decode(P.encode(P.Claimed(step=7))).plan is None  # not ready: keep yours
    rollout = P.RolloutPlan(version=2, max_concurrent_sequences=8, kv_budget_tokens=8192, design_seq_len=1024,
                            engine_tp=1, replicas=1, reason="first plan", step=3)
    reply = P.decode(P.encode(P.HeartbeatReply(plan=rollout)))
    assert reply.plan == rollout and P.decode(P.encode(P.HeartbeatReply())).plan is None
    adopted = P.decode(P.encode(P.PlanAdopted(worker_id="trainer-0", version=3, step=7)))
    assert (adopted.worker_id, adopted.version, adopted.step) == ("trainer-0", 3, 7)


@pytest.mark.parametrize(("bad", "message"), [
    ({"tp": 0}, "tp=0"), ({"dtype": "fp16"}, "dtype='fp16'"), ({"micro_batch_tokens": 1, "sp": 2}, "< sp=2"),
])
def test_a_bad_plan_never_arrives(bad: dict, message: str) -> None:
    with pytest.raises(ValueError, match="invalid trainer plan"):
        _plan(**bad)
    raw = msgspec.structs.asdict(_plan())
    wire = msgspec.msgpack.encode({"type": "claimed", "v": P.PROTOCOL_VERSION, "step": 1, "ready": True,
                                   "plan": {**raw, **bad}})
    with pytest.raises(ProtocolError, match=message):
        P.decode(wire)


def _decision(**plan_kw: object) -> PlanDecision:
    plan = TrainPlan(micro_batch=2, seq_len=1024, **plan_kw)  # type: ignore[arg-type]
    return PlanDecision(version=4, pool="trainer", plan=plan, micro_batch_tokens=2048, design_seq_len=1024,
                        predicted_peak_bytes=123, predicted_tokens_per_s=1.0, reason="why", step=9)


@pytest.mark.parametrize(("plan_kw", "name"), [
    ({"dp": 2}, "dp2"), ({"dp": 2, "fsdp": True}, "fsdp2"), ({"tp": 2}, "tp2"), ({"sp": 2}, "sp2"),
    ({"dp": 2, "sp": 2, "fsdp": True}, "fsdp2_sp2"), ({"dp": 2, "tp": 2}, "dp2_tp2"),
    ({"dp": 4, "fsdp": True}, "fsdp4"), ({}, "dp1"),
])
def test_a_decision_becomes_the_wire_plan_in_one_place(plan_kw: dict, name: str) -> None:
    d = _decision(**plan_kw)
    wire = d.to_wire()
    assert wire.name == name and wire.world == d.plan.devices and wire.data_ranks == d.plan.dp
    assert (wire.version, wire.micro_batch_tokens, wire.design_seq_len, wire.predicted_peak_bytes, wire.reason,
            wire.step) == (4, 2048, 1024, 123, "why", 9)
    assert wire.rank_micro_batch_tokens == d.rank_micro_batch_tokens and wire.dtype == "fp32" and not wire.recompute


def test_precision_recompute_and_inexpressible_plans() -> None:
    wire = _decision(dp=2, precision=Precision.AUTOCAST_BF16, recompute=Recompute.FULL).to_wire()
    assert wire.dtype == "bf16" and wire.recompute
    with pytest.raises(ConfigError, match="FSDP over the sequence-parallel ranks alone"):
        _decision(sp=2, fsdp=True).to_wire()
    with pytest.raises(ConfigError, match="not something the trainer runs"):
        _decision(dp=2, recompute=Recompute.SELECTIVE).to_wire()
    assert _decision(dp=2, precision=Precision.MIXED_BF16).to_wire().dtype == "bf16"
    with pytest.raises(ConfigError, match="not something the trainer runs"):
        _decision(dp=2, precision=Precision.BF16).to_wire()


def test_rollout_decision_to_wire() -> None:
    d = RolloutDecision(version=2, max_concurrent_sequences=6, kv_budget_tokens=6144, design_seq_len=1024,
                        reason="first plan", engine_tp=2, replicas=2, predicted_peak_bytes=99, step=5)
    wire = d.to_wire()
    assert msgspec.structs.asdict(wire) == {k: v for k, v in dataclasses.asdict(d).items()
                                            if k not in ("predicted_peak_bytes", "pool")}
