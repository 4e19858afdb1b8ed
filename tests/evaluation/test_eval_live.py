"""Evaluation during a live `earl-stream up` (eval.every), on an environment's held-out set and on the default
game's evaluation seeds: rounds are played by the rollout pool while it trains, their results reach `status --json`
(`eval.{env}`), the `earl_eval_*` gauges, the summary and metrics.jsonl, and no evaluation episode ever reaches the
ledger, the store or a training step."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from cluster import wait_for
from test_dashboards import RunningUp, scrape

from earl_stream import protocol as P
from earl_stream.security.secret import SECRET_ENV, create_secret_file, load_secret
from earl_stream.store.schema import table_from_ipc, table_to_metas
from earl_stream.supervisor.metrics_log import read_records

pytestmark = pytest.mark.slow

PARITY = f"{Path(__file__).resolve().parent / 'parity_env.py'}:ParityEnv"


@pytest.mark.live
def test_eval_rounds_overlap_training_and_are_never_trained(tmp_path: Path, tiny_model_dir: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    secret = create_secret_file(tmp_path / "secret")
    monkeypatch.setenv(SECRET_ENV, str(secret))
    overrides = ("rollout.workers=1", f"envs.0.spec={PARITY}", "envs.0.name=parity", "eval.every=2", "eval.problems=3",
                 "eval.samples=2", "eval.temperature=1.0", "trainer.checkpoint_every=2")
    with RunningUp(tmp_path, tiny_model_dir, *overrides) as up:
        def status() -> dict[str, Any]:
            try:
                address = json.loads((up.run_dir / "supervisor.json").read_text())["address"]
            except (OSError, ValueError, KeyError):
                return {}
            out = subprocess.run([sys.executable, "-m", "earl_stream", "status", "--json", "--supervisor", address],
                                 capture_output=True, text=True, timeout=60)
            return json.loads(out.stdout) if out.returncode == 0 else {}

        s = wait_for(lambda: (st := status()) and len(st.get("eval", {}).get("parity", {}).get("history", [])) >= 2
                     and st, 300, f"two evaluation rounds in `status --json`\n{up.log_tail()}")
        point = s["eval"]["parity"]
        versions = [p["version"] for p in point["history"]]
        # at version 0, then multiples of 2 (one due while the last was still being played is skipped, and said)
        assert versions[0] == 0 and versions == sorted(set(versions)) and all(v % 2 == 0 for v in versions)
        assert point["version"] == versions[-1] >= 2
        assert 0.0 <= point["value"] <= 1.0 and set(point["pass_at_k"]) == {"1", "2"}
        assert point["problems"] == 3 and point["samples"] == 2 and point["episodes"] == 6
        assert point["versions"][0] >= point["version"]  # played with weights at least as new as its round

        targets = up.wait_for_roles()
        [sup] = [a for a, role in targets.items() if role == "supervisor"]
        metrics = scrape(sup)
        assert {"env": "parity"} in metrics["earl_eval_success"]
        assert {m["k"] for m in metrics["earl_eval_pass_at_k"] if m["env"] == "parity"} == {"1", "2"}
        played = [a for a, role in targets.items() if role == "rollout" and "earl_eval_episodes_total" in scrape(a)]
        assert played, "no rollout worker counted an evaluation episode"

        client = P.ControlClient(s["address"], timeout_s=10, secret=load_secret())
        rows = table_to_metas(table_from_ipc(client.call(P.RecentEpisodes(since=0)).table_ipc))
        client.close()
        # every row the ledger got (all it can ever hand a training step) is a training group's episode
        groups = [re.fullmatch(r"g(\d+)\.\d+", r.group_id) for r in rows]  # g{ordinal}.{attempt}
        assert rows and all(g and r.prompt_ordinal == int(g[1]) for g, r in zip(groups, rows)), rows[:3]
        final = status() or s
    summary = json.loads((tmp_path / "summary.json").read_text())  # `up` stopped by SIGTERM writes it too
    assert summary["eval"]["parity"]["history"][:len(versions)] == point["history"]
    assert Path(summary["learning_curve_png"]).read_bytes()[:4] == b"\x89PNG"
    # metrics.jsonl: each finished round once, in the record of the first step published after it finished (a
    # round of version >= 2 was decided at a publish after the round of version 0 had finished)
    recorded = [p["version"] for r in read_records(up.run_dir) for p in (r.get("eval") or {}).get("parity", [])]
    assert recorded and recorded[0] == 0 and recorded == sorted(set(recorded))
    assert recorded == [p["version"] for p in summary["eval"]["parity"]["history"]][:len(recorded)]
    issued = summary["prompts_issued"]  # at the stop: `final` is older than the last steps trained.jsonl holds
    trained = [o for line in (up.run_dir / "trained.jsonl").read_text().splitlines() for o in json.loads(line)["trained"]]
    assert trained and all(0 <= o < issued for o in trained) and len(trained) == len(set(trained))
    # eval episodes played: 2 rounds x 6 at least; the ledger counted only training groups of 4 episodes
    assert final["samples_produced"] % 4 == 0 and final["samples_produced"] <= 4 * issued


@pytest.mark.live  # ~53 s: kept out of `make test`
def test_eval_every_on_the_default_run_plays_tictactoe_on_evaluation_seeds(tmp_path: Path, tiny_model_dir: Path) -> None:
    """What `make run` shows (the embedded default, Tic-Tac-Toe, which has no held-out items, with eval.every):
    rounds played on the evaluation seeds, their success with win/draw/loss rates in the summary and in
    metrics.jsonl, the seed split recorded in the summary, and the curve drawn."""
    from earl_stream.env.seeds import SEED_SPLIT

    summary_path = tmp_path / "s.json"
    cmd = [sys.executable, "-m", "earl_stream", "up", "--steps", "6", "--summary", str(summary_path),
           f"model.path={tiny_model_dir}", f"run_dir={tmp_path / 'run'}", "trainer.groups_per_step=2",
           "trainer.group_size=4", "rollout.groups_in_flight=2", "rollout.workers=1", "supervisor.heartbeat_s=0.2",
           "eval.every=2", "eval.problems=4"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(summary_path.read_text())
    assert summary["seed_split"] == SEED_SPLIT
    e = summary["eval"]["tictactoe"]
    assert e["items"] == "eval_seeds" and e["problems"] == 4 and "error" not in e
    versions = [p["version"] for p in e["history"]]
    # the final version's round is always played (the trainer waits for it): the curve ends at the saved policy
    assert versions[0] == 0 and versions[-1] == 6 and versions == sorted(set(versions)), versions
    for p in e["history"]:
        rates = (p["win_rate"], p["draw_rate"], p["loss_rate"])
        assert all(0 <= r <= 1 for r in rates) and sum(rates) <= 1 + 1e-9 and p["value"] == p["win_rate"], p
    recorded = [p for r in read_records(tmp_path / "run") for p in (r.get("eval") or {}).get("tictactoe", [])]
    assert recorded and recorded[0]["version"] == 0 and all("win_rate" in p for p in recorded)
    assert recorded[-1]["version"] == 6  # the last step's record waited for the final round
    assert Path(summary["learning_curve_png"]).read_bytes()[:4] == b"\x89PNG"
