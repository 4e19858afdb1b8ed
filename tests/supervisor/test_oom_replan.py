"""The supervisor's answer to a trainer step that failed to allocate (`protocol.TrainerOom`,
`supervisor.oom_replan`): the failed layout's predictions are corrected (that layout's only), the next plan
is more frugal and one the corrected model says holds the step, the claim of the step keeps its rows and
carries the new plan, the record is in the status and survives a restart; when no plan is left, the
answer says so. In-process: the Supervisor's message handler, no sockets."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from earl_stream import metrics as M
from earl_stream import protocol as P
from earl_stream.config import load_config
from earl_stream.store.schema import SCHEMA_VERSION, SampleMeta
from earl_stream.supervisor.memory_model import check_fit
from earl_stream.supervisor.selector import layout_name
from earl_stream.supervisor.server import Supervisor

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


def _claimed(sup: Supervisor, tokens: int) -> tuple[str, P.Claimed]:
    rollout = _wire(sup, P.Register(role=P.Role.ROLLOUT, host="h", pid=1, shard_address="127.0.0.1:1")).worker_id
    trainer = _wire(sup, P.Register(role=P.Role.TRAINER, host="h", pid=2, rank=0)).worker_id
    for prompt in _wire(sup, P.RequestPrompts(worker_id=rollout, max_groups=4)).prompts:
        rows = [SampleMeta(schema_version=SCHEMA_VERSION, sample_id=f"{prompt.group_id}-{i}",
                           prompt_ordinal=prompt.prompt_ordinal, episode_id=str(i), group_id=prompt.group_id,
                           env=prompt.env, turns=1, prompt_tokens=3, response_tokens=tokens - 3, total_tokens=tokens,
                           reward=float(i), advantage=None, policy_version_min=0, policy_version_max=0, producer_id="w",
                           producer_address="127.0.0.1:1", checksum=0, created_at=time.time(), info_json="{}")
                for i in range(prompt.group_size)]
        _wire(sup, P.PutMeta(worker_id=rollout, rows=rows))
    claimed = _wire(sup, P.Claim(worker_id=trainer, step=0, num_groups=4))
    assert claimed.ready and isinstance(claimed.plan, P.TrainerPlan)
    return trainer, claimed


def _oom(trainer: str, plan: P.TrainerPlan, tokens: int) -> P.TrainerOom:
    return P.TrainerOom(worker_id=trainer, step=0, plan_version=plan.version, rows=8, tokens=8 * tokens,
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


def test_no_plan_left_is_said_and_the_selector_off_retries_nothing(tmp_path: Path) -> None:
    sup = _sup(tmp_path / "tight")
    trainer, claimed = _claimed(sup, 200)
    plan = claimed.plan
    assert plan is not None
    for _ in range(40):  # each failure tightens the failed layout; in the end nothing is left
        reply = _wire(sup, _oom(trainer, plan, 200))
        if reply.plan is None:
            break
        plan = reply.plan
    assert reply.plan is None and "no plan fits step 0" in reply.message, reply
    assert sup.planner.oom_recoveries[-1].plan_after == ""

    off = _sup(tmp_path / "off", "selector.enabled=false")
    trainer, _ = _claimed_off(off)
    reply = _wire(off, P.TrainerOom(worker_id=trainer, step=0, plan_version=0, rows=1, tokens=10, longest=10))
    assert reply.plan is None and "selector is off" in reply.message


def _claimed_off(sup: Supervisor) -> tuple[str, None]:
    trainer = _wire(sup, P.Register(role=P.Role.TRAINER, host="h", pid=2, rank=0)).worker_id
    return trainer, None
