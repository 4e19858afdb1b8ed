"""The supervisor's ledger: prompts, claims, staleness, loss and the sample accounting."""

from __future__ import annotations

import time

import msgspec

from earl_stream.config import EnvSpec
from earl_stream.store.schema import SCHEMA_VERSION, SampleMeta, table_from_ipc, table_to_metas
from earl_stream.supervisor.ledger import Ledger


def _ledger(**kw: int) -> Ledger:
    args = {"seed": 0, "group_size": 2, "groups_per_step": 2, "max_staleness": 1, **kw}
    return Ledger([EnvSpec()], **args)


def _rows(prompt, version: int = 0, producer: str = "127.0.0.1:1") -> list[SampleMeta]:
    return [SampleMeta(schema_version=SCHEMA_VERSION, sample_id=f"{prompt.group_id}-{i}", prompt_ordinal=prompt.prompt_ordinal,
                       episode_id=str(i), group_id=prompt.group_id, env=prompt.env, turns=1, prompt_tokens=3,
                       response_tokens=2, total_tokens=5, reward=float(i), advantage=None, policy_version_min=version,
                       policy_version_max=version, producer_id="w", producer_address=producer, checksum=0,
                       created_at=time.time(), info_json="{}")
            for i in range(prompt.group_size)]


def _check_accounting(led: Ledger) -> None:
    c = led.counters
    assert c.samples_produced == c.samples_consumed + c.samples_lost + c.samples_stale + led.samples_waiting()


def test_issue_is_bounded_by_staleness() -> None:
    led = _ledger()
    prompts = led.issue("w", 10)
    assert len(prompts) == 4  # groups_per_step * (max_staleness + 1)
    assert [p.prompt_ordinal for p in prompts] == [0, 1, 2, 3]
    assert [p.min_policy_version for p in prompts] == [0, 0, 0, 0]  # steps 0 and 1 both accept version 0
    assert len({p.seed for p in prompts}) == 4


def test_synchronous_mode_waits_for_the_next_version() -> None:
    led = _ledger(max_staleness=0)
    prompts = led.issue("w", 10)
    assert len(prompts) == 2 and all(p.min_policy_version == 0 for p in prompts)
    for p in prompts:
        led.add_rows("w", _rows(p))
    assert led.claim(0, 2, 0)[0] is not None
    nxt = led.issue("w", 10)
    assert len(nxt) == 2 and all(p.min_policy_version == 1 for p in nxt)


def test_claim_is_the_same_for_every_rank_and_release_frees() -> None:
    led = _ledger()
    prompts = led.issue("w", 4)
    for p in prompts[:2]:
        led.add_rows("w", _rows(p))
    ipc, _ = led.claim(0, 2, 0)
    again, _ = led.claim(0, 2, 0)
    assert ipc is not None and ipc == again
    metas = table_to_metas(table_from_ipc(ipc))
    assert len(metas) == 4 and {m.prompt_ordinal for m in metas} == {0, 1}
    assert led.claim(1, 2, 0)[0] is None  # nothing else ready yet
    frees = led.release(0)
    assert sorted(frees["127.0.0.1:1"]) == sorted(m.sample_id for m in metas)
    assert led.counters.samples_consumed == 4
    _check_accounting(led)


def test_a_claim_keeps_prompt_order_and_each_group_in_its_producers_order() -> None:
    # Episode ids end in a random part: sorting a group by sample id shuffled it from run to run, and the
    # step's float sums with it (the async-vs-sync invariant of the rloo case failed about one run in two).
    led = _ledger(max_staleness=0, group_size=4)
    prompts = led.issue("w", 2)
    for p in reversed(prompts):  # the later prompt's group finishes first
        rows = _rows(p)
        rows = [msgspec.structs.replace(r, sample_id=f"{p.group_id}-{tag}") for r, tag in zip(rows, "dbca")]
        led.add_rows("w", rows)
    ipc, _ = led.claim(0, 2, 0)
    metas = table_to_metas(table_from_ipc(ipc))
    assert [(m.prompt_ordinal, m.episode_id) for m in metas] == [(o, str(i)) for o in (0, 1) for i in range(4)]


def test_stale_groups_are_refused_and_replayed() -> None:
    led = _ledger()
    prompts = led.issue("w", 2)
    for p in prompts:
        led.add_rows("w", _rows(p, version=0))
    ipc, frees = led.claim(5, 2, min_policy_version=4)
    assert ipc is None and led.counters.samples_stale == 4 and len(frees["127.0.0.1:1"]) == 4
    again = led.issue("w", 2)
    assert sorted(p.prompt_ordinal for p in again) == [0, 1]  # same ordinals: nothing skipped
    assert all(p.group_id.endswith(".1") for p in again)
    _check_accounting(led)


def test_dead_worker_loses_samples_and_prompts_are_reissued() -> None:
    led = _ledger()
    a, b, c = led.issue("w1", 3)
    led.add_rows("w1", _rows(a, producer="h:1"))
    result = led.worker_lost("w1", "h:1")
    assert result == {"samples_lost": 2, "prompts_reissued": 3}
    replay = led.issue("w2", 3)
    assert sorted(p.prompt_ordinal for p in replay) == [0, 1, 2]
    # a late row from the dead worker is a duplicate, not a second sample of the prompt
    led.add_rows("w1", _rows(b, producer="h:1"))
    assert led.counters.duplicates_detected == 2
    _check_accounting(led)


def test_lost_at_pull_time_replays_the_group() -> None:
    led = _ledger()
    prompts = led.issue("w", 2)
    for p in prompts:
        led.add_rows("w", _rows(p))
    ipc, _ = led.claim(0, 2, 0)
    metas = table_to_metas(table_from_ipc(ipc))
    led.release(0, lost_sample_ids=[metas[0].sample_id])
    assert led.counters.samples_lost == 2 and led.counters.samples_consumed == 2
    assert [p.prompt_ordinal for p in led.issue("w", 1)] == [metas[0].prompt_ordinal]
    _check_accounting(led)


def test_snapshot_restore_round_trip() -> None:
    led = _ledger()
    prompts = led.issue("w", 4)
    for p in prompts[:3]:
        led.add_rows("w", _rows(p))
    ipc, _ = led.claim(0, 2, 0)
    copy = _ledger()
    copy.restore(led.snapshot())
    assert copy.claim(0, 2, 0)[0] == ipc
    assert copy.counters == led.counters and copy.ready == led.ready and copy.next_ordinal == 4
    assert copy.groups.keys() == led.groups.keys()
    assert copy.issue("w", 9) == led.issue("w", 9)


def test_prompts_of_a_detached_environment_are_dropped_not_replayed_forever() -> None:
    led = Ledger([EnvSpec(), EnvSpec(spec="broken.py:Broken", name="broken", weight=50.0)], seed=0, group_size=2,
                 groups_per_step=2, max_staleness=1)
    prompts = led.issue("w", 10)
    broken = [p for p in prompts if p.env == "broken"]
    assert broken, "the heavy environment got no prompt"
    # the worker cannot load it: its groups fail and go back to the queue; then the environment is dropped
    led.fail_groups([p.group_id for p in broken])
    led.envs = [EnvSpec()]
    again = led.issue("w", 10)
    assert again and all(p.env == "tictactoe" for p in again)
    assert led.counters.prompts_dropped == len(broken)
    assert not {p.prompt_ordinal for p in broken} & set(led.groups)  # gone from the ledger, not queued
    _check_accounting(led)


def test_groups_backing_off_leave_the_staleness_bound_to_the_other_environments() -> None:
    """A killed environment server's groups wait out their back-off without holding the staleness bound
    (groups_per_step x (staleness + 1) = 4 here): the other environment's prompts fill it, and none is
    drawn from the failing one meanwhile. When every environment is failing, the bound holds as before."""
    led = Ledger([EnvSpec(spec="tictactoe"), EnvSpec(spec="connect_four")], seed=0, group_size=2, groups_per_step=2,
                 max_staleness=1)
    first = led.issue("w", 4, now=100.0)
    assert len(first) == 4 and led.issue("w", 1, now=100.0) == []  # the bound
    dead = [p for p in first if p.env == "connect_four"]
    assert dead, [p.env for p in first]
    led.fail_groups([p.group_id for p in dead], now=100.0)
    fresh = led.issue("w", 4, now=100.5)
    assert len(fresh) == len(dead) and all(p.env == "tictactoe" for p in fresh)
    assert led.issue("w", 1, now=100.5) == []  # still bounded by the groups that are not waiting
    # every environment failing: the waiting groups count again, nothing new is drawn
    led.fail_groups([p.group_id for p in first + fresh if p.env == "tictactoe"], now=100.5)
    assert led.issue("w", 4, now=100.6) == []
    again = led.issue("w", 8, now=200.0)  # the back-offs are over: the same groups, played again
    assert sorted(p.prompt_ordinal for p in again) == sorted(p.prompt_ordinal for p in first + fresh)


def test_groups_an_environment_failed_back_off_and_fresh_prompts_go_first() -> None:
    """A dead environment server fails every episode of its groups: those groups wait out a back-off that
    doubles with each failure, so the rollout slots play other prompts meanwhile instead of retrying them
    back to back (a killed server's three groups once held all three slots of a worker and training
    stopped); once the back-off is over they are played again under the same ordinal."""
    led = _ledger(groups_per_step=4, max_staleness=1)
    first = led.issue("w", 2, now=100.0)
    led.fail_groups([p.group_id for p in first], now=100.0)  # first failure: 1 s back-off
    fresh = led.issue("w", 2, now=100.5)
    assert [p.prompt_ordinal for p in fresh] == [2, 3]
    again = led.issue("w", 2, now=101.0)
    assert sorted((p.prompt_ordinal, p.group_id) for p in again) == [(0, "g0.1"), (1, "g1.1")]
    led.fail_groups(["g0.1"], now=101.0)  # second failure: 2 s
    assert [p.prompt_ordinal for p in led.issue("w", 1, now=102.5)] == [4]
    assert [p.group_id for p in led.issue("w", 1, now=103.0)] == ["g0.2"]
    assert led.counters.prompts_reissued == 3
    # without a clock (the synchronous loop, old callers) a failed group is played again at once
    plain = _ledger()
    p = plain.issue("w", 1)[0]
    plain.fail_groups([p.group_id])
    assert plain.issue("w", 1)[0].group_id == f"g{p.prompt_ordinal}.1"
