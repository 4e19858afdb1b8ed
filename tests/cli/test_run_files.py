"""summary.json and learning_curve.png are made from RUN_DIR/metrics.jsonl (cli/run_files.py): records written
by a real supervisor as the trainer publishes, read back as `up` reads them when the run ends."""

from __future__ import annotations

from pathlib import Path

from earl_stream import protocol as P
from earl_stream.cli.run_files import eval_points, plot_learning_curve, step_summary
from earl_stream.cli.up import SUMMARY_KEYS, make_summary
from earl_stream.config import load_config
from earl_stream.supervisor.metrics_log import MetricsLog, read_records
from earl_stream.supervisor.server import Supervisor

PNG = b"\x89PNG\r\n\x1a\n"


def _records(tmp_path: Path, steps: int) -> list[dict]:
    cfg = load_config(overrides=["model.path=/nonexistent", f"run_dir={tmp_path}"])
    sup = Supervisor(cfg)
    sup.metrics_log = MetricsLog(cfg.run_dir, sup.run_id)
    for v in range(1, steps + 1):
        metrics = {"loss": 1.0 / v, "mean_reward": 0.1 * v, "tokens": 100.0 * v, "step_seconds": 2.0,
                   "peak_memory_bytes": 1000.0 * v}
        assert isinstance(sup.handle(P.PublishVersion(worker_id="trainer-0", version=v, metrics=metrics), 0.0), P.Ack)
    return read_records(tmp_path)


def test_the_summary_rests_on_the_records(tmp_path: Path) -> None:
    records = _records(tmp_path, 3)
    # a final status read before the last publish (or not at all) does not shorten the run
    summary = make_summary({"policy_version": 2, "trainer": {"loss": 9.0}}, wall=5.0, records=records)
    assert set(SUMMARY_KEYS) <= set(summary)
    assert summary["steps"] == summary["policy_version"] == 3 and summary["last_loss"] == 1.0 / 3
    assert make_summary({}, wall=1.0)["steps"] == 0  # no record, no status: nothing trained
    m = step_summary(records, tmp_path / "metrics.jsonl")
    assert m["steps_recorded"] == 3 and m["last"]["step"] == 3 and m["last"]["reward"] == 0.1 * 3
    assert m["peak_memory_bytes"] == 3000.0 and m["trained_tokens_per_s_mean"] == 100.0  # (50+100+150)/3
    assert m["replans"] == 0 and m["staleness"] is None  # no claim was held: unknown, not zero
    assert step_summary([], tmp_path / "metrics.jsonl") == {"file": str(tmp_path / "metrics.jsonl"), "steps_recorded": 0}


def test_the_curve_is_drawn_from_the_records_with_every_eval_round(tmp_path: Path) -> None:
    records = _records(tmp_path, 4)
    assert plot_learning_curve([], tmp_path / "none.png") is None and not (tmp_path / "none.png").exists()
    plain = plot_learning_curve(records, tmp_path / "plain.png")
    assert plain is not None and plain.read_bytes()[:8] == PNG
    records[1]["eval"] = {"add3": [{"version": 0, "value": 0.125}, {"version": 2, "value": 0.25}]}
    # a round that finished after the last step is only in the final status
    final = {"add3": {"version": 4, "value": 0.5, "history": [{"version": 2, "value": 0.25}, {"version": 4, "value": 0.5}]},
             "broken": {"error": "cannot give held-out items"}}
    assert eval_points(records, final) == {"add3": [(0, 0.125), (2, 0.25), (4, 0.5)]}
    with_eval = plot_learning_curve(records, tmp_path / "eval.png", final)
    assert with_eval is not None and with_eval.read_bytes() != plain.read_bytes()
    sparse = [{"step": 1, "loss": None}, {"step": 2, "reward": 0.5, "loss": 0.1}]  # missing values are skipped
    assert plot_learning_curve(sparse, tmp_path / "sparse.png") is not None
