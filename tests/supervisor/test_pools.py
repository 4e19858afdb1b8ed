"""The elastic rollout pool in the supervisor: which workers drain, that a draining worker gets no
prompts and is told to leave only once every sample it produced is trained and released, and that a
scale-up cancels drains before asking for new workers."""

from __future__ import annotations

import json
import time

import msgspec
import pytest

from earl_stream import protocol as P
from earl_stream.config import load_config
from earl_stream.store.schema import SCHEMA_VERSION, SampleMeta
from earl_stream.supervisor.pools import Member, decide
from earl_stream.supervisor.server import Supervisor


def test_decide_drains_the_least_loaded_latest_first() -> None:
    members = [Member("rollout-0", False, 3, 0), Member("rollout-1", False, 0, 1), Member("rollout-2", False, 0, 2)]
    d = decide(members, 1)
    assert d.drain == ["rollout-2", "rollout-1"] and d.undrain == [] and d.to_start == 0
    assert decide(members, 3).drain == [] and decide(members, 3).to_start == 0
    assert decide(members, 5).to_start == 2
    with pytest.raises(ValueError, match="replicas=-1"):
        decide(members, -1)


def test_decide_scale_up_cancels_drains_first() -> None:
    members = [Member("rollout-0", False, 1, 0), Member("rollout-1", True, 0, 1), Member("rollout-2", True, 2, 2)]
    d = decide(members, 2)
    assert d.undrain == ["rollout-2"] and d.to_start == 0  # the one holding most is furthest from leaving
    d = decide(members, 4)
    assert d.undrain == ["rollout-2", "rollout-1"] and d.to_start == 1


def _rows(prompt: P.Prompt, producer: str) -> list[SampleMeta]:
    return [SampleMeta(schema_version=SCHEMA_VERSION, sample_id=f"{prompt.group_id}-{i}", prompt_ordinal=prompt.prompt_ordinal,
                       episode_id=str(i), group_id=prompt.group_id, env=prompt.env, turns=1, prompt_tokens=3,
                       response_tokens=2, total_tokens=5, reward=float(i), advantage=None, policy_version_min=0,
                       policy_version_max=0, producer_id="w", producer_address=producer, checksum=0,
                       created_at=time.time(), info_json="{}")
            for i in range(prompt.group_size)]


def test_scale_down_drains_without_losing_anything() -> None:
    cfg = load_config(overrides=["trainer.groups_per_step=1", "trainer.group_size=2", "model.path=/nonexistent"])
    sup = Supervisor(cfg)
    now = 0.0
    ids = [sup.handle(P.Register(role=P.Role.ROLLOUT, shard_address=f"127.0.0.1:{9000 + i}"), now).worker_id
           for i in range(2)]
    held = sup.handle(P.RequestPrompts(worker_id=ids[1], max_groups=1, request_id="a"), now).prompts
    assert len(held) == 1
    # rollout-0 holds nothing: it is the one to drain
    reply = sup.handle(P.Scale(role=P.Role.ROLLOUT, replicas=1), now)
    assert isinstance(reply, P.ScaleReply) and reply.draining == [ids[0]] and reply.active == 1
    hb = sup.handle(P.Heartbeat(worker_id=ids[0]), now)
    assert hb.stop and hb.drained  # nothing held: it leaves at once
    assert sup.handle(P.Heartbeat(worker_id=ids[0]), now).drained  # a retried heartbeat: leave again, not re-register
    # now drain the one holding a group: it finishes it, stays while its samples wait, leaves once released
    reply = sup.handle(P.Scale(role=P.Role.ROLLOUT, replicas=0), now)
    assert reply.draining == [ids[1]] and reply.to_start == 0
    assert sup.handle(P.RequestPrompts(worker_id=ids[1], max_groups=1, request_id="b"), now).prompts == []
    hb = sup.handle(P.Heartbeat(worker_id=ids[1]), now)
    assert hb.drain and not hb.stop
    sup.handle(P.PutMeta(worker_id=ids[1], rows=_rows(held[0], "127.0.0.1:9001")), now)
    assert not sup.handle(P.Heartbeat(worker_id=ids[1]), now).stop  # its samples wait to be trained
    assert sup.handle(P.Claim(step=0, num_groups=1), now).ready
    sup.handle(P.Release(step=0, checkpointed=False), now)
    assert not sup.handle(P.Heartbeat(worker_id=ids[1]), now).stop  # trained, not in a checkpoint yet
    status = json.loads(sup.handle(P.StatusRequest(), now).status_json)
    assert [w["draining"] for w in status["workers"]] == [False, True]
    assert status["pools"]["rollout"] == {"desired": 0, "active": 0, "draining": 1, "drained": 1}
    sup.handle(P.Release(step=0, checkpointed=True), now)
    hb = sup.handle(P.Heartbeat(worker_id=ids[1]), now)
    assert hb.stop and hb.drained and sorted(hb.free_sample_ids) == [f"{held[0].group_id}-{i}" for i in range(2)]
    status = json.loads(sup.handle(P.StatusRequest(), now).status_json)
    assert status["samples_lost"] == 0 and status["prompts_reissued"] == 0 and status["samples_consumed"] == 2
    assert all(w["drained"] and not w["alive"] for w in status["workers"])
    # leases do not turn a worker that left into a dead one
    sup.check_leases(now + 1e6)
    assert sup.ledger.counters.samples_lost == 0
    # scale up: nothing draining to cancel, two to start; the desired size survives a restart
    reply = sup.handle(P.Scale(role=P.Role.ROLLOUT, replicas=2), now)
    assert reply.to_start == 2 and reply.undrained == []
    again = Supervisor(cfg)
    again.restore(sup.snapshot(), now)
    assert json.loads(again.handle(P.StatusRequest(), now).status_json)["pools"]["rollout"]["desired"] == 2


def test_scale_refuses_the_trainer_and_negative_sizes() -> None:
    sup = Supervisor(load_config(overrides=["model.path=/nonexistent"]))
    assert "only the rollout pool" in sup.handle(P.Scale(role=P.Role.TRAINER, replicas=2), 0.0).message
    assert "replicas=-1" in sup.handle(P.Scale(replicas=-1), 0.0).message
    # on the wire the message round-trips as a typed struct
    assert P.decode(P.encode(P.Scale(replicas=3))) == P.Scale(replicas=3)
    assert msgspec.structs.asdict(P.ScaleReply())["to_start"] == 0


def test_a_drained_worker_that_registers_again_stays_gone() -> None:
    """A worker drained before its start-up finished registers once more (with its id): it must not come back
    as an active member (a live run kept such a worker training instead of leaving), and it leaves at its next
    heartbeat."""
    sup = Supervisor(load_config(overrides=["model.path=/nonexistent"]))
    for i in range(2):
        sup.handle(P.Register(role=P.Role.ROLLOUT, shard_address=f"127.0.0.1:{9000 + i}"), 0.0)
    (leaving,) = sup.handle(P.Scale(role=P.Role.ROLLOUT, replicas=1), 0.0).draining
    assert sup.handle(P.Heartbeat(worker_id=leaving), 0.0).drained
    again = sup.handle(P.Register(role=P.Role.ROLLOUT, shard_address="127.0.0.1:9001", worker_id=leaving), 1.0)
    assert again.worker_id == leaving
    hb = sup.handle(P.Heartbeat(worker_id=leaving), 1.0)
    assert hb.stop and hb.drained
    status = json.loads(sup.handle(P.StatusRequest(), 1.0).status_json)
    assert status["pools"]["rollout"]["active"] == 1
    assert [w["drained"] and not w["alive"] for w in status["workers"] if w["id"] == leaving] == [True]


def test_a_worker_that_stops_beating_after_the_run_finished_is_gone_not_dead(caplog: pytest.LogCaptureFixture) -> None:
    sup = Supervisor(load_config(overrides=["model.path=/nonexistent", "steps=1"]))
    now = time.monotonic()
    wid = sup.handle(P.Register(role=P.Role.TRAINER, host="h", pid=7, rank=0), now).worker_id
    sup.handle(P.Finished(worker_id=wid, reason="1 steps done"), now)
    assert sup.handle(P.Heartbeat(worker_id=wid), now).stop
    with caplog.at_level("INFO", logger="earl_stream.supervisor.server"):
        sup.check_leases(now + 1e6)  # its exit outlasted a lease on a loaded host
    assert "stopped after the run finished: gone" in caplog.text and "missed its lease" not in caplog.text
    assert not [r for r in caplog.records if r.name.endswith("server") and r.levelname == "WARNING"]
