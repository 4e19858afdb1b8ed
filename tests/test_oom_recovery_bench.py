"""bench/oom_recovery.py's reading of a run (the benchmark's summary code, on lines recorded from a SmolLM2 run on
2 ranks): a step retried after two failures is one retry of two recoveries, its lost seconds split between them and
compared with the retried step's own time (logged one step number later: the retry names the step index)."""

from __future__ import annotations

import sys
from argparse import Namespace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.oom_recovery import aggregate, parse_log  # noqa: E402

T = "2026-12-03 03:23:49,305 W MainProcess earl_stream.workers"
LOG = "\n".join([
    f"{T}.trainer: step 5: loss 0.0000 grad-norm 0.000 reward 0.000 (2 samples, 4004 tokens) in 64.73s (pull 0.002s)",
    f"{T}.trainer: step 5: loss 0.0000 grad-norm 0.000 reward 0.000 (2 samples, 4004 tokens) in 64.73s (pull 0.003s)",
    f"{T}.oom_retry: step 6: every rank left the step 54.84s after it began; rank 0 failed",
    f"{T}.trainer: step 6: adopted trainer plan v2: fsdp2 (data ranks 2, tp 1, sp 1), micro-batch 5197 tokens, "
    "recompute False, fp32 (step 6 failed to allocate under v1)",
    f"{T}.oom_retry: step 6: every rank left the step 64.39s after it began; rank 0 failed",
    f"{T}.trainer: step 6: adopted trainer plan v3: dp2 (data ranks 2, tp 1, sp 1), micro-batch 9998 tokens, "
    "recompute True, fp32 (step 6 failed to allocate under v2)",
    f"{T}.oom_retry: step 6: recovered from the allocation failure under dp2: trained under plan dp2, 133.85s lost to it",
    f"{T}.oom_retry: step 6: recovered from the allocation failure under dp2: trained under plan dp2, 133.82s lost to it",
    f"{T}.trainer: step 7: loss 0.0000 grad-norm 0.000 reward 0.000 (2 samples, 8332 tokens) in 127.27s (pull 0.002s)",
    f"{T}.trainer: step 7: loss 0.0000 grad-norm 0.000 reward 0.000 (2 samples, 8332 tokens) in 127.30s (pull 0.027s)",
])
RECOVERIES = [{"step": 6, "plan_before": "dp2", "plan_after": "fsdp2"},
              {"step": 6, "plan_before": "fsdp2", "plan_after": "dp2+rc"}]


def test_a_step_retried_after_two_failures_is_two_recoveries_against_the_retried_steps_time() -> None:
    parsed = parse_log(LOG, RECOVERIES)
    assert parsed["trained"] == [5, 5, 7, 7]
    assert [p["plan"] for p in parsed["plans"]] == ["fsdp2", "dp2+rc"]
    [lost] = parsed["lost"]
    assert lost["seconds"] == 133.85 and lost["recoveries"] == 2 and lost["step_seconds"] == 127.30
    assert lost["seconds_per_recovery"] == 66.925 and lost["step_times_per_recovery"] == round(66.925 / 127.3, 3)
    assert parsed["ranks_left_after_s"] == [54.84, 64.39]


def test_the_summary_counts_each_recovery_and_fails_the_goal_on_a_crash_or_a_lost_sample() -> None:
    parsed = parse_log(LOG, RECOVERIES)
    run = {"crashed": False, "recoveries": RECOVERIES, "lost": 0, "duplicated": 0, "seconds_lost": parsed["lost"],
           "plans": parsed["plans"]}
    args = Namespace(scale=0.5, steps=8, set=[])
    good = aggregate([run, run], args)
    assert good["recoveries"] == 4 and good["seconds_lost_per_recovery"] == [66.925] * 2 and good["goal_met"]
    assert not aggregate([run, {**run, "crashed": True}], args)["goal_met"]
    assert not aggregate([run, {**run, "lost": 2}], args)["goal_met"]
