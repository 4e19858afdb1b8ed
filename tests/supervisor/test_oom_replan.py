"""The supervisor's answer to a trainer step that failed to allocate (`protocol.TrainerOom`,
`supervisor.oom_replan`): the failed layout's predictions are corrected (that layout's only), the next plan
is more frugal and one the corrected model says holds the step, the claim of the step keeps its rows and
carries the new plan, the record is in the status and survives a restart. When no plan holds the step's
longest rows any more, those rows are refused (`samples_too_long`, with the reason, never trained, also after a
restart replayed from the write-ahead log) and the rest retry under a plan that holds them; when no row fits,
every row is refused and the step is claimed afresh. In-process: the Supervisor's message handler, no sockets."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import pytest

from earl_stream import metrics as M
from earl_stream import protocol as P
from earl_stream.config import load_config
from earl_stream.errors import ConfigError
from earl_stream.store.schema import SCHEMA_VERSION, SampleMeta, table_from_ipc, table_to_metas
from earl_stream.supervisor.fitting import check_fit
from earl_stream.supervisor.selector import layout_name
from earl_stream.supervisor.server import Supervisor
from earl_stream.supervisor.wal import StateLog

MIB = 1 << 20
SMALL = {"model_type": "qwen2", "hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8,
         "num_key_value_heads": 2, "intermediate_size": 1536, "vocab_size": 32000}


def _sup(tmp_path: Path, *overrides: str) -> Supervisor:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(SMALL))
    return Supervisor(load_config(None, [f"model.path={tmp_path}", f"run_dir={tmp_path / 'run'}", "trainer.nproc=1",
                                         "trainer.groups_per_step=4", "trainer.group_size=2",
                                         "selector.initial_seq_len=256", "selector.reserve_bytes=0",
                                         f"selector.trainer_memory_bytes={4096 * MIB}", *overrides]))


def _wire(sup: Supervisor, msg: P.Msg) -> Any:
    return P.decode(P.encode(sup.handle(P.decode(P.encode(msg)), time.monotonic())))


def _row(prompt: P.Prompt, i: int, tokens: int) -> SampleMeta:
    return SampleMeta(schema_version=SCHEMA_VERSION, sample_id=f"{prompt.group_id}-{i}", prompt_ordinal=prompt.prompt_ordinal,
                      episode_id=str(i), group_id=prompt.group_id, env=prompt.env, turns=1, prompt_tokens=3,
                      response_tokens=tokens - 3, total_tokens=tokens, reward=float(i), advantage=None,
                      policy_version_min=0, policy_version_max=0, producer_id="w", producer_address="127.0.0.1:1",
                      checksum=0, created_at=time.time(), info_json="{}")


def _put(sup: Supervisor, rollout: str, tokens: int, longest: int = 0, send: Any = None) -> None:
    """Four groups of two rows of `tokens` tokens; with `longest`, the first group's second row has that many."""
    send = send or _wire
    for prompt in send(sup, P.RequestPrompts(worker_id=rollout, max_groups=4)).prompts:
        rows = [_row(prompt, i, longest if longest and (prompt.prompt_ordinal, i) == (0, 1) else tokens)
                for i in range(prompt.group_size)]
        send(sup, P.PutMeta(worker_id=rollout, rows=rows))


def _claimed(sup: Supervisor, tokens: int, longest: int = 0, send: Any = None) -> tuple[str, P.Claimed]:
    send = send or _wire
    rollout = send(sup, P.Register(role=P.Role.ROLLOUT, host="h", pid=1, shard_address="127.0.0.1:1")).worker_id
    trainer = send(sup, P.Register(role=P.Role.TRAINER, host="h", pid=2, rank=0)).worker_id
    _put(sup, rollout, tokens, longest, send)
    claimed = send(sup, P.Claim(worker_id=trainer, step=0, num_groups=4))
    assert claimed.ready and isinstance(claimed.plan, P.TrainerPlan)
    return trainer, claimed


def _rows_of(claimed: P.Claimed) -> dict[str, int]:
    return {m.sample_id: m.total_tokens for m in table_to_metas(table_from_ipc(claimed.table_ipc))}


def _oom(trainer: str, plan: P.TrainerPlan, tokens: int, rows: int = 8) -> P.TrainerOom:
    return P.TrainerOom(worker_id=trainer, step=0, plan_version=plan.version, rows=rows, tokens=rows * tokens,
                        longest=tokens, attempted_bytes=123 * MIB, peak_bytes=0,
                        error="DefaultCPUAllocator: can't allocate memory: you tried to allocate 128974848 bytes.")


def test_an_allocation_failure_corrects_that_plan_and_the_same_rows_retry_under_a_more_frugal_one(
        tmp_path: Path) -> None:
    sup = _sup(tmp_path)
    trainer, claimed = _claimed(sup, 200)
    failed = claimed.plan
    assert failed is not None and failed.micro_batch_tokens >= 8 * 200  # the whole step in one micro-batch

    planner = sup.planner
    assert planner.trainer is not None and planner.trainer_plan is not None
    layout = planner.trainer_plan.plan  # the failed plan's layout, as the memory model sees it
    reply = _wire(sup, _oom(trainer, failed, 200))
    assert isinstance(reply, P.OomReplanned) and reply.plan is not None, reply
    after = reply.plan
    assert after.version == failed.version + 1 and "failed to allocate" in after.reason
    # more frugal: a smaller micro-batch budget, recomputation, or more sharding
    assert after.micro_batch_tokens < failed.micro_batch_tokens or (after.recompute and not failed.recompute)
    assert after.micro_batch_tokens >= 200  # it still holds the step's longest row
    # that layout alone is corrected, so that the micro-batch that failed (8 rows of 200 packed) no longer fits
    corrections = planner.trainer.memory_corrections
    assert list(corrections) == [layout_name(layout)] and corrections[layout_name(layout)] > 1
    packed = dataclasses.replace(layout, micro_batch=1, seq_len=1600)
    budget = planner.trainer.budget_of(packed)
    assert check_fit(planner.shape, packed, 4096 * MIB).fits
    assert not check_fit(planner.shape, packed, budget.memory_bytes_per_device).fits
    assert M.SELECTOR_MEMORY_CORRECTION.labels(layout_name(layout))._value.get() == corrections[layout_name(layout)]

    # the next claim of the step: the same rows, the new plan
    again = _wire(sup, P.Claim(worker_id=trainer, step=0, num_groups=4))
    assert again.table_ipc == claimed.table_ipc and again.plan == after
    # the same report again (a retried call) changes nothing more
    assert _wire(sup, _oom(trainer, failed, 200)).plan == after and dict(corrections) == planner.trainer.memory_corrections

    status = json.loads(_wire(sup, P.StatusRequest()).status_json)["plans"]
    [record] = status["oom_recoveries"]
    assert (record["step"], record["plan_before"], record["version_after"]) == (0, failed.name, after.version)
    assert record["attempted_bytes"] == 123 * MIB and record["predicted_bytes"] > 0
    assert status["memory_corrections"] == corrections

    restarted = Supervisor(sup.cfg)  # the correction and the record survive a supervisor restart
    restarted.restore(sup.snapshot(), time.monotonic())
    assert restarted.planner.trainer is not None and restarted.planner.trainer.memory_corrections == corrections
    assert restarted.planner.trainer_wire == after and len(restarted.planner.oom_recoveries) == 1


def test_rows_no_plan_holds_are_refused_as_too_long_and_the_rest_retry_under_a_plan_that_holds_them(
        tmp_path: Path) -> None:
    sup = _sup(tmp_path)
    state = StateLog(tmp_path / "state")
    state.recover(sup, time.monotonic())

    def send(sup: Supervisor, msg: P.Msg) -> Any:  # as the serve loop does: every accepted message logged
        reply = _wire(sup, msg)
        state.append_message(msg, P.encode(msg))
        return reply

    # seven rows of 200 tokens and one of 4000, which no plan of this 4 GiB rank holds once corrected
    trainer, claimed = _claimed(sup, 200, longest=4000, send=send)
    failed = claimed.plan
    assert failed is not None and sorted(_rows_of(claimed).values()) == [200] * 7 + [4000]
    reply = send(sup, _oom(trainer, failed, 4000))
    assert isinstance(reply, P.OomReplanned) and reply.plan is not None, reply  # the step goes on: no crash
    after = reply.plan
    assert after.version == failed.version + 1 and "refused as samples_too_long" in reply.message, reply.message

    # the long row is refused for good, counted as too long (and filtered: the accounting still balances)
    c = sup.ledger.counters
    assert (c.samples_too_long, c.samples_filtered) == (1, 1)
    assert sup.pending_free["127.0.0.1:1"] == ["g0.0-1"]  # its producer may drop it
    [record] = sup.planner.oom_recoveries
    assert (record.refused_rows, record.refused_tokens, record.rows, record.longest) == (1, 4000, 8, 4000)
    assert "4000 tokens" in record.refused_reason and "bytes per device" in record.refused_reason
    assert record.refused_reason in reply.message and record.version_after == after.version

    # the rest retry at the same step under the new plan, which the corrected model says holds them
    again = send(sup, P.Claim(worker_id=trainer, step=0, num_groups=4))
    assert again.ready and again.plan == after
    assert _rows_of(again) == {k: v for k, v in _rows_of(claimed).items() if k != "g0.0-1"}
    planner = sup.planner
    assert planner.trainer is not None and planner.trainer_plan is not None
    decision = planner.trainer_plan
    assert after.micro_batch_tokens >= 200 and decision.design_seq_len >= 200
    budget = planner.trainer.budget_of(decision.plan)
    for mb in planner.micro_batches([200] * 7):
        assert check_fit(planner.shape, mb, budget.memory_bytes_per_device, reserve_bytes=budget.reserve_bytes).fits
    # the same report again (a retried call) refuses and corrects nothing more
    corrections = dict(planner.trainer.memory_corrections)
    assert send(sup, _oom(trainer, failed, 4000)).plan == after
    assert (c.samples_too_long, len(planner.oom_recoveries), planner.trainer.memory_corrections) == (1, 1, corrections)

    status = json.loads(_wire(sup, P.StatusRequest()).status_json)
    assert status["samples_too_long"] == 1 and status["plans"]["oom_recoveries"][0]["refused_rows"] == 1

    # a supervisor restarted from its write-ahead log does not serve the refused row again
    state.commit()
    restarted = Supervisor(sup.cfg)
    StateLog(tmp_path / "state").recover(restarted, time.monotonic())
    assert restarted.ledger.counters.samples_too_long == 1 and restarted.planner.trainer_wire == after
    assert _rows_of(_wire(restarted, P.Claim(worker_id=trainer, step=0, num_groups=4))) == _rows_of(again)

    # trained once: 7 consumed, the refused one filtered, nothing waiting or lost
    _wire(sup, P.Release(worker_id=trainer, step=0, checkpointed=True))
    assert (c.samples_produced, c.samples_consumed, c.samples_filtered, c.samples_lost) == (8, 7, 1, 0)


def test_when_no_row_fits_every_row_is_refused_and_the_step_is_claimed_afresh(tmp_path: Path) -> None:
    sup = _sup(tmp_path / "tight")
    trainer, claimed = _claimed(sup, 200)
    plan = claimed.plan
    assert plan is not None
    for _ in range(40):  # each failure tightens the failed layout; in the end no plan holds even one row
        reply = _wire(sup, _oom(trainer, plan, 200))
        assert reply.plan is not None, reply  # never "no plan": the pipeline goes on
        if "every row of step 0 refused" in reply.message:
            break
        plan = reply.plan
    else:
        raise AssertionError(f"no row was ever refused: {reply.message}")
    record = sup.planner.oom_recoveries[-1]
    assert (record.refused_rows, record.refused_tokens, record.plan_after) == (8, 1600, "")
    assert "200-200 tokens refused as samples_too_long" in record.refused_reason
    c = sup.ledger.counters
    assert (c.samples_too_long, c.samples_filtered, c.samples_consumed) == (8, 8, 0)
    assert 0 not in sup.ledger.claims and not sup.ledger.groups  # nothing of the step is kept or served again
    assert sorted(sup.pending_free["127.0.0.1:1"]) == sorted(_rows_of(claimed))
    assert sup.planner.trainer is not None
    corrections, records = dict(sup.planner.trainer.memory_corrections), len(sup.planner.oom_recoveries)
    again = _wire(sup, _oom(trainer, plan, 200))  # a retried report: no correction, no record more
    assert again.plan == reply.plan and "no row" in again.message
    assert (sup.planner.trainer.memory_corrections, len(sup.planner.oom_recoveries)) == (corrections, records)

    # the step is claimed afresh: new groups, not the refused ones
    waiting = _wire(sup, P.Claim(worker_id=trainer, step=0, num_groups=4))
    assert not waiting.ready and "samples_too_long" in waiting.waiting
    rollout = next(w for w, worker in sup.workers.items() if worker.role == P.Role.ROLLOUT)
    _put(sup, rollout, 100)
    fresh = _wire(sup, P.Claim(worker_id=trainer, step=0, num_groups=4))
    assert fresh.ready and fresh.plan is not None
    assert set(_rows_of(fresh)).isdisjoint(_rows_of(claimed)) and set(_rows_of(fresh).values()) == {100}


def test_the_selector_off_retries_nothing(tmp_path: Path) -> None:
    off = _sup(tmp_path / "off", "selector.enabled=false")
    trainer, _ = _claimed_off(off)
    reply = _wire(off, P.TrainerOom(worker_id=trainer, step=0, plan_version=0, rows=1, tokens=10, longest=10))
    assert reply.plan is None and "selector is off" in reply.message


def _claimed_off(sup: Supervisor) -> tuple[str, None]:
    trainer = _wire(sup, P.Register(role=P.Role.TRAINER, host="h", pid=2, rank=0)).worker_id
    return trainer, None


def test_a_memory_model_scaled_below_one_adopts_a_plan_the_true_model_says_does_not_fit(tmp_path: Path) -> None:
    """`selector.memory_model_scale` (a debugging knob for benchmarks of allocation failures): the fit checks
    see every prediction x the scale, so a scale < 1 adopts a larger micro-batch than the honest model would,
    one that the honest model says overflows the budget; the learnt reserve compares peaks against the scaled
    prediction (what the fit checks saw)."""
    honest = _sup(tmp_path / "honest").planner
    wrong = _sup(tmp_path / "wrong", "selector.memory_model_scale=0.5").planner
    assert honest.trainer_plan is not None and wrong.trainer_plan is not None and wrong.trainer is not None
    assert wrong.trainer_plan.micro_batch_tokens > honest.trainer_plan.micro_batch_tokens
    bound = dataclasses.replace(wrong.trainer_plan.plan, micro_batch=1, seq_len=wrong.trainer_plan.micro_batch_tokens)
    assert not check_fit(wrong.trainer.shape, bound, 4096 * MIB, reserve_bytes=0).fits
    predicted = 1000 * MIB
    reserve = wrong.trainer.observe_peak(bound, predicted, predicted)  # measured = the honest prediction
    assert reserve >= predicted // 2 - MIB  # the excess over the scaled prediction (500 MiB) is kept free
    with pytest.raises(ConfigError, match="memory_model_scale"):
        _sup(tmp_path / "zero", "selector.memory_model_scale=0")
