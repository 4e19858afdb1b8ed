"""RUN_DIR/metrics.jsonl (supervisor/metrics_log.py): one line per trained step, written by the supervisor
when the trainer publishes a version, and never a step twice across a restart of the supervisor."""

from __future__ import annotations

import json
import time
from pathlib import Path

from earl_stream import protocol as P
from earl_stream.config import load_config
from earl_stream.store.schema import SCHEMA_VERSION, SampleMeta
from earl_stream.supervisor.metrics_log import MetricsLog, read_records, staleness_histogram
from earl_stream.supervisor.server import Supervisor

STEP_METRICS = {"loss": 0.5, "grad_norm": 1.25, "entropy": 2.0, "clip_frac": 0.1, "kl": 0.01, "mean_reward": 0.75,
                "tokens": 400.0, "step_seconds": 2.0, "lr": 1e-5, "peak_memory_bytes": 2.0**30}


def _lines(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_append_skips_steps_already_written_after_a_reopen(tmp_path: Path) -> None:
    m = MetricsLog(tmp_path, "run-a")
    assert m.last_step == -1
    assert m.append(1, {"loss": 1.0}) and m.append(2, {"loss": float("nan")})
    assert not m.append(2, {"loss": 9.0})  # a step at or below the last is never written again
    again = MetricsLog(tmp_path, "run-a")  # a restart
    assert again.last_step == 2
    assert not again.append(1, {"loss": 9.0}) and not again.append(2, {"loss": 9.0})
    assert again.append(3, {"loss": 3.0})
    assert [(r["step"], r["loss"]) for r in _lines(tmp_path)] == [(1, 1.0), (2, None), (3, 3.0)]


def test_a_line_cut_short_and_another_runs_file(tmp_path: Path) -> None:
    m = MetricsLog(tmp_path, "run-a")
    m.append(1, {})
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 2, "lo')  # a crash mid-line
    m = MetricsLog(tmp_path, "run-a")
    assert m.last_step == 1 and m.append(2, {})
    assert [r["step"] for r in read_records(tmp_path)] == [1, 2]
    fresh = MetricsLog(tmp_path, "run-b")  # a fresh run in the same directory: the old file is moved aside
    assert fresh.last_step == -1 and (tmp_path / "metrics-run-a.jsonl").exists()
    assert fresh.append(1, {}) and [r["run_id"] for r in _lines(tmp_path)] == ["run-b"]


def _supervisor(tmp_path: Path) -> Supervisor:
    cfg = load_config(overrides=["trainer.groups_per_step=1", "trainer.group_size=2", "model.path=/nonexistent",
                                 f"run_dir={tmp_path}"])
    sup = Supervisor(cfg)
    sup.metrics_log = MetricsLog(cfg.run_dir, sup.run_id)
    return sup


def _publish(sup: Supervisor, version: int, metrics: dict[str, float]) -> None:
    assert isinstance(sup.handle(P.PublishVersion(worker_id="trainer-0", version=version, metrics=metrics), 0.0), P.Ack)


def test_supervisor_writes_one_line_per_step(tmp_path: Path) -> None:
    sup = _supervisor(tmp_path)
    _publish(sup, 0, {"weight_bytes_per_version": 1e6})  # the trainer's first publish: no step trained, no line
    for v in (1, 2):
        _publish(sup, v, STEP_METRICS)
    lines = _lines(tmp_path)
    assert [r["step"] for r in lines] == [1, 2] and [r["policy_version"] for r in lines] == [1, 2]
    r = lines[-1]
    for key in ("loss", "grad_norm", "entropy", "clip_frac", "kl", "lr", "peak_memory_bytes"):
        assert r[key] == STEP_METRICS[key], key
    assert r["reward"] == 0.75 and r["trained_tokens_per_s"] == 200.0 and r["run_id"] == sup.run_id
    assert r["time"] > 1e9 and r["wall_seconds"] >= 0 and r["replanned"] is False
    # nothing finished in the window yet: unknown, so null rather than made up
    assert r["reward_window"] is None and r["context_p50"] is None and r["env_outcomes"] is None


def test_a_restored_supervisor_writes_only_new_steps(tmp_path: Path) -> None:
    sup = _supervisor(tmp_path)
    for v in (1, 2):
        _publish(sup, v, STEP_METRICS)
    again = Supervisor(sup.cfg)
    again.restore(sup.snapshot(), 0.0)
    again.metrics_log = MetricsLog(sup.cfg.run_dir, again.run_id)
    for v in (1, 2, 3):  # replayed or re-trained steps, then the next one
        _publish(again, v, {**STEP_METRICS, "loss": 9.0})
    lines = _lines(tmp_path)
    assert [r["step"] for r in lines] == [1, 2, 3]
    assert [r["loss"] for r in lines] == [0.5, 0.5, 9.0]
    assert lines[2]["wall_seconds"] >= lines[1]["wall_seconds"]  # the run's clock, not the restart's


def _rows(prompt, versions: list[int]) -> list[SampleMeta]:
    return [SampleMeta(schema_version=SCHEMA_VERSION, sample_id=f"{prompt.group_id}-{i}", prompt_ordinal=prompt.prompt_ordinal,
                       episode_id=str(i), group_id=prompt.group_id, env=prompt.env, turns=1, prompt_tokens=3,
                       response_tokens=2, total_tokens=5, reward=float(i), advantage=None, policy_version_min=v,
                       policy_version_max=max(v, 0), producer_id="w", producer_address="127.0.0.1:1", checksum=0,
                       created_at=time.time(), info_json="{}")
            for i, v in enumerate(versions)]


def test_the_staleness_of_the_steps_claim_is_in_its_record(tmp_path: Path) -> None:
    """The claim of step 2 (0-based; it trains policy version 2) holds samples whose oldest tokens are of
    versions 2, 1 and 1, and one with no model token: the record of step 3 counts {0: 1, 1: 2}."""
    sup = _supervisor(tmp_path)
    ledger = sup.ledger
    for v in (1, 2):
        _publish(sup, v, STEP_METRICS)
    (prompt,) = ledger.issue("w", 1)
    ledger.add_rows("w", _rows(prompt, [2, 1]))
    assert staleness_histogram(ledger, 2) is None  # nothing claimed for the step yet
    (other,) = ledger.issue("w", 1)
    ledger.add_rows("w", _rows(other, [1, -1]))
    ipc, _ = ledger.claim(2, 2, 1)
    assert ipc is not None
    assert staleness_histogram(ledger, 2) == {"0": 1, "1": 2}
    _publish(sup, 3, STEP_METRICS)
    lines = _lines(tmp_path)
    assert lines[-1]["step"] == 3 and lines[-1]["staleness"] == {"0": 1, "1": 2}
    assert lines[0]["staleness"] is None  # no claim held for that step: unknown


EVAL_POINT = {"version": 4, "value": 0.25, "stderr": 0.05, "pass_at_k": {"1": 0.25}, "mean_reward": 0.25}


def _status(evals: dict) -> dict:
    return {"policy_version": 4, "mean_reward_last": 0.5, "win_rate_last": 0.5, "draw_rate_last": 0.25,
            "context_length": {"p50": 100.0, "p90": 120.0, "p99": 130.0, "max": 140.0}, "tokens_produced": 1000,
            "workers": [{"id": "rollout-1", "role": "rollout", "alive": True, "stats": {"store_bytes": 4096.0}},
                        {"id": "rollout-2", "role": "rollout", "alive": True, "stats": {"store_bytes": 8192.0}},
                        {"id": "rollout-3", "role": "rollout", "alive": False, "stats": {"store_bytes": 1e9}}],
            "eval": evals}


def test_percentiles_store_peak_and_each_eval_round_once(tmp_path: Path) -> None:
    evals = {"add3": {**EVAL_POINT, "history": [{"version": 0, "value": 0.125, "pass_at_k": {"1": 0.125},
                                                 "mean_reward": 0.125},
                                                {k: EVAL_POINT[k] for k in ("version", "value", "pass_at_k", "mean_reward")}],
                      "in_progress": None, "skipped_versions": []},
             "broken": {"error": "cannot give held-out items"}}
    m = MetricsLog(tmp_path, "run-a")
    r = m.record(_status(evals), STEP_METRICS, False)
    assert (r["context_p50"], r["context_p90"], r["context_p99"], r["context_max"]) == (100.0, 120.0, 130.0, 140.0)
    assert r["rollout_store_bytes_max"] == 8192.0 and r["draw_rate"] == 0.25  # the dead worker's store is gone
    # both rounds finished since the last record; the newest with every figure (stderr)
    assert [p["version"] for p in r["eval"]["add3"]] == [0, 4] and r["eval"]["add3"][-1] == EVAL_POINT
    assert "broken" not in r["eval"]
    m.append(1, r)
    assert m.record(_status(evals), STEP_METRICS, False)["eval"] is None  # already recorded: not again
    again = MetricsLog(tmp_path, "run-a")  # a restarted supervisor knows which rounds are in the file
    assert again.record(_status(evals), STEP_METRICS, False)["eval"] is None
    newer = {"add3": {**evals["add3"], "version": 8, "value": 0.5,
                      "history": evals["add3"]["history"] + [{"version": 8, "value": 0.5}]}}
    assert [p["version"] for p in again.record(_status(newer), STEP_METRICS, False)["eval"]["add3"]] == [8]


def test_a_replan_names_the_plan_adopted_and_why(tmp_path: Path) -> None:
    history = [{"version": 1, "step": 0, "plan": {"name": "dp2"}, "reason": "initial"},
               {"version": 2, "step": 3, "plan": {"name": "fsdp2_sp2"}, "reason": "p99 1900 > 0.9 x 2048"}]
    status = {**_status({}), "plans": {"trainer": {"version": 2, "name": "fsdp2_sp2"}, "trainer_history": history}}
    m = MetricsLog(tmp_path, "run-a")
    r = m.record(status, STEP_METRICS, True)  # policy version 4: the step at boundary 3
    assert (r["plan"], r["plan_version"]) == ("fsdp2_sp2", 2)
    assert r["replan"] == {"version": 2, "plan": "fsdp2_sp2", "reason": "p99 1900 > 0.9 x 2048"}
    assert m.record(status, STEP_METRICS, False)["replan"] is None
