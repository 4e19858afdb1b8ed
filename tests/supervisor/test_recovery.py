"""Durable experience in the ledger (`supervisor/recovery.py: recover`): a restarted producer's persisted samples are
taken back only for groups the ledger still waits for, under their original ordinals; nothing is
trained twice and the sample accounting adds up."""

from __future__ import annotations

import json
import time
from pathlib import Path

import msgspec

from earl_stream import protocol as P
from earl_stream.config import EnvSpec, RunConfig, replace
from earl_stream.store.schema import SCHEMA_VERSION, SampleMeta, table_from_ipc, table_to_metas
from earl_stream.supervisor.ledger import Ledger, PromptState
from earl_stream.supervisor.recovery import recover
from earl_stream.supervisor.server import Supervisor
from earl_stream.supervisor.wal import StateLog

OLD, NEW = "127.0.0.1:1", "127.0.0.1:2"


def _ledger() -> Ledger:
    return Ledger([EnvSpec()], seed=0, group_size=2, groups_per_step=2, max_staleness=1)


def _rows(prompt: P.Prompt, producer: str) -> list[SampleMeta]:
    return [SampleMeta(schema_version=SCHEMA_VERSION, sample_id=f"{prompt.group_id}-{i}",
                       prompt_ordinal=prompt.prompt_ordinal, episode_id=str(i), group_id=prompt.group_id,
                       env=prompt.env, turns=1, prompt_tokens=3, response_tokens=2, total_tokens=5, reward=float(i),
                       advantage=None, policy_version_min=0, policy_version_max=0, producer_id="w",
                       producer_address=producer, checksum=100 + i, created_at=time.time(), info_json="{}")
            for i in range(prompt.group_size)]


def _moved(rows: list[SampleMeta]) -> list[SampleMeta]:
    return [msgspec.structs.replace(r, producer_address=NEW, producer_id="w2") for r in rows]


def _adds_up(led: Ledger) -> None:
    c = led.counters
    assert c.samples_produced == (c.samples_consumed + c.samples_lost + c.samples_stale + c.samples_filtered
                                  + led.samples_waiting() + led.samples_claimed())


def _four_groups(led: Ledger) -> list[list[SampleMeta]]:
    rows = []
    for p in led.issue("w", 4):
        rows.append(_rows(p, producer=OLD))
        led.add_rows("w", rows[-1])
    return rows


def test_lost_groups_come_back_ready_under_their_ordinals_and_are_no_longer_lost() -> None:
    led = _ledger()
    rows = _four_groups(led)
    lost = led.worker_lost("w", OLD)
    assert lost == {"samples_lost": 8, "prompts_reissued": 4}
    accepted, refused = recover(led, _moved(rows[0] + rows[1] + rows[2][:1]))  # group 2 incomplete
    assert sorted(accepted) == sorted(r.sample_id for r in rows[0] + rows[1])
    assert refused == [rows[2][0].sample_id]
    c = led.counters
    assert (c.samples_lost, c.prompts_reissued, c.samples_recovered) == (4, 2, 4)
    _adds_up(led)
    # the recovered groups are claimed from the new node, under attempt 0; the others are played again
    ipc, _ = led.claim(0, 2, 0)
    assert ipc is not None
    metas = table_to_metas(table_from_ipc(ipc))
    assert {m.prompt_ordinal for m in metas} == {0, 1} and {m.producer_address for m in metas} == {NEW}
    again = led.issue("w2", 4)
    assert {p.group_id for p in again[:2]} == {"g2.1", "g3.1"}  # the lost ones first, then new prompts
    # a second recovery of the same groups (a retried message) changes nothing
    assert recover(led, _moved(rows[0]))[0] and led.counters.samples_recovered == 4
    # once played again, a persisted copy is refused
    assert recover(led, _moved(rows[2])) == ([], [r.sample_id for r in rows[2]])
    _adds_up(led)


def test_claimed_groups_are_repointed_and_released_ones_refused() -> None:
    led = _ledger()
    rows = _four_groups(led)
    ipc, _ = led.claim(0, 2, 0)
    led.trained(0)
    led.claim(1, 2, 0)
    led.release(0)  # a checkpoint holds step 0: its groups are done
    done = [r for o in (0, 1) for r in rows[o]]
    accepted, refused = recover(led, _moved([r for g in rows for r in g]))
    assert sorted(refused) == sorted(r.sample_id for r in done)
    assert len(accepted) == 4
    claimed = table_to_metas(table_from_ipc(led.claims[1][0]))
    assert {m.producer_address for m in claimed} == {NEW}
    assert all(led.groups[o].state == PromptState.CLAIMED for o in (2, 3))
    assert led.counters.samples_lost == 0 and led.counters.samples_recovered == 4
    _adds_up(led)


def test_other_samples_are_refused() -> None:
    led = _ledger()
    rows = _four_groups(led)
    led.worker_lost("w", OLD)
    forged = [msgspec.structs.replace(r, checksum=r.checksum + 1) for r in _moved(rows[0])]
    renamed = [msgspec.structs.replace(r, sample_id=r.sample_id + "x") for r in _moved(rows[1])]
    accepted, refused = recover(led, forged + renamed)
    assert accepted == [] and len(refused) == 4
    assert led.counters.samples_recovered == 0 and led.counters.samples_lost == 8
    _adds_up(led)


def test_recovery_survives_a_snapshot() -> None:
    led = _ledger()
    rows = _four_groups(led)
    led.worker_lost("w", OLD)
    restored = _ledger()
    restored.restore(led.snapshot())
    accepted, _ = recover(restored, _moved(rows[3]))
    assert len(accepted) == 2 and restored.counters.samples_lost == 6
    _adds_up(restored)


def test_the_supervisor_tells_checkpoints_and_takes_back_recovered_samples() -> None:
    """Over the control plane: heartbeats carry the latest checkpoint; `RecoverSamples` after the
    earlier run's workers were forgotten; run id and checkpoint survive a snapshot; the status adds up."""
    cfg = replace(RunConfig(), "trainer.group_size=2", "trainer.groups_per_step=2")
    sup = Supervisor(cfg)
    reg = sup.handle(P.Register(role=P.Role.ROLLOUT, host="h", pid=1, shard_address=OLD), 0.0)
    assert reg.run_id
    prompts = sup.handle(P.RequestPrompts(worker_id=reg.worker_id, max_groups=3), 0.1).prompts
    rows = [_rows(p, OLD) for p in prompts]
    sup.handle(P.PutMeta(worker_id=reg.worker_id, rows=[r for g in rows for r in g]), 0.2)
    assert sup.handle(P.Claim(worker_id="t", step=0, num_groups=2), 0.3).ready
    sup.handle(P.Release(worker_id="t", step=0), 0.4)
    assert sup.handle(P.Heartbeat(worker_id=reg.worker_id), 0.5).checkpoint_version == 1
    again = Supervisor(cfg)
    again.restore(sup.snapshot(), 1.0)
    assert (again.run_id, again.checkpoint_version) == (sup.run_id, 1)
    again.forget_workers()  # `up --resume`: the group still waiting is counted lost ...
    assert again.status(1.0)["samples_lost"] == again.status(1.0)["samples_replayed_since_resume"] == 2
    assert sup.status(1.0)["samples_replayed_since_resume"] is None  # not a resumed run
    reply = again.handle(P.RecoverSamples(worker_id="rollout-9", rows=_moved([r for g in rows for r in g])), 2.0)
    assert isinstance(reply, P.Recovered) and len(reply.accepted) == 2 and len(reply.refused) == 4  # ... and back
    s = again.status(2.0)
    assert (s["samples_lost"], s["samples_recovered"], s["samples_in_store"], s["duplicates_detected"]) == (0, 2, 2, 0)
    assert s["samples_replayed_since_resume"] == 0
    assert s["samples_produced"] == (s["samples_consumed"] + s["samples_lost"] + s["samples_stale"]
                                     + s["samples_filtered"] + s["samples_in_store"] + s["samples_claimed"])


def test_a_replayed_step_that_could_not_pull_gets_its_groups_back() -> None:
    """`up --resume`: the resumed trainer replays a trained step before the producer is back, cannot pull
    its rows (lost, re-issued); the restarted producer then recovers them: ready again, not re-played."""
    led = _ledger()
    rows = _four_groups(led)
    led.claim(0, 2, 0)
    led.trained(0)  # trained, not checkpointed; then the run stops
    led.worker_lost("w", OLD)  # the groups still ready are lost; the claimed ones wait for the replay
    led.trained(0, [r.sample_id for r in rows[0]])  # the replay could not pull group 0
    assert led.counters.samples_lost == 4 + 2 and led.counters.samples_consumed == 2
    _adds_up(led)
    accepted, refused = recover(led, _moved([r for g in rows for r in g]))
    assert len(accepted) == 8 and refused == []
    assert led.counters.samples_lost == 0 and led.counters.samples_recovered == 8
    assert {r.producer_address for r in led.groups[1].rows} == {NEW}  # still in step 0's claim, re-pointed
    assert {m.producer_address for m in table_to_metas(table_from_ipc(led.claims[0][0]))} == {NEW}
    _adds_up(led)
    led.release(0)
    assert 0 in led.groups and led.groups[0].state == PromptState.READY  # trained later, once


def test_a_recovery_is_replayed_from_the_write_ahead_log(tmp_path: Path) -> None:
    cfg = replace(RunConfig(), "trainer.group_size=2", "trainer.groups_per_step=2")
    sup, state = Supervisor(cfg), StateLog(tmp_path)
    state.recover(sup, 0.0)
    state.snapshot(sup)  # as the serve loop does at start: the run id is on disk from then on

    def send(msg: P.Msg) -> P.Msg:
        reply = sup.handle(msg, 0.0)
        state.append_message(msg, P.encode(msg))
        return reply

    wid = send(P.Register(role=P.Role.ROLLOUT, shard_address=OLD)).worker_id
    rows = [r for p in send(P.RequestPrompts(worker_id=wid, max_groups=2, request_id="a")).prompts for r in _rows(p, OLD)]
    send(P.PutMeta(worker_id=wid, rows=rows))
    sup.declare_dead(sup.workers[wid], "test")
    state.append_lease_expired(wid, "test")
    send(P.RecoverSamples(worker_id="rollout-1", rows=_moved(rows)))
    state.commit()
    again = Supervisor(cfg)
    StateLog(tmp_path).recover(again, 1.0)
    assert again.run_id == sup.run_id and again.ledger.counters == sup.ledger.counters
    assert again.ledger.counters.samples_recovered == 4 and again.ledger.counters.samples_lost == 0


def test_a_worker_leaving_a_finished_run_loses_nothing_until_the_run_is_extended() -> None:
    """Once the run finished, a rollout worker that stops beating leaves: the samples it still holds stay counted
    in the store (it persists them as it stops) and nothing is played again, however long its exit took. Resumed
    for more steps, the relaunched run takes them as lost and plays their prompts again."""
    cfg = replace(RunConfig(), "trainer.group_size=2", "trainer.groups_per_step=2", "steps=1")
    sup, now = Supervisor(cfg), time.monotonic()
    wid = sup.handle(P.Register(role=P.Role.ROLLOUT, shard_address=OLD), now).worker_id
    prompts = sup.handle(P.RequestPrompts(worker_id=wid, max_groups=2, request_id="a"), now).prompts
    sup.handle(P.PutMeta(worker_id=wid, rows=[r for p in prompts for r in _rows(p, OLD)]), now)
    trainer = sup.handle(P.Register(role=P.Role.TRAINER, host="h", pid=7, rank=0), now).worker_id
    sup.handle(P.Finished(worker_id=trainer, reason="1 steps done"), now)
    sup.check_leases(now + 1e6)  # both exits outlasted a lease
    c = sup.ledger.counters
    assert not sup.workers[wid].alive and c.samples_lost == 0 and c.prompts_reissued == 0
    assert json.loads(sup.handle(P.StatusRequest(), now).status_json)["samples_in_store"] == 4
    sup.finished = False  # what a restored state computes when `up --resume` asks for more steps
    sup.forget_workers()
    assert sup.ledger.counters.samples_lost == 4 and sup.ledger.counters.prompts_reissued == 2
