"""Live re-planning: a run on `long_recall`, whose episodes get longer as the run goes on, crosses the
selector's thresholds; the supervisor re-plans (seen in `earl-stream status --json`, key "plans"),
the trainer adopts the new plan at a step boundary (its log), and training goes on after it; the
cost model is refit from the trainer's measured step times."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from cluster import Cluster, wait_for

pytestmark = pytest.mark.slow


def _status_cli(cluster: Cluster, *flags: str) -> str:
    out = subprocess.run([sys.executable, "-m", "earl_stream", "status", *flags, "--supervisor", cluster.address],
                         env=cluster.env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def _replanned(cluster: Cluster) -> dict[str, Any] | None:
    s = cluster.status()
    trainer = (s.get("plans") or {}).get("trainer") or {}
    return s if trainer.get("version", 0) >= 3 else None


def _history_covers(cluster: Cluster, adopted: list[tuple[str, str]]) -> list[dict[str, Any]] | None:
    history = cluster.status()["plans"]["trainer_history"]
    return history if len(history) >= len(adopted) else None


@pytest.mark.live
def test_growing_contexts_replan_the_trainer_live(tmp_path: Path, tiny_model_dir: Path) -> None:
    # one more fact turn (~35 tokens) every 2 new prompt groups: ~120 tokens at first, past the
    # 256-token initial design length's upper threshold (0.9 x 256) after ~10 groups (~5 steps), past
    # 0.9 x 512 after ~22; capped at 16 turns (~600 tokens)
    cluster = Cluster(tmp_path, tiny_model_dir, "steps=0", "envs.0.spec=long_recall",
                      "envs.0.name=long_recall", "envs.0.params={turns: 2, max_turns: 16, grow_every: 2}",
                      "selector.context_window=16", "selector.min_episodes_between=8",
                      "selector.initial_seq_len=256", "selector.cost_model_min_steps=4")
    try:
        cluster.start_supervisor()
        cluster.worker("rollout", "rollout")
        cluster.worker("trainer", "trainer")
        first = cluster.status()["plans"]["trainer"]
        assert first["version"] == 1 and first["design_seq_len"] == 256, first
        s = wait_for(lambda: _replanned(cluster), 150, "two trainer re-plans")
        plan = s["plans"]["trainer"]
        assert plan["design_seq_len"] == 1024 and "p99 context" in plan["reason"], plan
        replanned_at = s["policy_version"]
        wait_for(lambda: cluster.status()["policy_version"] >= replanned_at + 3, 150, "training after the re-plan")
        s = json.loads(_status_cli(cluster, "--json"))
        assert s["plans"]["trainer"]["version"] >= plan["version"] and s["context_length"]["p99"] > 230
        line = _status_cli(cluster)  # the one-line view shows the plan in force, by name (one rank: dp1)
        assert re.search(r"plan v(\d+) dp1 \(1024 tok", line) and int(re.search(r"plan v(\d+)", line)[1]) >= 3, line
        log = (tmp_path / "trainer.log").read_text()
        adopted = re.findall(r"step (\d+): adopted trainer plan v(\d+)", log)
        versions = [int(v) for _, v in adopted]
        assert versions[0] == 1 and 3 in versions and versions == sorted(versions), log[-3000:]
        # every adoption reached the status (the trainer's PlanAdopted), with the plan it adopted, by name
        history = wait_for(lambda: _history_covers(cluster, adopted), 30, "the adoptions in plans.trainer_history")
        history = history[:len(adopted)]  # the run goes on: later adoptions may follow
        assert [(h["version"], h["plan"]["name"]) for h in history] == [(int(v), "dp1") for _, v in adopted]
        assert all(h["reason"] == h["plan"]["reason"] and h["step"] == int(step)
                   for h, (step, _) in zip(history, adopted))
        step_of_v3 = next(int(step) for step, v in adopted if int(v) == 3)
        assert step_of_v3 > 0
        trained = [int(x) for x in re.findall(r"step (\d+): loss", log)]
        assert any(t >= step_of_v3 + 2 for t in trained), log[-3000:]  # "step N: loss" is version N = step + 1
        # the cost model was refit live from the trainer's measured step times
        calibration = wait_for(lambda: cluster.status()["plans"]["cost_model"].get("steps"), 60, "a cost-model refit")
        assert calibration >= 4
        print("plans seen:", json.dumps(s["plans"], indent=1))
        print("trainer adopted:", adopted)
        print("steps (version, tokens, seconds, pull):",
              re.findall(r"step (\d+): loss .*?(\d+) tokens\) in ([\d.]+)s \(pull ([\d.]+)s\)", log))
    finally:
        cluster.stop()
