"""RUN_DIR/metrics.jsonl (supervisor/metrics_log.py): one line per trained step, written by the supervisor
when the trainer publishes a version, and never a step twice across a restart of the supervisor."""

from __future__ import annotations

import json
from pathlib import Path

from earl_stream import protocol as P
from earl_stream.config import load_config
from earl_stream.supervisor.metrics_log import MetricsLog, read_records
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
