"""The live view renders a real status dictionary (the learning curve: tests/cli/test_run_files.py)."""

from __future__ import annotations

from rich.console import Console

from earl_stream.cli.live import dashboard, status_line

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


EVAL = {"add3": {"version": 4, "value": 0.25, "stderr": 0.05, "pass_at_k": {"1": 0.25}, "mean_reward": 0.25,
                 "history": [{"version": 0, "value": 0.125, "pass_at_k": {"1": 0.125}, "mean_reward": 0.125},
                             {"version": 4, "value": 0.25, "pass_at_k": {"1": 0.25}, "mean_reward": 0.25}]},
        "broken": {"error": "cannot give held-out items"}}


def test_eval_in_the_line_and_the_dashboard() -> None:
    status = {**STATUS, "eval": EVAL}
    assert status_line(status, 20).endswith("| held-out add3 0.250@v4")
    assert "add3 success 0.250 at version 4" in _render(status, 20)


def test_a_games_evaluation_shows_its_win_draw_and_loss_rates() -> None:
    game = {"tictactoe": {"version": 20, "value": 0.75, "win_rate": 0.75, "draw_rate": 0.125, "loss_rate": 0.125,
                          "history": []}}
    assert "tictactoe success 0.750 (win 0.75 draw 0.12 loss 0.12) at version 20" in _render({**STATUS, "eval": game}, 40)
