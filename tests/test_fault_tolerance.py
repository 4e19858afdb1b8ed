"""Independent launch and failures, as real processes: a rollout worker killed with SIGKILL, the
supervisor killed and restarted from its state directory, a trainer rank killed with SIGKILL (the
pool restarts from its checkpoint), and peers without the cluster secret."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
from pathlib import Path

import pytest
from cluster import Cluster, wait_for

from earl_stream import protocol as P
from earl_stream.config import load_config
from earl_stream.errors import ProtocolError
from earl_stream.security.secret import create_secret_file, load_secret
from earl_stream.supervisor.server import Supervisor
from earl_stream.supervisor.wal import StateLog

pytestmark = pytest.mark.slow


@pytest.fixture()
def cluster(tmp_path: Path, tiny_model_dir: Path):  # type: ignore[no-untyped-def]
    c = Cluster(tmp_path, tiny_model_dir, "steps=40")
    yield c
    c.stop()


@pytest.mark.faults
def test_rollout_worker_killed_and_supervisor_restarted(cluster: Cluster) -> None:
    cluster.start_supervisor()
    port = int(cluster.address.rsplit(":", 1)[1])
    victim = cluster.worker("rollout-a", "rollout")
    cluster.worker("rollout-b", "rollout")
    trainer = cluster.worker("trainer", "trainer")
    wait_for(lambda: cluster.status()["policy_version"] >= 3, 180, "three training steps")
    # a rollout worker dies without warning: its samples are lost, its prompts re-issued
    # the supervisor's own ledger says when the victim holds prompts (heartbeat stats are sampled once a
    # second and miss short episodes): freeze it, confirm it still holds them, then kill it
    def victim_holds() -> bool:
        return any(w["pid"] == victim.pid and w["groups_held"] > 0 for w in cluster.status()["workers"])

    deadline = time.monotonic() + 120
    while True:
        assert time.monotonic() < deadline, "the victim never held prompts"
        if victim_holds():
            victim.send_signal(signal.SIGSTOP)
            time.sleep(0.3)  # messages it sent before freezing reach the supervisor first
            if victim_holds():
                break
            victim.send_signal(signal.SIGCONT)
        time.sleep(0.02)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    s = wait_for(lambda: (st := cluster.status()) and any(not w["alive"] for w in st["workers"]) and st, 30,
                 "the supervisor to declare the worker dead")
    assert s["prompts_reissued"] >= 1
    # the supervisor dies and comes back on the same port from its state directory
    cluster.procs["supervisor"].send_signal(signal.SIGKILL)
    cluster.procs["supervisor"].wait()
    version_before = s["policy_version"]
    time.sleep(1.0)
    cluster.start_supervisor(port)
    s = wait_for(lambda: (st := cluster.status()) and st["policy_version"] >= version_before + 2 and st, 180,
                 "training to continue after the supervisor restart")
    assert trainer.wait(240) == 0
    s = cluster.status()
    assert s["policy_version"] == 40
    waiting = s["samples_in_store"]
    assert s["samples_produced"] == s["samples_consumed"] + s["samples_lost"] + s["samples_stale"] + waiting
    # late rows of a worker declared dead are counted as duplicates and never trained
    # (a group whose producer died after the claim is dropped from its step and counted lost)
    assert 40 * 2 * 4 - s["samples_lost"] <= s["samples_consumed"] <= 40 * 2 * 4


def test_peer_without_the_secret_is_refused(cluster: Cluster, tmp_path: Path) -> None:
    cluster.start_supervisor()
    wrong = create_secret_file(tmp_path / "other")
    for secret in (None, load_secret(str(wrong))):
        client = P.ControlClient(cluster.address, timeout_s=5, secret=secret)
        with pytest.raises(ProtocolError, match="refused|authentication"):
            client.call(P.Register(role=P.Role.ROLLOUT, shard_address="x:1"))
        client.close()
    assert cluster.status()["workers"] == []  # it learned nothing and registered nothing
    log = (cluster.tmp / "supervisor.log").read_text()
    assert "refused a control message (unsigned)" in log


def _trained_journal(state_dir: Path) -> dict[int, dict]:
    """Released steps from the supervisor's trained.jsonl (a step journaled twice has the same content)."""
    steps: dict[int, dict] = {}
    for line in (state_dir / "trained.jsonl").read_text().splitlines():
        entry = json.loads(line)
        assert steps.setdefault(entry["step"], entry) == entry
    return steps


def _hit_rank_1_after_checkpoint(c: Cluster, sig: int, min_version: int, not_pid: int = 0) -> tuple[dict, int]:
    """Send `sig` to trainer rank 1 once the run is past `min_version` with trained steps no checkpoint holds."""
    def ready() -> tuple[dict, int] | None:
        st = c.status()
        pids = [w["pid"] for w in st["workers"] if w["role"] == "trainer" and w["rank"] == 1 and w["alive"]
                and w["pid"] != not_pid]
        ok = st["policy_version"] >= min_version and st["samples_uncheckpointed"] > 0 and len(pids) == 1
        return (st, pids[0]) if ok else None

    s, pid = wait_for(ready, 240, f"version {min_version} with trained steps after the last checkpoint")
    assert s["samples_produced"] == (s["samples_consumed"] + s["samples_lost"] + s["samples_stale"]
                                     + s["samples_in_store"] + s["samples_claimed"])
    os.kill(pid, sig)
    return s, pid


@pytest.mark.faults
def test_trainer_rank_killed_pool_resumes_from_checkpoint(tmp_path: Path, tiny_model_dir: Path) -> None:
    steps = 20  # room for both kills to find a step that no checkpoint holds yet, however fast the run
    c = Cluster(tmp_path, tiny_model_dir, f"steps={steps}", "trainer.nproc=2", "trainer.checkpoint_every=3")
    pool_args = ("worker", "--role", "trainer", "--supervisor", "", "--nproc", "2", "--collective-timeout", "15")
    try:
        c.start_supervisor()
        c.worker("rollout", "rollout")
        args = [a or c.address for a in pool_args]
        pool = c.start("trainer", *args, "--restart", "1")
        # 1) rank 1 hangs: rank 0 gives up on the collective after 15 s with an error naming what it waited
        #    for; with --restart 1 the pool restarts by itself and resumes from its checkpoint
        _, first = _hit_rank_1_after_checkpoint(c, signal.SIGSTOP, 4)
        # 2) rank 1 is killed; the restart is used up, so the pool stops with an error naming the rank ...
        _hit_rank_1_after_checkpoint(c, signal.SIGKILL, 8, not_pid=first)
        assert pool.wait(120) != 0
        # ... and resumes when it is relaunched by hand
        pool = c.start("trainer-relaunched", *args)
        assert pool.wait(300) == 0, (tmp_path / "trainer-relaunched.log").read_text()[-3000:]
        s = c.status()
    finally:
        c.stop()
    log = (tmp_path / "trainer.log").read_text()
    assert re.search(r"trainer rank 0 of 2: a collective with the other ranks \(step \d+; rendezvous at \S+\) "
                     r"failed or waited longer than 15s", log)
    assert "restarting the trainer pool (1 of 1)" in log
    assert "was killed by SIGKILL; the trainer pool stopped after 1 restarts" in log
    log += (tmp_path / "trainer-relaunched.log").read_text()
    resumed = [int(n) for n in re.findall(r"resumed from \S+ at step (\d+)", log)]
    # two incarnations x two ranks; a checkpoint every 3 steps, or the one rank 0 writes when it is stopped
    assert len(resumed) == 2 * 2 and all(r >= 3 for r in resumed)
    reached = max(int(n) for n in re.findall(r"step (\d+): loss", log[:log.index("restarting the trainer pool")]))
    assert s["policy_version"] == steps and s["samples_claimed"] == s["samples_uncheckpointed"] == 0
    assert s["samples_produced"] == (s["samples_consumed"] + s["samples_lost"] + s["samples_stale"]
                                     + s["samples_in_store"] + s["samples_claimed"])
    # every step trained exactly once in the model that came out, none skipped, no prompt twice
    journal = _trained_journal(tmp_path / "state")
    assert sorted(journal) == list(range(steps))
    trained = [o for e in journal.values() for o in e["trained"]]
    assert len(trained) == len(set(trained)) == steps * 2 - sum(len(e["lost"]) for e in journal.values())
    # the supervisor's state as a restart rebuilds it: its snapshot and write-ahead log
    shutil.copytree(tmp_path / "state", tmp_path / "state-copy")
    rebuilt = Supervisor(load_config(None, c.overrides))
    StateLog(tmp_path / "state-copy").recover(rebuilt, time.monotonic())
    led = rebuilt.ledger
    skipped = set(range(max(trained))) - set(trained) - set(led.groups)
    assert not skipped, f"prompts neither trained nor outstanding: {sorted(skipped)}"
    print(f"trainer pool hung at version {reached}, resumed from the checkpoints of steps {resumed}; "
          f"ledger: produced {s['samples_produced']}, consumed {s['samples_consumed']}, "
          f"lost {s['samples_lost']}, stale {s['samples_stale']}, waiting {s['samples_in_store']}, "
          f"reissued {s['prompts_reissued']}, duplicates {s['duplicates_detected']}")


_GATHER = """
import json, os, sys, time
import torch.distributed as dist
from earl_stream.store.schema import SCHEMA_VERSION, SampleMeta
from earl_stream.workers.batches import agree_on_lost
dist.init_process_group("gloo")
metas = [SampleMeta(schema_version=SCHEMA_VERSION, sample_id=f"g{i // 2}.0-{i % 2}", prompt_ordinal=i // 2,
                    episode_id=str(i), group_id=f"g{i // 2}.0", env="e", turns=1, prompt_tokens=1, response_tokens=1,
                    total_tokens=2, reward=0.0, advantage=None, policy_version_min=0, policy_version_max=0,
                    producer_id="w", producer_address="h:1", checksum=0, created_at=0.0, info_json="{}")
         for i in range(6)]
# only rank 1 could not pull group g2 (its producer died after rank 0 had pulled its own rows)
mine = ["g2.0-0", "g2.0-1"] if dist.get_rank() == 1 else []
pulled = {i: {} for i in range(6) if metas[i].sample_id not in mine}
kept, lost = agree_on_lost(metas, pulled, mine)
print(json.dumps({"lost": lost, "kept": sorted(kept)}))
dist.destroy_process_group()
"""


def test_lost_ids_of_every_rank_reach_rank_0(tmp_path: Path) -> None:
    """Rank 0 releases the step: it must know what rank 1 failed to pull (agreed without pickles), and
    no rank trains a row of a group another rank lost."""
    import subprocess
    import sys

    from spawned_ranks import free_port  # the rendezvous port, outside the ephemeral range

    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", _GATHER], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": str(port)}) for r in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    # both ranks drop group g2 before training (rank 0 had pulled its rows) and report its ids
    expected = {"lost": ["g2.0-0", "g2.0-1"], "kept": [0, 1, 2, 3]}
    assert [json.loads(o.strip().splitlines()[-1]) for o in outs] == [expected] * 2


@pytest.mark.faults
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc to size the cap")
def test_one_rank_fails_to_allocate_and_the_pool_leaves_the_step_together(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Out-of-memory recovery on a pool of two: only rank 1 runs under an address-space cap, so its first long-context
    step fails to allocate while rank 0, which fits, goes on (computing, or already in the gradients'
    all-reduce: timing decides; the in-collective case is pinned down by tests/workers/test_pool_abort.py). Both leave
    the step within trainer.oom_abort_seconds (+ slack), the pool re-forms its process group and trains the
    same rows under a more frugal plan and then the next steps: nothing lost, nothing trained twice."""
    import subprocess
    import sys

    from test_oom_recovery_live import HEADROOM, LONG_PROMPT_ENV, _trained

    from earl_stream.workers.oom_step import AS_CAP_RANKS_ENV, AS_HEADROOM_ENV

    steps, abort_s, slack_s = 4, 5.0, 2.0
    run = tmp_path / "run"
    env_file = tmp_path / "long_prompt.py"
    env_file.write_text(LONG_PROMPT_ENV)
    proc = subprocess.run(
        [sys.executable, "-m", "earl_stream", "up", "--summary", str(tmp_path / "summary.json"), f"steps={steps}",
         f"model.path={tiny_model_dir}", f"run_dir={run}", f"envs.0.spec={env_file}:LongPrompt", "trainer.nproc=2",
         "trainer.groups_per_step=2", "trainer.group_size=4", "rollout.groups_in_flight=2", "rollout.workers=1",
         "supervisor.heartbeat_s=0.2", "trainer.malloc_mmap_threshold=65536", "trainer.max_staleness=4",
         f"trainer.oom_abort_seconds={abort_s}", f"selector.trainer_memory_bytes={8 << 30}", "selector.reserve_bytes=0",
         "selector.initial_seq_len=2048"],
        env={**os.environ, AS_HEADROOM_ENV: str(HEADROOM[2]), AS_CAP_RANKS_ENV: "1"}, capture_output=True, text=True,
        timeout=600)
    log = (run / "logs" / "trainer.log").read_text() if (run / "logs" / "trainer.log").exists() else ""
    assert proc.returncode == 0, (proc.stdout[-3000:], log[-4000:])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["oom_recoveries"] and summary["steps"] == steps, (summary["oom_recoveries"], log[-4000:])
    assert summary["samples_lost"] == 0 and summary["duplicates_detected"] == 0
    assert "resumed from" not in log and "restarting the trainer pool" not in log  # no crash, no resume
    for r in summary["oom_recoveries"]:  # each recovery's plan is more frugal than the one that failed
        assert r["error"].startswith("rank 1: ") and r["plan_after"], r
        assert (r["micro_batch_tokens_after"] < r["micro_batch_tokens_before"] or r["plan_after"] != r["plan_before"]), r
    # rank 0 (uncapped) left within the bound: from inside a collective (it fails once rank 1's groups are
    # aborted) or while computing (PeerAbandoned, from its watcher), whichever it was doing at the time
    left = [(float(s), why) for s, why in re.findall(
        r"trainer rank 0: rank 1 failed to allocate \(.*?\); left the step ([0-9.]+)s after it \((\w+)", log)]
    assert left and all(s < abort_s + slack_s for s, _ in left), (left, log[-4000:])
    own = [float(s) for s in re.findall(r"trainer rank 1: left the step ([0-9.]+)s after it failed to allocate", log)]
    assert own and all(s < abort_s + slack_s for s in own), (own, log[-4000:])
    assert "the pool re-formed (generation 1)" in log
    assert _trained(log) == [s for s in range(1, steps + 1) for _ in range(2)], log[-4000:]
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == \
        list(range(1, steps + 1))
    print("rank 0 left the step (s after rank 1's failure, how):", left, "rank 1 left (s):", own)
