"""bench/memory_model_real.py (part (f) of bench/memory_model.py): its case syntax, the 8-head SmolLM2 shape, and
the merge of a run into the results file (no ranks started here: the measurement itself is the benchmark's)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import memory_model_real as mr  # noqa: E402


def test_case_syntax_names_a_shape_and_keeps_the_old_one() -> None:
    assert mr.parse_case("dp2:1024") == ("dp2", None, 1024)
    assert mr.parse_case("fsdp2+rc:4096") == ("fsdp2+rc", None, 4096)
    assert mr.parse_case("tp2@heads8:2048") == ("tp2", "heads8", 2048)
    assert mr.case_name("tp2", "heads8", 1024) == "tp2@heads8 1024"
    assert mr.case_name("dp2+bf16", None, 1024) == "dp2+bf16 1024"
    with pytest.raises(ValueError, match="unknown model shape"):
        mr.parse_case("tp2@heads7:1024")
    assert {"tp2@heads8:1024", "tp2@heads8:2048", "sp2@heads8:1024", "sp2@heads8:2048"} <= set(mr.REAL_FULL)
    assert set(mr.NOT_RUNNABLE) == {"tp2", "sp2"}  # on SmolLM2's own 9 heads


def test_heads8_is_smollm2_with_8_and_4_heads_that_tp2_and_sp2_split() -> None:
    from earl_stream.supervisor.memory_model import ModelShape

    base, h8 = ModelShape.from_hf(mr.smollm2_config()), ModelShape.from_hf(mr.heads8_config())
    assert (h8.num_heads, h8.num_kv_heads, h8.head_dim) == (8, 4, 72)
    assert (h8.hidden_size, h8.num_layers, h8.intermediate_size, h8.vocab_size) == \
        (base.hidden_size, base.num_layers, base.intermediate_size, base.vocab_size)
    for plan in ("tp2", "sp2"):
        rp = mr.rank_plan(plan)
        assert rp.world == 2 and (rp.tp, rp.sp) == ((2, 1) if plan == "tp2" else (1, 2))
        shape, tplan, bd = mr.predict(plan, 1024, "heads8")
        assert shape == h8 and (tplan.tp, tplan.sp) == (rp.tp, rp.sp) and bd.total_bytes > 0
    # tp2 halves the states it shards: under tp2 a rank holds less than under dp2
    assert mr.predict("tp2", 1024, "heads8")[2].static_bytes < mr.predict("dp2", 1024, "heads8")[2].static_bytes


def _row(case: str, err: float, under: float = 0.0) -> dict:
    return {"case": case, "relative_error": err,
            "ranks": [{"relative_error_total": err}, {"relative_error_total": -under}]}


def test_a_run_merges_its_rows_and_rescores_all_of_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mr, "_not_measured", lambda held: {"x": "y"})  # no predictions needed here
    old = {"configs": [{**_row("dp2 1024", 0.2, 0.1), "measured_at": "old"}, {**_row("fsdp2 1024", 0.01),
                                                                              "measured_at": "old"}],
           "note": "stale text", "grid_run": ["dp2 1024"], "model": "m", "extra": 1}
    new = {"configs": [_row("dp2 1024", 0.03, 0.01), _row("tp2@heads8 1024", -0.04)], "model": "m2",
           **mr.scores([_row("dp2 1024", 0.03, 0.01), _row("tp2@heads8 1024", -0.04)])}
    got = mr.merge(old, new, ["dp2:1024", "tp2@heads8:1024"], "2026-12-03 abc1234")
    assert [r["case"] for r in got["configs"]] == ["dp2 1024", "fsdp2 1024", "tp2@heads8 1024"]
    assert [r["measured_at"] for r in got["configs"]] == ["2026-12-03 abc1234", "old", "2026-12-03 abc1234"]
    assert got["max_relative_error_real_model"] == pytest.approx(0.04)
    assert got["max_underprediction_real_model"] == pytest.approx(0.04)
    assert got["grid_run"] == ["dp2 1024", "fsdp2 1024", "tp2@heads8 1024"]
    assert got["last_run"] == {"measured_at": "2026-12-03 abc1234", "grid": ["dp2:1024", "tp2@heads8:1024"]}
    assert got["note"] == mr.NOTE and got["model"] == "m2" and got["extra"] == 1 and got["not_measured"] == {"x": "y"}


def test_not_measured_names_the_full_grids_missing_cases() -> None:
    held = {c for c in (mr.case_name(*mr.parse_case(i)) for i in mr.REAL_FULL if not i.startswith("switch"))
            if not c.endswith(("4096", "8192"))} | {"switch dp2 -> fsdp2"}
    missing = mr._not_measured(held)
    assert set(missing) == {"dp2 4096", "dp2 8192", "fsdp2 4096", "fsdp2 8192"}
    assert "GiB per rank x 2 ranks: more than this shared 24 GiB host had free" in missing["dp2 8192"]


def _measured(case: str, plan: str, tokens: int, predicted: int, peaks: tuple[int, int], shape: str = "") -> dict:
    return {"case": case, "plan": plan, "tokens": tokens, "predicted_total_bytes": predicted, "relative_error": 0.0,
            **({"shape": shape} if shape else {}), "ranks": [{"measured_total_bytes": p} for p in peaks]}


def test_the_reserve_learnt_at_smaller_contexts_is_scored_at_larger_ones() -> None:
    rows = [_measured("dp2 2048", "dp2", 2048, 1000, (1060, 1075)),  # listed first: replayed in order of tokens
            _measured("dp2 1024", "dp2", 1024, 500, (560, 570)),     # fullest rank 70 over: the reserve learnt
            _measured("tp2@heads8 1024", "tp2", 1024, 400, (380, 390), "heads8"),  # under its prediction: 0 learnt
            _measured("tp2@heads8 2048", "tp2", 2048, 800, (900, 880), "heads8"),
            _measured("fsdp2+rc 4096", "fsdp2+rc", 4096, 300, (900, 900))]  # alone in its layout: not scored
    got = mr.learnt_reserve(rows)
    by_case = {r["case"]: r for r in got["learnt_reserve_rows"]}
    assert set(by_case) == {"dp2 2048", "tp2@heads8 2048"}
    assert by_case["dp2 2048"]["learnt_from"] == ["dp2 1024"] and by_case["dp2 2048"]["reserve_bytes"] == 70
    assert by_case["dp2 2048"]["relative_error"] == pytest.approx((1070 - 1075) / 1075)
    assert by_case["tp2@heads8 2048"]["reserve_bytes"] == 0  # a layout under its prediction learns nothing
    assert got["max_underprediction_with_learnt_reserve"] == pytest.approx(100 / 900)
    assert mr.learnt_reserve(rows[-1:]) == {"max_underprediction_with_learnt_reserve": None, "learnt_reserve_rows": []}
