"""The live view renders a real status dictionary and writes a learning-curve PNG."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from earl_stream.cli.live import CurvePoint, LiveView, dashboard, plot_learning_curve, status_line
from earl_stream.config import load_config

STATUS = {
    "policy_version": 7, "mean_reward_last": 0.25, "win_rate_last": 0.5, "draw_rate_last": 0.125,
    "tokens_per_second": 410.0, "samples_in_store": 16, "samples_produced": 80, "samples_consumed": 56,
    "samples_lost": 1, "samples_stale": 0, "context_length": {"p50": 114.0, "p99": 136.0, "max": 140.0},
    "plans": {"trainer": {"version": 2, "name": "fsdp2", "design_seq_len": 256, "micro_batch_tokens": 7156}},
    "trainer": {"loss": -0.012, "step_seconds": 1.5},
    "workers": [
        {"id": "rollout-1", "role": "rollout", "alive": True, "last_seen_s": 0.3, "groups_held": 2,
         "stats": {"episodes": 40.0, "inflight": 8.0}},
        {"id": "rollout-2", "role": "rollout", "alive": False, "last_seen_s": 12.0, "groups_held": 0, "stats": {}},
        {"id": "trainer-0", "role": "trainer", "alive": True, "last_seen_s": 0.1, "rank": 0, "stats": {}},
    ],
}


def _render(status: dict, steps: int) -> str:
    console = Console(width=160, record=True, color_system=None)
    console.print(dashboard(status, steps))
    return console.export_text()


def test_dashboard_shows_progress_plan_store_and_worker_health() -> None:
    text = _render(STATUS, 20)
    assert "7/20" in text and "0.250" in text and "0.50 (draw 0.12)" in text
    assert "v2 fsdp2 (256 tok, mb 7156)" in text and "16 waiting" in text and "1 lost" in text
    assert "40 episodes, 8 in flight, 2 groups held" in text
    lines = {line.split()[0]: line for line in text.splitlines() if line.strip().startswith(("rollout-", "trainer-"))}
    assert "alive" in lines["rollout-1"] and "dead" in lines["rollout-2"] and "rank 0" in lines["trainer-0"]


def test_dashboard_and_line_survive_an_empty_run() -> None:
    empty = {"policy_version": 0, "workers": []}
    assert "until stopped" in _render(empty, 0)
    assert status_line(empty, 0).startswith("step 0 | reward - | win -")
    assert "selector off" in status_line(empty, 0)


def test_learning_curve_png(tmp_path: Path) -> None:
    view = LiveView(load_config(None, ["steps=3"]))
    assert view.write_learning_curve(tmp_path / "none.png") is None  # nothing trained: no empty plot
    for step in (1, 1, 2, 3):  # repeated polls of one step record it once
        view.update({**STATUS, "policy_version": step, "mean_reward_last": 0.1 * step})
    assert [p.step for p in view.curve] == [1, 2, 3]
    out = view.write_learning_curve(tmp_path / "curve.png")
    assert out is not None and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    points = [CurvePoint(1, 1.0, None, None, None, None), CurvePoint(2, 2.0, 0.5, 0.5, 0.0, 0.1)]
    assert plot_learning_curve(points, tmp_path / "sparse.png").exists()  # missing values are skipped


EVAL = {"add3": {"version": 4, "value": 0.25, "stderr": 0.05, "pass_at_k": {"1": 0.25}, "mean_reward": 0.25,
                 "history": [{"version": 0, "value": 0.125, "pass_at_k": {"1": 0.125}, "mean_reward": 0.125},
                             {"version": 4, "value": 0.25, "pass_at_k": {"1": 0.25}, "mean_reward": 0.25}]},
        "broken": {"error": "cannot give held-out items"}}


def test_eval_in_the_line_the_dashboard_and_the_curve(tmp_path: Path) -> None:
    status = {**STATUS, "eval": EVAL}
    assert status_line(status, 20).endswith("| held-out add3 0.250@v4")
    assert "add3 success 0.250 at version 4" in _render(status, 20)
    view = LiveView(load_config(None, ["steps=3"]))
    for step in (1, 2, 3, 4):
        view.update({**status, "policy_version": step})
    assert view.eval == EVAL
    with_eval = view.write_learning_curve(tmp_path / "eval.png")
    without = plot_learning_curve(view.curve, tmp_path / "plain.png")  # the same points, no held-out curve
    assert with_eval is not None and with_eval.read_bytes() != without.read_bytes()
