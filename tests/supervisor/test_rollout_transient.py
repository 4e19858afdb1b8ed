"""The built-in rollout engine's prefill and decode transients in the rollout memory model, and the correction the
rollout selector learns from the allocation failures the engines shed.

In-process: the memory model, the RolloutSelector, and the Supervisor's message handler (no sockets)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from earl_stream import protocol as P
from earl_stream.config import load_config
from earl_stream.supervisor.memory_model import predict_kv_cache_bytes
from earl_stream.supervisor.model_shape import ModelShape
from earl_stream.supervisor.rollout_memory import ENGINE_MAX_PREFILL_TOKENS, engine_transient, position_elements
from earl_stream.supervisor.rollout_selector import RolloutSelector, fused_copy_params
from earl_stream.supervisor.selector import Infeasible, PoolBudget, RolloutDecision
from earl_stream.supervisor.server import Supervisor

MIB = 1 << 20
SMALL = {"model_type": "qwen2", "hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8,
         "num_key_value_heads": 2, "intermediate_size": 1536, "vocab_size": 32000}
# h 8, I 16, H 2, Hkv 1, D 4, V 10
TOY = ModelShape(hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4, intermediate_size=16,
                 vocab_size=10)


def test_the_transient_is_the_hand_computed_formula_for_a_toy_shape() -> None:
    # per position: attention 4h + 2I + (H + 2Hkv)D + 3(H + Hkv)D + 2HD (GQA) = 32 + 32 + 16 + 36 + 16 = 132;
    # MLP 3h + 4I = 88; + rotary 2D = 8 -> 140 elements
    assert position_elements(TOY) == 140
    t = engine_transient(TOY, design_seq_len=5, rows=3, dtype_bytes=4, max_prefill_tokens=8)
    # prefill: P = min(max(5, 8), 3 x 5) = 8 positions: 8 x 140 x 4 + masks 8 x 5 x (2 + 4) + logits 3 x 10 x (4 + 8)
    assert (t.prefill_positions, t.prefill_bytes) == (8, 4480 + 240 + 360)
    # decode: forward 3 x 140 x 4 + scores 2 x 3 x 2 x 5 x 4 + logits 3 x 10 x (4 + 4) = 2160 > sampling 32 x 3 x 10
    assert t.decode_bytes == 1680 + 240 + 240
    assert (t.held_bytes, t.peak_bytes) == (120, 120 + 5080)
    # no prefill bound: every row's whole prompt in one forward (15 positions)
    assert engine_transient(TOY, design_seq_len=5, rows=3, dtype_bytes=4, max_prefill_tokens=0).prefill_positions == 15
    # bf16: activations halve, the fp32 logits and sampling copies do not
    half = engine_transient(TOY, design_seq_len=5, rows=3, dtype_bytes=2, max_prefill_tokens=8)
    assert half.prefill_bytes == 8 * 140 * 2 + 8 * 5 * 4 + 3 * 10 * 10


def _selector(memory: int, *, transients: bool = True, max_sequences: int = 64) -> RolloutSelector:
    shape = ModelShape.from_hf(SMALL)
    return RolloutSelector(shape, PoolBudget(1, memory), dtype_bytes=4, max_sequences=max_sequences, allow_tp=False,
                           extra_weight_params=fused_copy_params(shape),
                           max_prefill_tokens=ENGINE_MAX_PREFILL_TOKENS if transients else None)


def test_a_budget_that_fits_weights_and_kv_but_not_the_transients_is_refused_or_shrunk() -> None:
    old = _selector(1, transients=False)
    per_token = predict_kv_cache_bytes(old.shape, 1, dtype_bytes=4)
    weights = old.weight_bytes()
    # weights + one 4096-token sequence's KV + 1 MiB: the weights + KV model says one sequence fits
    tight = weights + 4096 * per_token + MIB
    assert isinstance(_selector(tight, transients=False).plan_for(4096), RolloutDecision)
    refused = _selector(tight).plan_for(4096)
    assert isinstance(refused, Infeasible) and "transients" in refused.message
    # a roomier budget: the old model runs 64 rows of 256 tokens; with the transients fewer, and all of it fits
    roomy = weights + 64 * 256 * per_token + 64 * MIB
    before, after = _selector(roomy, transients=False).plan_for(256), _selector(roomy).plan_for(256)
    assert isinstance(before, RolloutDecision) and isinstance(after, RolloutDecision)
    assert before.max_concurrent_sequences == 64 and 1 <= after.max_concurrent_sequences < 64
    assert after.kv_budget_tokens < before.kv_budget_tokens
    t = engine_transient(after_shape := _selector(roomy).shape, design_seq_len=256,
                         rows=after.max_concurrent_sequences, dtype_bytes=4)
    assert weights + after.kv_budget_tokens * per_token + t.peak_bytes <= roomy
    assert after.predicted_peak_bytes <= roomy and after_shape.hidden_size == 512
    # one row more would not have fitted
    t1 = engine_transient(after_shape, design_seq_len=256, rows=after.max_concurrent_sequences + 1, dtype_bytes=4)
    assert weights + (after.max_concurrent_sequences + 1) * 256 * per_token + t1.peak_bytes > roomy


def _cfg(tmp_path: Path) -> Any:
    (tmp_path / "config.json").write_text(json.dumps(SMALL))
    return load_config(None, [f"model.path={tmp_path}", f"run_dir={tmp_path / 'run'}", "trainer.nproc=1",
                              "selector.initial_seq_len=256", "selector.reserve_bytes=0",
                              f"selector.trainer_memory_bytes={1600 * MIB}", f"rollout.memory_bytes={1200 * MIB}",
                              "rollout.max_batch_size=4096"])


def test_reported_sheds_lower_the_next_rollout_plan_and_survive_a_supervisor_restart(tmp_path: Path) -> None:
    sup = Supervisor(_cfg(tmp_path))

    def wire(s: Supervisor, msg: P.Msg) -> Any:
        return P.decode(P.encode(s.handle(P.decode(P.encode(msg)), time.time())))

    worker = wire(sup, P.Register(role=P.Role.ROLLOUT, host="h", pid=1, shard_address="127.0.0.1:1")).worker_id
    first = wire(sup, P.Heartbeat(worker_id=worker, stats={"oom_sheds": 0.0})).plan
    assert first is not None and first.max_concurrent_sequences > 1
    shed = wire(sup, P.Heartbeat(worker_id=worker, stats={"oom_sheds": 2.0})).plan
    assert shed.version == first.version + 1 and "shed 2 allocation failure(s)" in shed.reason
    assert shed.max_concurrent_sequences < first.max_concurrent_sequences
    assert shed.kv_budget_tokens < first.kv_budget_tokens
    assert sup.planner.rollout is not None and sup.planner.rollout.memory_corrections == {"tp1": 1.25 ** 2}
    assert sup.status(time.time())["plans"]["rollout_memory_corrections"] == {"tp1": 1.25 ** 2}
    assert wire(sup, P.Heartbeat(worker_id=worker, stats={"oom_sheds": 2.0})).plan == shed  # counted once

    restarted = Supervisor(sup.cfg)
    restarted.restore(sup.snapshot(), time.monotonic())
    assert restarted.planner.rollout is not None and restarted.planner.rollout.memory_corrections == {"tp1": 1.25 ** 2}
    assert restarted.planner.rollout_wire == shed
    again = wire(restarted, P.Heartbeat(worker_id=worker, stats={"oom_sheds": 2.0})).plan
    assert again == shed  # the sheds already counted are not counted again after the restart
    more = wire(restarted, P.Heartbeat(worker_id=worker, stats={"oom_sheds": 3.0})).plan
    assert more.version == shed.version + 1 and more.max_concurrent_sequences <= shed.max_concurrent_sequences
    assert more.kv_budget_tokens < shed.kv_budget_tokens
