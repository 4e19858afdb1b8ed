"""Bad input, live: episodes that outgrow the largest plan the trainer pool can run are
stopped by the rollout worker at the rollout plan's `max_episode_tokens`, counted in the status as
`samples_too_long`, and the run goes on training; no process crashes. Real supervisor, rollout worker
and trainer processes on loopback, `long_recall` growing one fact turn (~35 tokens) per prompt group."""

from __future__ import annotations

from pathlib import Path

import pytest
from cluster import Cluster, wait_for

pytestmark = pytest.mark.slow
MIB = 1 << 20


def test_episodes_past_the_largest_trainer_plan_stop_and_are_counted(tmp_path: Path, tiny_model_dir: Path) -> None:
    # 37 MiB per trainer rank (8.5 of them the two policy versions it keeps published) fits one sequence of 384
    # tokens of the tiny model at most: episodes grow past it
    cluster = Cluster(tmp_path, tiny_model_dir, "steps=0", "envs.0.spec=long_recall", "envs.0.name=long_recall",
                      "envs.0.params={turns: 4, max_turns: 24, grow_every: 1}", "selector.context_window=16",
                      "selector.initial_seq_len=256", "selector.reserve_bytes=0",
                      f"selector.trainer_memory_bytes={37 * MIB}", f"rollout.memory_bytes={256 * MIB}")
    try:
        cluster.start_supervisor()
        plan = cluster.status()["plans"]["rollout"]
        assert plan["max_episode_tokens"] == 384 and "the longest sequence a trainer plan fits" in plan["sizing"], plan
        cluster.worker("rollout", "rollout")
        cluster.worker("trainer", "trainer")
        s = wait_for(lambda: (st := cluster.status())["samples_too_long"] >= 8 and st["policy_version"] >= 3 and st,
                     240, "episodes stopped as too long, and training")
        assert s["context_length"]["max"] <= 384 and s["outcomes_last"].get("truncated", 0) > 0, s["context_length"]
        assert all(w["alive"] for w in s["workers"]), s["workers"]
        assert all(p.poll() is None for p in cluster.procs.values())
    finally:
        cluster.stop()
