"""`earl-stream up --launcher ray` on a real three-node Ray cluster started on this host (tests/ray_cluster.py):
the supervisor and the rollout workers on the head node, two trainer ranks (one placement group) spanning
the two other nodes, one torch.distributed group across them; `status --json` names each worker's Ray node;
a rollout worker whose process is killed is restarted by Ray and rejoins; stopped, the ranks finish their step
and checkpoint it together (trainer.stop_grace_s); the rollout pool scales 2 -> 3 -> 1
live with `earl-stream scale`; the runs train their steps and the ledger adds up. Bad input fails at once,
naming what is missing. Skipped where ray is not installed: `make test-ray` runs it in .venv-ray."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from cluster import wait_for
from ray_cluster import PLACEMENT, node_ids

from earl_stream import protocol as P
from earl_stream.config import load_config
from earl_stream.security.secret import load_secret
from earl_stream.workers import checkpoint as ckpt

pytestmark = [pytest.mark.slow, pytest.mark.ray]
STEPS = 20


def _up(tmp_path: Path, model_dir: Path, address: str, *extra: str, steps: int = STEPS) -> subprocess.Popen:
    """`up --launcher ray`; steps=0 runs until the test stops it (SIGINT: summary written, exit 0)."""
    cmd = [sys.executable, "-m", "earl_stream", "up", "--launcher", "ray", "--ray-address", address, "--steps",
           str(steps), "--summary", str(tmp_path / "s.json"), f"model.path={model_dir}", f"run_dir={tmp_path / 'run'}",
           "trainer.groups_per_step=2", "trainer.group_size=4", "rollout.groups_in_flight=2", "rollout.workers=2",
           "trainer.nproc=2", "supervisor.heartbeat_s=0.2", "supervisor.lease_s=3", "launcher.ray.placement_timeout_s=20",
           *PLACEMENT, *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})


def _status(run: Path) -> dict[str, Any] | None:
    ready = run / "supervisor.json"
    if not ready.exists():
        return None
    client = P.ControlClient(json.loads(ready.read_text())["address"], timeout_s=5, secret=load_secret(str(run / "secret")),
                             encrypt=load_config(str(run / "config.yaml")).security.encrypt)  # on across hosts
    try:
        return json.loads(client.call(P.StatusRequest()).status_json)
    finally:
        client.close()


def _alive(run: Path, role: str) -> list[dict[str, Any]]:
    return [w for w in (_status(run) or {}).get("workers", []) if w["alive"] and w["role"] == role]


def _stop(proc: subprocess.Popen) -> str:
    """SIGINT `up` (it stops every process and writes its summary) and return what it printed."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    out = proc.communicate(timeout=120)[0] if proc.stdout is not None and not proc.stdout.closed else ""
    return out


def _ledger_adds_up(s: dict[str, Any]) -> None:
    assert s["duplicates_detected"] == 0
    assert s["samples_produced"] == (s["samples_trained"] + s["samples_lost"] + s["samples_stale"] + s["samples_in_store"]
                                     + s["samples_claimed"])


def _kept_last_step(run: Path, out: str) -> None:
    """Stopped, both ranks finished their step and wrote its checkpoint together, within their grace."""
    logs = "".join(p.read_text() for p in sorted((run / "logs").glob("trainer-*.log")))
    stops = sorted(re.findall(r"trainer rank (\d): stopping after step (\d+), (?:checkpoint written at version|the "
                              r"checkpoint of version) (\d+)", logs))
    assert [r for r, _, _ in stops] == ["0", "1"] and len({(s, v) for _, s, v in stops}) == 1, logs[-3000:]
    last = int(stops[0][1])
    assert last == max(int(s) for s in re.findall(r"step (\d+): loss", logs)), logs[-3000:]
    latest = ckpt.latest_checkpoint(run)
    assert latest is not None and latest.name == f"step_{last:06d}", latest
    assert "did not stop within" not in out, out[-3000:]


def test_up_places_the_pools_on_different_ray_nodes_and_trains(tmp_path: Path, tiny_model_dir: Path,
                                                                ray_cluster: Any) -> None:
    started = time.monotonic()
    proc = _up(tmp_path, tiny_model_dir, ray_cluster.address, steps=0)
    run = tmp_path / "run"
    out = ""
    try:
        first = wait_for(lambda: len(_alive(run, "rollout")) == 2 and _alive(run, "rollout"), 240,
                         "2 rollout workers to register")
        victim = first[0]
        os.kill(victim["pid"], signal.SIGKILL)  # Ray restarts its actor; the new worker registers
        back = wait_for(lambda: [w for w in _alive(run, "rollout") if w["id"] not in {f["id"] for f in first}], 180,
                        "Ray to restart the killed rollout worker and it to rejoin")
        assert back[0]["ray_node_id"] == victim["ray_node_id"] and back[0]["pid"] != victim["pid"]
        trainers = wait_for(lambda: len(_alive(run, "trainer")) == 2 and _alive(run, "trainer"), 240,
                            "2 trainer ranks to register")
        wait_for(lambda: (_status(run) or {}).get("policy_version", 0) >= STEPS, 240, f"{STEPS} training steps")
        workers = _alive(run, "rollout") + trainers
        kinds = node_ids()
        where = {w["id"]: kinds.get(w["ray_node_id"]) for w in workers}
        print("placement:", {w["id"]: (w["host"], w["ray_node_id"][:12], where[w["id"]]) for w in workers})
        assert all(w["host"] for w in workers)
        assert {where[w["id"]] for w in workers if w["role"] == "rollout"} == {"rollout_node"}
        assert {where[w["id"]] for w in workers if w["role"] == "trainer"} == {"trainer_node"}
        assert len({w["ray_node_id"] for w in trainers}) == 2, "the trainer ranks span both trainer nodes"
    finally:
        out = _stop(proc)
    assert proc.returncode == 0, out[-4000:]  # a requested stop is a clean end
    s = json.loads((tmp_path / "s.json").read_text())
    print(f"ray run: {time.monotonic() - started:.0f}s, summary {json.dumps({k: v for k, v in s.items() if k != 'workers'})}")
    assert s["policy_version"] >= STEPS
    _ledger_adds_up(s)
    assert {w["ray_node_id"] for w in s["workers"] if w["role"] == "trainer"}.isdisjoint(
        {w["ray_node_id"] for w in s["workers"] if w["role"] == "rollout"})
    _kept_last_step(tmp_path / "run", out)


def _scale(run: Path, replicas: int) -> str:
    address = json.loads((run / "supervisor.json").read_text())["address"]
    done = subprocess.run([sys.executable, "-m", "earl_stream", "scale", "--role", "rollout", "--replicas", str(replicas),
                           "--supervisor", address, "--secret-file", str(run / "secret"), "--encrypt"],  # as the run
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_the_rollout_pool_scales_2_3_1_live_under_ray(tmp_path: Path, tiny_model_dir: Path, ray_cluster: Any) -> None:
    proc = _up(tmp_path, tiny_model_dir, ray_cluster.address, "trainer.checkpoint_every=3", "supervisor.lease_s=20",
               steps=0)
    run = tmp_path / "run"
    out = ""
    try:
        def version() -> int:
            return int((_status(run) or {}).get("policy_version", 0))

        first = wait_for(lambda: len(_alive(run, "rollout")) == 2 and version() >= 1 and _alive(run, "rollout"), 300,
                         "2 rollout workers and a step")
        said = _scale(run, 3)
        assert "3 wanted, 2 active" in said and "1 worker(s) to start" in said, said
        three = wait_for(lambda: len(_alive(run, "rollout")) == 3 and _alive(run, "rollout"), 240,
                         "up to start a third rollout worker on Ray")
        kinds = node_ids()
        assert {kinds.get(w["ray_node_id"]) for w in three} == {"rollout_node"}
        new = [w["id"] for w in three if w["id"] not in {f["id"] for f in first}]
        wait_for(lambda: any(w["stats"].get("episodes", 0) > 0 for w in _alive(run, "rollout") if w["id"] in new), 240,
                 "the third worker to play episodes")
        said = _scale(run, 1)
        assert "1 wanted, 1 active" in said and "draining" in said, said
        s = wait_for(lambda: (st := _status(run)) and st["pools"]["rollout"]["drained"] == 2 and st, 300,
                     "the two draining workers to finish their samples and leave")
        assert s["pools"]["rollout"]["desired"] == 1 and s["pools"]["rollout"]["active"] == 1
        at = s["policy_version"]
        wait_for(lambda: version() >= at + 3, 240, "three more steps with the one worker left")
    finally:
        out = _stop(proc)
    assert proc.returncode == 0, out[-4000:]  # a requested stop is a clean end
    s = json.loads((tmp_path / "s.json").read_text())
    print(f"ray scale run: summary {json.dumps({k: v for k, v in s.items() if k != 'workers'})}")
    # nothing lost on scale-down, and no prompt played again but for staleness: a group finished after the
    # staleness bound (a worker starting on 2 busy cores) is stale and re-issued, a lost one would add to
    # samples_lost (4 samples per group)
    assert s["samples_lost"] == 0 and s["prompts_reissued"] * 4 == s["samples_stale"]
    _ledger_adds_up(s)
    drained = [w for w in s["workers"] if w["role"] == "rollout" and w.get("drained")]
    assert len(drained) == 2 and all(not w["alive"] for w in drained)


def test_an_unreachable_ray_address_fails_at_once(tmp_path: Path, tiny_model_dir: Path) -> None:
    pytest.importorskip("ray", reason="ray is not installed (make test-ray)")
    started = time.monotonic()
    proc = _up(tmp_path, tiny_model_dir, "127.0.0.1:1")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "cannot reach the Ray cluster at 127.0.0.1:1" in out, out[-2000:]
    assert time.monotonic() - started < 60


def test_resources_no_node_has_fail_naming_them(tmp_path: Path, tiny_model_dir: Path, ray_cluster: Any) -> None:
    proc = _up(tmp_path, tiny_model_dir, ray_cluster.address, "launcher.ray.trainer.resources={a100: 1}")
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 2, out[-2000:]
    assert "no Ray node has the resources of one trainer process" in out and "a100" in out, out[-2000:]
