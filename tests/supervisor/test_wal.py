"""The supervisor's write-ahead state (supervisor/wal.py): a supervisor rebuilt from its snapshot and log
holds the same ledger as the one that wrote them, whatever the crash point: before any snapshot, with a
torn last record, after a snapshot whose log was not yet truncated, and with workers declared dead for
their leases in between. Read-only messages are never logged."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import msgspec

from earl_stream import protocol as P
from earl_stream.config import load_config
from earl_stream.store.schema import SCHEMA_VERSION, SampleMeta
from earl_stream.supervisor.server import Supervisor, SupervisorState
from earl_stream.supervisor.wal import LOG_FILE, StateLog

CFG = load_config(overrides=["trainer.groups_per_step=1", "trainer.group_size=2", "model.path=/nonexistent"])


def _rows(prompt: P.Prompt, producer: str) -> list[SampleMeta]:
    return [SampleMeta(schema_version=SCHEMA_VERSION, sample_id=f"{prompt.group_id}-{i}", prompt_ordinal=prompt.prompt_ordinal,
                       episode_id=str(i), group_id=prompt.group_id, env=prompt.env, turns=1, prompt_tokens=3,
                       response_tokens=2, total_tokens=5, reward=float(i), advantage=None, policy_version_min=0,
                       policy_version_max=0, producer_id="w", producer_address=producer, checksum=0,
                       created_at=1.0, info_json="{}")
            for i in range(prompt.group_size)]


def _send(sup: Supervisor, state: StateLog, msg: P.Msg) -> P.Msg:
    reply = sup.handle(msg, 0.0)
    state.append_message(msg, P.encode(msg))
    return reply


def _story(sup: Supervisor, state: StateLog) -> None:
    """Two rollout workers and a trainer: prompts, rows, a claim and release, one worker lost to its lease."""
    a = _send(sup, state, P.Register(role=P.Role.ROLLOUT, shard_address="127.0.0.1:9000")).worker_id
    b = _send(sup, state, P.Register(role=P.Role.ROLLOUT, shard_address="127.0.0.1:9001")).worker_id
    t = _send(sup, state, P.Register(role=P.Role.TRAINER)).worker_id
    for worker, address in ((a, "127.0.0.1:9000"), (b, "127.0.0.1:9001")):
        for prompt in _send(sup, state, P.RequestPrompts(worker_id=worker, max_groups=2, request_id=worker)).prompts:
            _send(sup, state, P.PutMeta(worker_id=worker, rows=_rows(prompt, address)))
    _send(sup, state, P.StatusRequest())  # read-only: not logged
    claimed = _send(sup, state, P.Claim(worker_id=t, step=0, num_groups=1))
    assert isinstance(claimed, P.Claimed)
    # b misses its lease: the serve loop logs the event
    sup.workers[b].last_seen = -100.0
    sup.check_leases(now=float(CFG.supervisor.lease_s) + 1)
    for worker_id, why in sup.expired:
        state.append_lease_expired(worker_id, why)
    sup.expired.clear()
    assert not sup.workers[b].alive


def _ledger_of(sup: Supervisor) -> tuple[bytes, int, list[tuple[str, bool]]]:
    state = msgspec.msgpack.decode(sup.snapshot(), type=SupervisorState)
    return state.ledger, state.policy_version, sorted((w.worker_id, w.alive) for w in state.workers)


def _recovered(state_dir: Path) -> Supervisor:
    sup = Supervisor(CFG)
    StateLog(state_dir).recover(sup, time.monotonic())
    return sup


def test_a_supervisor_rebuilt_from_the_log_alone_holds_the_same_ledger(tmp_path: Path) -> None:
    sup, state = Supervisor(CFG), StateLog(tmp_path / "s")
    state.recover(sup, 0.0)
    _story(sup, state)
    state.commit()  # no snapshot yet: everything is in the log
    assert state.stats.records == 3 + 2 + 4 + 1 + 1  # registers, requests, rows, claim, lease expiry; no status
    copy = tmp_path / "crash"
    shutil.copytree(tmp_path / "s", copy)
    again = _recovered(copy)
    assert _ledger_of(again) == _ledger_of(sup)
    assert again.ledger.counters == sup.ledger.counters and again._ids == sup._ids


def test_a_torn_last_record_ends_the_log(tmp_path: Path) -> None:
    sup, state = Supervisor(CFG), StateLog(tmp_path / "s")
    state.recover(sup, 0.0)
    _story(sup, state)
    state.commit()
    expected = _ledger_of(sup)
    with (tmp_path / "s" / LOG_FILE).open("ab") as f:  # a crash mid-append of one more message
        f.write(P.encode(P.Register(role=P.Role.ROLLOUT))[:5])
    assert _ledger_of(_recovered(tmp_path / "s")) == expected


def test_a_snapshot_whose_log_was_not_truncated_is_not_applied_twice(tmp_path: Path) -> None:
    sup, state = Supervisor(CFG), StateLog(tmp_path / "s")
    state.recover(sup, 0.0)
    _story(sup, state)
    state.commit()
    old_log = (tmp_path / "s" / LOG_FILE).read_bytes()
    state.snapshot(sup)
    more = _send(sup, state, P.Register(role=P.Role.ROLLOUT, shard_address="127.0.0.1:9002")).worker_id
    _send(sup, state, P.RequestPrompts(worker_id=more, max_groups=1, request_id="m"))
    state.commit()
    expected = _ledger_of(sup)
    assert _ledger_of(_recovered(tmp_path / "s")) == expected  # snapshot + the two records after it
    # a crash between the snapshot's rename and the log's truncation: the old records come back before
    # the new ones; those the snapshot holds are skipped by their sequence numbers
    log = tmp_path / "s" / LOG_FILE
    log.write_bytes(old_log + log.read_bytes())
    assert _ledger_of(_recovered(tmp_path / "s")) == expected


def test_snapshots_come_by_record_count_and_bytes_per_message_stay_small(tmp_path: Path) -> None:
    sup, state = Supervisor(CFG), StateLog(tmp_path / "s", snapshot_records=5)
    state.recover(sup, 0.0)
    _story(sup, state)
    state.maybe_snapshot(sup)
    assert state.stats.snapshots == 1 and (tmp_path / "s" / LOG_FILE).stat().st_size == 0
    per_record = state.stats.bytes_logged / state.stats.records
    assert per_record < len(sup.snapshot())  # a record is a message, not the state
