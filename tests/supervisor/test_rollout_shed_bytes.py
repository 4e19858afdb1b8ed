"""The rollout memory model corrected by a shed's bytes: the engine's failed allocation (what it asked,
what was in use) says by how much the model was off, and the correction makes that state not fit; without the
bytes (0, or an old peer that does not send them) every shed counts x1.25 as before.

In-process: the RolloutSelector, and the Supervisor's message handler through the wire encoding (no sockets)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

from earl_stream import protocol as P
from earl_stream.config import load_config
from earl_stream.supervisor.decisions import RolloutDecision
from earl_stream.supervisor.model_shape import ModelShape
from earl_stream.supervisor.rollout_memory import ENGINE_MAX_PREFILL_TOKENS
from earl_stream.supervisor.rollout_selector import RolloutSelector, fused_copy_params
from earl_stream.supervisor.selector import PoolBudget
from earl_stream.supervisor.server import Supervisor

MIB = 1 << 20
SMALL = {"model_type": "qwen2", "hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8,
         "num_key_value_heads": 2, "intermediate_size": 1536, "vocab_size": 32000}


def _selector(memory: int = 1200 * MIB, reserve: int = 100 * MIB) -> RolloutSelector:
    shape = ModelShape.from_hf(SMALL)
    return RolloutSelector(shape, PoolBudget(1, memory, reserve), dtype_bytes=4, max_sequences=4096, allow_tp=False,
                           extra_weight_params=fused_copy_params(shape), max_prefill_tokens=ENGINE_MAX_PREFILL_TOKENS)


def test_the_step_is_the_ratio_the_failed_state_was_off_by() -> None:
    sel = _selector()
    fixed = 100 * MIB + sel.weight_bytes()
    model = 1200 * MIB - fixed  # what the plan lets KV and transients fill
    attempted = 64 * MIB

    def step(real: float, sheds: int = 1) -> float:
        return sel.shed_step(sheds, 1, attempted, int(fixed + real) - attempted)[0]

    # it needed 1.5x what the plan allowed (an under-prediction): x1.5 and the margin, whatever the shed count
    assert step(1.5 * model) == pytest.approx(1.5 * 1.05, rel=1e-6)
    assert step(1.5 * model, sheds=3) == pytest.approx(1.5 * 1.05, rel=1e-6)
    # it failed at half of it (the device held less than the budget said): x2 and the margin
    assert step(0.5 * model) == pytest.approx(2 * 1.05, rel=1e-6)
    # failed right at the plan's extent: the margin only; far off: at most four x1.25 steps
    assert step(model) == pytest.approx(1.05, rel=1e-6)
    assert step(20 * model) == pytest.approx(1.25 ** 4)
    # bytes unknown: x1.25 per shed as before (at most four)
    assert sel.shed_step(2, 1, 0, 0)[0] == pytest.approx(1.25 ** 2)
    assert sel.shed_step(9, 1, attempted, 0)[0] == pytest.approx(1.25 ** 4)
    assert sel.shed_step(1, 1, 0, 500 * MIB)[0] == pytest.approx(1.25)


def test_after_the_correction_the_plan_holds_what_the_evidence_says_fits() -> None:
    sel = _selector()
    first = sel.initial(2048)
    assert isinstance(first, RolloutDecision)
    fixed = 100 * MIB + sel.weight_bytes()
    model = 1200 * MIB - fixed
    # the engine failed asking 32 MiB with KV + transients at 1.3x what the plan allowed
    attempted = 32 * MIB
    after = sel.on_sheds(1, "w", attempted_bytes=attempted, in_use_bytes=int(fixed + 1.3 * model) - attempted)
    assert isinstance(after, RolloutDecision) and after.version == first.version + 1
    assert sel.memory_corrections == {"tp1": pytest.approx(1.3 * 1.05, rel=1e-6)}
    assert "MiB asked" in after.reason
    # KV and transients both scaled by c: the budget shrinks by at least c
    assert after.kv_budget_tokens <= first.kv_budget_tokens / (1.3 * 1.05) + 1
    assert after.max_concurrent_sequences <= first.max_concurrent_sequences


def _cfg(tmp_path: Path) -> Any:
    (tmp_path / "config.json").write_text(json.dumps(SMALL))
    return load_config(None, [f"model.path={tmp_path}", f"run_dir={tmp_path / 'run'}", "trainer.nproc=1",
                              "selector.initial_seq_len=256", "selector.reserve_bytes=0",
                              f"selector.trainer_memory_bytes={1600 * MIB}", f"rollout.memory_bytes={1200 * MIB}",
                              "rollout.max_batch_size=4096"])


def test_a_heartbeat_with_the_sheds_bytes_corrects_by_them_and_an_old_peers_by_the_count(tmp_path: Path) -> None:
    sup = Supervisor(_cfg(tmp_path))

    def wire(s: Supervisor, msg: P.Msg | bytes) -> Any:
        data = msg if isinstance(msg, bytes) else P.encode(msg)
        return P.decode(P.encode(s.handle(P.decode(data), time.time())))

    worker = wire(sup, P.Register(role=P.Role.ROLLOUT, host="h", pid=1, shard_address="127.0.0.1:1")).worker_id
    first = wire(sup, P.Heartbeat(worker_id=worker, stats={"oom_sheds": 0.0})).plan
    rollout = sup.planner.rollout
    assert first is not None and rollout is not None
    fixed = rollout.budget.reserve_bytes + rollout.weight_bytes()
    model = rollout.budget.memory_bytes_per_device - fixed
    in_use = int(fixed + 1.6 * model) - 8 * MIB  # two sheds; the latest asked 8 MiB with KV + transients at 1.6x
    shed = wire(sup, P.Heartbeat(worker_id=worker, stats={"oom_sheds": 2.0}, oom_attempted_bytes=8 * MIB,
                                 oom_in_use_bytes=in_use)).plan
    assert shed.version == first.version + 1 and "8.0 MiB asked" in shed.reason
    assert rollout.memory_corrections == {"tp1": pytest.approx(1.6 * 1.05, rel=1e-6)}  # not 1.25 ** 2
    assert shed.kv_budget_tokens < first.kv_budget_tokens

    # a peer that predates the fields: its heartbeat decodes with 0 bytes, and a shed counts x1.25
    old = msgspec.msgpack.encode({"type": "heartbeat", "v": P.PROTOCOL_VERSION, "worker_id": worker,
                                  "stats": {"oom_sheds": 3.0}})
    decoded = P.decode(old)
    assert (decoded.oom_attempted_bytes, decoded.oom_in_use_bytes) == (0, 0)
    more = wire(sup, old).plan
    assert more.version == shed.version + 1
    assert rollout.memory_corrections == {"tp1": pytest.approx(1.6 * 1.05 * 1.25, rel=1e-6)}
