"""No idle after a re-plan: contexts grow through several re-plans while the rollout worker's
batches run longer than the supervisor's lease. The trainer's idle time before each step after a re-plan
stays within the switch's own seconds plus one rollout of a group, and no worker is declared dead.

What this guards: a rollout worker applied a new plan (and, in drain mode, each new policy version) from
its heartbeat loop, and both wait for the engine's running rows. Its beats stopped for the rest of the
batch; a batch longer than the lease got the worker declared dead, its group played again, and the
trainer sat idle for a second rollout after the re-plan (146.6 s at ~4K tokens in
bench/results/real_scale.json). Here `rollout.weight_swap=drain` makes every version wait for the running
group, and the lease (1 s) is shorter than a group at the longest contexts (4 episodes of ~4K tokens).
"""

from __future__ import annotations

import datetime
import re
from pathlib import Path

import pytest
from cluster import Cluster, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.live]

_STAMP = r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) "
_STEP = re.compile(_STAMP + r".*step (\d+): loss .* in ([\d.]+)s", re.M)
_ADOPTED = re.compile(_STAMP + r".*step (\d+): adopted trainer plan v(\d+)", re.M)
_RELAID = re.compile(_STAMP + r".*step (\d+): re-laid the model .* in ([\d.]+)s", re.M)
_GROUP = re.compile(_STAMP + r".*group (g\S+): (\d+) episodes, (\d+) tokens in ([\d.]+)s", re.M)


def _t(stamp: str) -> float:
    return datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def test_no_idle_after_a_replan_while_batches_outlast_the_lease(tmp_path: Path, tiny_model_dir: Path) -> None:
    # ~540 tokens per episode at first, doubling every 2 groups up to ~4K (long_recall's filler)
    cluster = Cluster(tmp_path, tiny_model_dir, "steps=0", "envs.0.spec=long_recall", "envs.0.name=long_recall",
                      "envs.0.params={turns: 1, max_turns: 1, facts_per_turn: 2, filler_words: 150, filler_factor: 2.0, "
                      "grow_every: 2, max_filler_words: 1200}",
                      "selector.context_window=16", "selector.min_episodes=2", "selector.min_episodes_between=2",
                      "selector.initial_seq_len=256", "selector.headroom=1.1", "selector.upper_factor=0.95",
                      "trainer.groups_per_step=1", "trainer.group_size=4", "trainer.max_staleness=1",
                      "rollout.groups_in_flight=1", "rollout.weight_swap=drain",
                      "supervisor.heartbeat_s=0.1", "supervisor.lease_s=1.0")
    try:
        cluster.start_supervisor()
        cluster.worker("rollout", "rollout")
        cluster.worker("trainer", "trainer")
        wait_for(lambda: cluster.status()["policy_version"] >= 9, 300, "9 steps")
        status = cluster.status()
    finally:
        cluster.stop()
    trainer = (tmp_path / "trainer.log").read_text()
    rollout = (tmp_path / "rollout.log").read_text()
    supervisor = (tmp_path / "supervisor.log").read_text()
    assert "declared dead" not in supervisor, supervisor[-3000:]
    assert status["samples_lost"] == 0 and status["prompts_reissued"] == 0, status

    groups = [(g, int(tokens), float(s)) for _, g, _, tokens, s in _GROUP.findall(rollout)]
    assert max(tokens for _, tokens, _ in groups) > 14_000, groups  # four episodes of ~4K: the longest level was played
    longest_group = max(s for _, _, s in groups)
    assert longest_group > 1.0, groups  # a group outlasted the lease: the case this test is about

    ends = {int(n): _t(stamp) for stamp, n, _ in _STEP.findall(trainer)}
    starts = {int(n): _t(stamp) - float(s) for stamp, n, s in _STEP.findall(trainer)}
    relaid = {int(n): float(s) for _, n, s in _RELAID.findall(trainer)}
    replans = sorted({int(step) for _, step, version in _ADOPTED.findall(trainer) if int(version) >= 3})
    assert len(replans) >= 3, trainer[-3000:]  # contexts grew through several re-plans
    checked = []
    for step in replans:  # "step S: adopted" is the claim of step S, logged as "step S+1: loss"
        for n in (step + 1, step + 2):
            if n in starts and n - 1 in ends:
                idle = starts[n] - ends[n - 1]
                bound = relaid.get(step, 0.0) + longest_group + 1.0  # the switch + one rollout (+1 s of polling)
                checked.append((n, round(idle, 2), round(bound, 2)))
                assert idle <= bound, (checked, groups)
    assert len(checked) >= 4, checked
    print("idle before the steps after each re-plan (step, idle s, bound s):", checked)
