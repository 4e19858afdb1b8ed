"""Live model parallelism: a two-rank trainer pool on `long_recall` (episodes grow as the run goes on)
under a per-rank memory budget starts on an FSDP2 plan and, when contexts outgrow it, re-shards live
to a tensor-parallel plan; training goes on across the switch and the sample ledger adds up.

With the tiny model and a 27 MiB budget per rank (~4 MiB of it the two policy versions a rank keeps
published) the selector's memory model admits (sequence
parallelism switched off, so the choice is between data, FSDP and tensor parallelism): design length
256 -> fsdp2 (plain data parallel does not fit), 512 -> tp2 (FSDP no longer does: tp also splits the
attention scores by heads). The math of every plan and of a re-shard is tests/test_parallel_equivalence.py.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path
from typing import Any

import pytest
from cluster import Cluster, wait_for

pytestmark = pytest.mark.slow


def _adopted(cluster: Cluster, name: str) -> dict[str, Any] | None:
    s = cluster.status()
    history = s["plans"]["trainer_history"]
    return s if any(h["plan"]["name"] == name for h in history) else None


@pytest.mark.live
def test_trainer_pool_reshards_from_fsdp_to_tensor_parallel_live(tmp_path: Path, tiny_model_dir: Path) -> None:
    # ~120-token episodes at first, one more fact turn (~35 tokens) every 2 new prompt groups; capped at
    # 9 turns (~370 tokens) so that contexts stay inside the 512-token design length's thresholds
    cluster = Cluster(tmp_path, tiny_model_dir, "steps=0", "trainer.nproc=2", "envs.0.spec=long_recall",
                      "envs.0.name=long_recall", "envs.0.params={turns: 2, max_turns: 9, grow_every: 2}",
                      "selector.context_window=16", "selector.min_episodes_between=8",
                      "selector.initial_seq_len=256", f"selector.trainer_memory_bytes={27 << 20}",
                      "selector.reserve_bytes=0", "selector.allow_sp=false", "selector.lower_factor=0.1")
    try:
        cluster.start_supervisor()
        cluster.worker("rollout", "rollout")
        cluster.worker("trainer", "trainer", "--nproc", "2")
        first = wait_for(lambda: _adopted(cluster, "fsdp2"), 120, "the fsdp2 plan adopted")
        assert first["plans"]["trainer"]["fsdp"] == 2, first["plans"]
        s = wait_for(lambda: _adopted(cluster, "tp2"), 240, "a re-shard to tp2 as contexts grow")
        plan = s["plans"]["trainer"]
        assert (plan["tp"], plan["fsdp"], plan["design_seq_len"]) == (2, 1, 512), plan
        switched_at = next(h["step"] for h in s["plans"]["trainer_history"] if h["plan"]["name"] == "tp2")
        wait_for(lambda: cluster.status()["policy_version"] >= switched_at + 3, 150, "training after the re-shard")
        log = (tmp_path / "trainer.log").read_text()
        assert re.search(r"re-laid the model from fsdp2 to tp2", log), log[-3000:]
        trained = [int(x) for x in re.findall(r"step (\d+): loss", log)]
        assert any(t >= switched_at + 2 for t in trained), log[-3000:]
        assert "Traceback" not in log, log[-3000:]
        s = cluster.status()
        held = s["samples_in_store"] + s["samples_claimed"]  # ready for a claim, or claimed and in training
        assert s["samples_produced"] == s["samples_consumed"] + s["samples_lost"] + s["samples_stale"] + held, s
        assert s["samples_lost"] == 0
    finally:
        cluster.stop()


@pytest.mark.faults
def test_a_rank_that_hangs_during_a_reshard_stops_the_pool_which_resumes_under_the_plan_in_force(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    """Trainer rank 1 is frozen (SIGSTOP) the moment the pool starts re-laying the model from fsdp2 to
    tp2: rank 0's collective gives up with an error naming the re-shard and its step, `--restart 1`
    starts the pool again, it resumes from its latest checkpoint, adopts the plan in force (tp2) and
    trains on; nothing is lost."""
    cluster = Cluster(tmp_path, tiny_model_dir, "steps=0", "trainer.nproc=2", "trainer.checkpoint_every=2",
                      "envs.0.spec=long_recall", "envs.0.name=long_recall",
                      "envs.0.params={turns: 2, max_turns: 9, grow_every: 2}", "selector.context_window=16",
                      "selector.min_episodes_between=8", "selector.initial_seq_len=256",
                      f"selector.trainer_memory_bytes={27 << 20}", "selector.reserve_bytes=0",
                      "selector.allow_sp=false", "selector.lower_factor=0.1")
    try:
        cluster.start_supervisor()
        cluster.worker("rollout", "rollout")
        cluster.worker("trainer", "trainer", "--nproc", "2", "--restart", "1", "--collective-timeout", "15")
        log_path = tmp_path / "trainer.log"

        def rank_1_in_reshard() -> int | None:
            if "re-laying the model from fsdp2 to tp2" not in log_path.read_text():
                return None
            pids = [w["pid"] for w in cluster.status()["workers"]
                    if w["role"] == "trainer" and w["rank"] == 1 and w["alive"]]
            return pids[0] if pids else None

        pid = wait_for(rank_1_in_reshard, 300, "the pool to start re-laying fsdp2 -> tp2")
        os.kill(pid, signal.SIGSTOP)
        wait_for(lambda: "restarting the trainer pool (1 of 1)" in log_path.read_text(), 120, "the pool to restart")
        log = log_path.read_text()
        assert re.search(r"a collective with the other ranks \(re-shard to plan v\d+ \(tp2\) before step \d+; "
                         r"rendezvous at \S+\) failed or waited longer than 15s", log), log[-3000:]
        restart = log.index("restarting the trainer pool (1 of 1)")
        wait_for(lambda: re.search(r"adopted trainer plan v\d+: tp2", log_path.read_text()[restart:]), 180,
                 "the restarted pool to adopt the plan in force")
        after = log_path.read_text()[restart:]
        resumed = [int(n) for n in re.findall(r"resumed from \S+ at step (\d+)", after)]
        written = [int(n) for n in re.findall(r"checkpoint of step (\d+) written", log[:restart])]
        # both ranks from the latest checkpoint written before the hang (none yet: a fresh start)
        assert resumed == ([max(written)] * 2 if written else []), after[-3000:]
        start = cluster.status()["policy_version"]
        s = wait_for(lambda: (st := cluster.status()) and st["policy_version"] >= start + 3 and st, 180,
                     "training after the restart")
        assert s["plans"]["trainer"]["tp"] == 2 and s["samples_lost"] == 0
        held = s["samples_in_store"] + s["samples_claimed"]
        assert s["samples_produced"] == s["samples_consumed"] + s["samples_lost"] + s["samples_stale"] + held, s
    finally:
        cluster.stop()
