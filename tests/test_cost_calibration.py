"""bench/cost_calibration.py's fit: step times a known cost model would take are fitted back (each
configuration's median over its rounds, the slower rank's wall seconds), and a fit on wall seconds ranks
plans by what a step costs the pool, not by the CPU a rank burns."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from cost_calibration import configurations, fit  # noqa: E402

CONFIG = {"model_type": "llama", "hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 8,
          "num_key_value_heads": 4, "intermediate_size": 256, "vocab_size": 1024, "max_position_embeddings": 2048,
          "tie_word_embeddings": True}
TRUE = {"seconds_per_flop": 2e-11, "seconds_per_byte": 4e-9, "seconds_per_score": 5e-12, "fixed_seconds": 0.01,
        "step_fixed_seconds": 0.05, "seconds_per_collective": 2e-3, "seconds_per_fsdp_repeat_byte": 4e-9}


def _records(model_dir: Path, noisy_round: int | None = None) -> list[dict]:
    """Two ranks x 3 rounds of every configuration, timed by the TRUE model (rank 1 slower by 1%); round
    `noisy_round` 3x slower, as a burst of load would make it."""
    from bench.ranks import rank_plan
    from earl_stream.supervisor.cost_model import StepCostModel
    from earl_stream.supervisor.memory_model import LOGIT_COPIES_EARL_GRPO, Attention, ModelShape, Recompute, TrainPlan

    shape, truth = ModelShape.from_hf(CONFIG), StepCostModel.from_dict(TRUE)
    out = []
    for layout, s, rc, mbs in configurations(["dp2", "fsdp2", "tp2", "sp2"], 128, 512):
        p = rank_plan(layout)
        plan = TrainPlan(1, s, dp=p.data_ranks, tp=p.tp, sp=p.sp, fsdp=p.fsdp > 1, attention=Attention.FLASH,
                         recompute=Recompute.FULL if rc else Recompute.NONE, logit_copies=LOGIT_COPIES_EARL_GRPO)
        wall = truth.predict_step(shape, [plan] * mbs)
        for round_ in range(3):
            slow = 3.0 if round_ == noisy_round else 1.0
            for rank in (0, 1):
                out.append({"rank": rank, "round": round_, "layout": layout, "seq_len": s, "recompute": rc,
                            "micro_batches": mbs, "wall_seconds": wall * slow * (1.0 + 0.01 * rank),
                            "cpu_seconds": 0.5 * wall})  # a rank waiting in a collective burns no CPU
    (model_dir / "config.json").write_text(json.dumps(CONFIG))
    return out


def test_fit_recovers_the_step_times_of_a_known_cost_model(tmp_path: Path) -> None:
    cost_model, rows = fit(str(tmp_path), "sdpa", _records(tmp_path))
    assert len(rows) == 24 and all(r["rounds"] == 3 for r in rows)
    for r in rows:  # the slower rank's time is the pool's
        assert r["predicted_seconds"] == pytest.approx(r["wall_seconds"], rel=0.02)
    assert cost_model["seconds_per_collective"] > 0  # tp's and sp's per-layer collectives are priced


def test_a_burst_of_load_in_one_round_does_not_move_the_fit(tmp_path: Path) -> None:
    quiet = fit(str(tmp_path), "sdpa", _records(tmp_path))[1]
    burst = fit(str(tmp_path), "sdpa", _records(tmp_path, noisy_round=1))[1]
    assert [r["wall_seconds"] for r in burst] == [r["wall_seconds"] for r in quiet]  # each configuration's median
