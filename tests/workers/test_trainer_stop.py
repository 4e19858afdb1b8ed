"""A stopped trainer pool keeps its last step (workers/trainer.py, cli/worker.py, cli/procs.py): Ctrl-C
to `earl-stream up` lets each rank finish its step, and the ranks agree on the step to stop after, so
they write its checkpoint together, also under a sharded (FSDP) plan, where no rank alone could;
`up --resume` continues from that checkpoint. Before, a stopped sharded pool wrote none, and the run
resumed from its last periodic checkpoint (here: from scratch)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cluster import REPLY_LENGTH_ENV, wait_for

from earl_stream.workers import checkpoint as ckpt

pytestmark = pytest.mark.slow

# A 27 MiB memory budget per rank (~4 MiB of it the policy versions a rank keeps published) and no tp or
# sp: the selector's only plan that fits is fsdp2 (weights and Adam state sharded), held for the whole run.
FSDP_ONLY = [f"selector.trainer_memory_bytes={27 << 20}", "selector.reserve_bytes=0", "selector.allow_sp=false",
             "selector.allow_tp=false", "selector.initial_seq_len=256", "selector.lower_factor=0.01",
             "selector.min_episodes_between=1000000"]


def _up(run: Path, model_dir: Path, *args: str) -> subprocess.Popen:
    env_file = run.parent / "short_reply.py"
    env_file.write_text(REPLY_LENGTH_ENV)
    return subprocess.Popen([sys.executable, "-m", "earl_stream", "up", "--summary", str(run.parent / "summary.json"),
                             *args, f"model.path={model_dir}", f"run_dir={run}", f"envs.0.spec={env_file}:ReplyLength",
                             "trainer.groups_per_step=2", "trainer.group_size=4", "rollout.groups_in_flight=2",
                             "rollout.workers=1", "supervisor.heartbeat_s=0.2", "trainer.checkpoint_every=1000"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _trained(log: str) -> list[int]:
    return [int(s) for s in re.findall(r"step (\d+): loss", log)]


@pytest.mark.live
def test_a_stopped_fsdp_pool_checkpoints_its_last_step_and_resumes_from_it(tmp_path: Path,
                                                                          tiny_model_dir: Path) -> None:
    run = tmp_path / "run"
    log_path = run / "logs" / "trainer.log"
    proc = _up(run, tiny_model_dir, "trainer.nproc=2", *FSDP_ONLY)
    try:
        wait_for(lambda: log_path.exists() and max(_trained(log_path.read_text()), default=0) >= 3
                 or proc.poll() is not None, 120, "the pool to train 3 steps")
        proc.send_signal(signal.SIGINT)
        started = time.monotonic()
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]  # a requested stop (Ctrl-C) exits 0
    log = log_path.read_text()
    assert re.search(r"adopted trainer plan v\d+: fsdp2", log), "the pool did not train sharded: " + log[-3000:]
    last = max(_trained(log))
    latest = ckpt.latest_checkpoint(run)
    assert latest is not None and latest.name == f"step_{last:06d}", f"trained up to step {last}, latest: {latest}"
    assert [p.name for p in ckpt.checkpoints_dir(run).glob("step_*")] == [latest.name]  # no periodic one
    assert sorted(f.name for f in (latest / ckpt.DCP_DIR).glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert sorted(re.findall(r"trainer rank (\d): stopping after step (\d+), checkpoint written at version (\d+)",
                             log)) == [("0", str(last), str(last)), ("1", str(last), str(last))], log[-3000:]
    assert "killing it" not in out and "Traceback" not in log, out[-3000:]
    print(f"stopped after step {last}, its checkpoint written by both ranks; up ended {time.monotonic() - started:.1f}s "
          "after Ctrl-C")

    # one rank resumes from it (DCP gathers the shards) and trains one more step
    size = log_path.stat().st_size
    proc = _up(run, tiny_model_dir, "--resume", "--steps", str(last + 1), "trainer.nproc=1")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-3000:]
    log = log_path.read_text()[size:]
    assert re.search(rf"resumed from \S+step_{last:06d} at step {last}\b", log), log[-3000:]
    assert _trained(log) == [last + 1], log[-3000:]
    assert json.loads((tmp_path / "summary.json").read_text())["policy_version"] == last + 1
