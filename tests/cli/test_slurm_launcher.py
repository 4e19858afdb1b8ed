"""`earl-stream up --launcher slurm` inside an allocation of a real Slurm cluster (`make test-slurm` starts
one on this host, nodes n0-n2, and runs the tests marked `slurm` under `salloc -N 3`): the supervisor and two
rollout workers run as srun steps on the first node, the two trainer ranks as one torchrun per node on the
other two (one torch.distributed group across nodes); the run trains its steps and the ledger adds up.
Stopped (Ctrl-C to `up`), a trainer pool on one node (`worker --nproc`) or on two (torchrun) finishes its step
and checkpoints it (trainer.stop_grace_s; the launcher's stop without Slurm: test_slurm_stop.py).
Skipped outside an allocation."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from cluster import wait_for

from earl_stream.workers import checkpoint as ckpt

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
if not os.environ.get("SLURM_JOB_ID"):
    pytest.skip("not inside a Slurm allocation (make test-slurm runs this under salloc)", allow_module_level=True)

STEPS = 3


def test_up_places_the_pools_as_srun_steps_and_trains(tmp_path: Path, tiny_model_dir: Path) -> None:
    summary = tmp_path / "s.json"
    cmd = [sys.executable, "-m", "earl_stream", "up", "--launcher", "slurm", "--steps", str(STEPS), "--summary",
           str(summary), f"model.path={tiny_model_dir}", f"run_dir={tmp_path / 'run'}", "trainer.nproc=2",
           "launcher.slurm.trainer_nodes=2", "rollout.workers=2", "trainer.groups_per_step=2", "trainer.group_size=4",
           "rollout.groups_in_flight=2", "supervisor.lease_s=30"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    logs = tmp_path / "run" / "logs"
    tails = {p.name: p.read_text()[-1500:] for p in logs.glob("*.log")} if logs.exists() else {}
    assert proc.returncode == 0, out[-3000:] + json.dumps(tails, indent=1)[-4000:]
    nodes = os.popen(f"scontrol show hostnames {os.environ['SLURM_JOB_NODELIST']}").read().split()
    assert len(nodes) == 3, nodes
    # the launcher says where it placed each process: front node for supervisor + rollout, the rest for the trainer
    assert f"slurm: supervisor on {nodes[0]}" in out and f"slurm: rollout worker 0 on {nodes[0]}" in out, out[-3000:]
    assert f"slurm: rollout worker 1 on {nodes[0]}" in out and f"slurm: trainer on {nodes[1]},{nodes[2]}" in out
    s = json.loads(summary.read_text())
    assert s["policy_version"] >= STEPS and s["duplicates_detected"] == 0 and s["samples_lost"] == 0
    assert s["samples_trained"] == s["policy_version"] * 8
    trainers = sorted(w["rank"] for w in s["workers"] if w["role"] == "trainer")
    assert trainers == [0, 1], s["workers"]


@pytest.mark.parametrize("trainer_nodes", [1, 2])
def test_a_stopped_run_keeps_the_trainers_last_step(trainer_nodes: int, tmp_path: Path, tiny_model_dir: Path) -> None:
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "earl_stream", "up", "--launcher", "slurm", "--steps", "0", "--summary",
           str(tmp_path / "s.json"), f"model.path={tiny_model_dir}", f"run_dir={run}", "trainer.nproc=2",
           f"launcher.slurm.trainer_nodes={trainer_nodes}", "rollout.workers=2", "trainer.groups_per_step=2",
           "trainer.group_size=4", "rollout.groups_in_flight=2", "supervisor.lease_s=30"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = run / "logs" / "trainer.log"

    def trained() -> list[int]:
        return [int(n) for n in re.findall(r"step (\d+): loss", log.read_text())] if log.exists() else []

    try:
        wait_for(lambda: proc.poll() is not None or max(trained(), default=0) >= 2, 300, "two training steps")
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]  # a requested stop is a clean end
    text = log.read_text()
    stops = sorted(re.findall(r"trainer rank (\d): stopping after step (\d+), (?:checkpoint written at version|the "
                              r"checkpoint of version) (\d+)", text))
    assert [r for r, _, _ in stops] == ["0", "1"] and len({(s, v) for _, s, v in stops}) == 1, text[-3000:]
    last = int(stops[0][1])
    assert last == max(trained()), text[-3000:]
    latest = ckpt.latest_checkpoint(run)
    assert latest is not None and latest.name == f"step_{last:06d}", latest
    # srun passed the stop on (not its SIGTERM, which kills the tasks at once), nothing was killed
    assert "sending Ctrl-C" in text and "forcing job termination" not in text, text[-3000:]
    assert "did not stop within" not in out, out[-3000:]
    # the rollout workers and the supervisor were interrupted the same way and stopped cleanly, not killed
    for name, clean in [*((f"rollout-{i}.log", "stopped after") for i in range(2)), ("supervisor.log", "supervisor stopped")]:
        other = (run / "logs" / name).read_text()
        assert "received SIGINT" in other or name == "supervisor.log", other[-2000:]
        assert clean in other and "forcing job termination" not in other, other[-2000:]
