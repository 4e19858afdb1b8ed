"""The ledger and the supervisor under lost replies and retries: a RequestPrompts answered twice,
rows sent twice, a release repeated, trained steps served again until a checkpoint holds them, steps
journaled once checkpointed, and the accounting through it all (produced = consumed + lost + stale +
waiting + claimed)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from earl_stream import protocol as P
from earl_stream.config import EnvSpec, RunConfig, replace
from earl_stream.store.schema import SCHEMA_VERSION, SampleMeta, table_from_ipc, table_to_metas
from earl_stream.supervisor.ledger import Ledger
from earl_stream.supervisor.serve import _write_journal
from earl_stream.supervisor.server import Supervisor


def _ledger() -> Ledger:
    return Ledger([EnvSpec()], seed=0, group_size=2, groups_per_step=2, max_staleness=1)


def _rows(prompt: P.Prompt, producer: str = "127.0.0.1:1") -> list[SampleMeta]:
    return [SampleMeta(schema_version=SCHEMA_VERSION, sample_id=f"{prompt.group_id}-{i}", prompt_ordinal=prompt.prompt_ordinal,
                       episode_id=str(i), group_id=prompt.group_id, env=prompt.env, turns=1, prompt_tokens=3,
                       response_tokens=2, total_tokens=5, reward=float(i), advantage=None, policy_version_min=0,
                       policy_version_max=0, producer_id="w", producer_address=producer, checksum=0,
                       created_at=time.time(), info_json="{}")
            for i in range(prompt.group_size)]


def _adds_up(led: Ledger) -> None:
    c = led.counters
    assert c.samples_produced == (c.samples_consumed + c.samples_lost + c.samples_stale + led.samples_waiting()
                                  + led.samples_claimed())


def test_a_retried_request_gets_the_same_prompts_and_nothing_new() -> None:
    led = _ledger()
    first = led.issue("w", 1, request_id="0.0")
    again = led.issue("w", 1, request_id="0.0")  # the reply to the first was lost; the worker retried
    assert first == again and len(first) == 1
    assert led.counters.requests_repeated == 1 and led.counters.prompts_issued == 1
    other = led.issue("w", 1, request_id="1.0")
    assert other[0].prompt_ordinal == first[0].prompt_ordinal + 1
    # no prompt is left INFLIGHT without a holder: both groups finish and are claimable
    for p in first + other:
        led.add_rows("w", _rows(p))
    assert led.claim(0, 2, 0)[0] is not None
    assert led.outstanding_groups() == 0
    # a very late retry, once the group is no longer held, gets nothing (not a fresh prompt)
    assert led.issue("w", 1, request_id="0.0") == []
    _adds_up(led)


def test_request_ids_are_per_worker_bounded_and_survive_a_restart() -> None:
    led = _ledger()
    a = led.issue("w1", 1, request_id="0.0")
    b = led.issue("w2", 1, request_id="0.0")  # the same id from another worker is another request
    assert a != b
    copy = _ledger()
    copy.restore(led.snapshot())  # the supervisor answered, persisted, and died before the reply left
    assert copy.issue("w1", 1, request_id="0.0") == a
    for n in range(1, 200):
        led.issue("w1", 0, request_id=f"0.{n}")
    assert len(led.requests["w1"]) <= 64
    led.worker_lost("w1", "h:1")  # its prompts are re-issued to others; its retries get nothing
    assert "w1" not in led.requests


def test_rows_sent_twice_are_counted_once_and_are_no_duplicates() -> None:
    led = _ledger()
    (p,) = led.issue("w", 1, request_id="0.0")
    rows = _rows(p)
    led.add_rows("w", rows[:1])
    led.add_rows("w", rows[:1])  # a PutMeta retried after its reply was lost
    led.add_rows("w", rows)
    led.add_rows("w", rows)  # the group is READY now; the copy changes nothing
    assert led.counters.samples_produced == 2 and led.counters.duplicates_detected == 0
    assert led.samples_waiting() == 2
    _adds_up(led)


def test_release_journals_each_step_once_with_lost_groups_apart(tmp_path: Path) -> None:
    led = _ledger()
    prompts = led.issue("w", 4)
    for p in prompts:
        led.add_rows("w", _rows(p))
    metas = table_to_metas(table_from_ipc(led.claim(0, 2, 0)[0]))
    led.claim(1, 2, 0)
    assert led.samples_claimed() == 8
    _adds_up(led)
    # a non-zero rank's lost sample reaches the release (the trainer max-reduces every rank's losses)
    led.release(0, lost_sample_ids=[metas[-1].sample_id])
    led.release(0, lost_sample_ids=[metas[-1].sample_id])  # repeated: no-op
    led.release(1)
    assert led.counters.samples_lost == 2 and led.counters.samples_consumed == 6
    assert led.journal == [{"step": 0, "trained": [metas[0].prompt_ordinal], "lost": [metas[-1].prompt_ordinal]},
                           {"step": 1, "trained": [2, 3], "lost": []}]
    _adds_up(led)
    sup = Supervisor(RunConfig())
    sup.ledger = led
    _write_journal(sup, tmp_path / "trained.jsonl")
    lines = [json.loads(x) for x in (tmp_path / "trained.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [0, 1] and led.journal == []


def test_trained_steps_count_at_once_and_are_served_again_until_checkpointed() -> None:
    led = _ledger()
    for p in led.issue("w", 4):
        led.add_rows("w", _rows(p))
    ipc0, ipc1 = led.claim(0, 2, 0)[0], led.claim(1, 2, 0)[0]
    step1 = table_to_metas(table_from_ipc(ipc1))
    assert led.samples_claimed() == 8 and led.samples_uncheckpointed() == 0
    led.trained(0)
    frees = led.trained(1, lost_sample_ids=[step1[0].sample_id])  # one group of step 1 could not be pulled
    assert frees == {"127.0.0.1:1": [m.sample_id for m in step1 if m.group_id == step1[0].group_id]}
    c = led.counters
    assert (c.samples_consumed, c.samples_lost, c.prompts_reissued) == (6, 2, 1)
    assert led.samples_claimed() == 0 and led.samples_uncheckpointed() == 6
    _adds_up(led)
    # the trainer dies; its checkpoint holds neither step: both are served again, step 1 without its lost group
    assert led.claim(0, 2, 0)[0] == ipc0
    replay1 = table_to_metas(table_from_ipc(led.claim(1, 2, 0)[0]))
    assert [m.sample_id for m in replay1] == [m.sample_id for m in step1 if m.group_id != step1[0].group_id]
    led.trained(0)  # trained again into the resumed model: counted once
    # the producer of step 1's other group died meanwhile: consumed becomes lost, the prompt is played again
    led.trained(1, lost_sample_ids=[replay1[0].sample_id])
    assert (c.samples_consumed, c.samples_lost, c.prompts_reissued) == (4, 4, 2)
    _adds_up(led)
    led.release(0)
    led.release(1)
    assert [(e["step"], len(e["trained"]), len(e["lost"])) for e in led.journal] == [(0, 2, 0), (1, 0, 2)]
    assert led.samples_uncheckpointed() == 0 and not led.claims and not led.trained_steps
    copy = _ledger()
    copy.restore(led.snapshot())
    assert copy.counters == led.counters
    _adds_up(led)


def test_supervisor_answers_a_retried_request_with_the_same_prompts() -> None:
    cfg = replace(RunConfig(), "trainer.group_size=2", "trainer.groups_per_step=2")
    sup = Supervisor(cfg)
    reg = sup.handle(P.Register(role=P.Role.ROLLOUT, host="h", pid=1, shard_address="h:1"), 0.0)
    req = P.RequestPrompts(worker_id=reg.worker_id, max_groups=1, request_id="3.7")
    first = sup.handle(req, 0.1)
    second = sup.handle(req, 5.0)
    assert first.prompts == second.prompts and len(first.prompts) == 1
    status = sup.status(5.0)
    assert status["workers"][0]["groups_held"] == 1 and status["requests_repeated"] == 1
    assert status["samples_claimed"] == 0 and status["samples_uncheckpointed"] == 0
