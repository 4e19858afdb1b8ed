"""End to end: `earl-stream up` as real processes on loopback; samples flow rollout -> store ->
trainer, and the policy version reaches the rollout workers."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cluster import wait_for

from earl_stream import protocol as P
from earl_stream.security.secret import SECRET_ENV, create_secret_file, load_secret
from earl_stream.store.ucx import ucx_available
from earl_stream.supervisor.metrics_log import read_records

pytestmark = pytest.mark.slow


def _up(tmp_path: Path, model_dir: Path, steps: int, *extra: str, timeout: float = 300) -> tuple[subprocess.CompletedProcess, dict]:
    summary = tmp_path / "s.json"
    cmd = [sys.executable, "-m", "earl_stream", "up", "--steps", str(steps), "--summary", str(summary),
           f"model.path={model_dir}", f"run_dir={tmp_path / 'run'}", "trainer.groups_per_step=2",
           "trainer.group_size=4", "rollout.groups_in_flight=2", "supervisor.heartbeat_s=0.2", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads(summary.read_text())


def test_up_trains_through_the_store(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Also `logging.backends=[jsonl,tensorboard]` (where tensorboard is installed): each step's record
    reaches TensorBoard with the values of metrics.jsonl, the summary and learning curve at the end."""
    tensorboard = importlib.util.find_spec("tensorboard") is not None
    trackers = ("logging.backends=[jsonl,tensorboard]", "logging.tags=[smoke]") if tensorboard else ()
    _, summary = _up(tmp_path, tiny_model_dir, 4, *trackers)
    for key in ("steps", "policy_version", "samples_trained", "samples_produced", "mean_reward_last",
                "win_rate_last", "draw_rate_last", "tokens_per_second", "wall_seconds"):
        assert key in summary
    assert summary["policy_version"] >= 4
    assert summary["samples_trained"] >= 4 * 2 * 4
    assert summary["samples_produced"] >= summary["samples_trained"]
    logs = tmp_path / "run" / "logs"
    trainer_log = (logs / "trainer.log").read_text()
    pulled = [int(x) for x in re.findall(r"\((\d+) samples", trainer_log)]
    assert len(pulled) >= 4 and all(n == 8 for n in pulled)
    rollout_logs = [p.read_text() for p in logs.glob("rollout-*.log")]
    versions = [int(v) for text in rollout_logs for v in re.findall(r"loaded policy version (\d+)", text)]
    assert versions and max(versions) >= 2, "rollout workers never loaded a new policy version"
    assert (tmp_path / "run" / "checkpoints" / "latest").exists()
    png = Path(summary["learning_curve_png"])
    assert png == tmp_path / "learning_curve.png" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the per-step record (supervisor/metrics_log.py): steps count from 1, as the policy version each one made
    records = read_records(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2, 3, 4] and all(r["loss"] is not None for r in records)
    # each step's samples by staleness, read from the claim the supervisor held when the step was published
    assert all(sum(r["staleness"].values()) == 2 * 4 for r in records), [r["staleness"] for r in records]
    assert all(r["context_p90"] is not None for r in records[1:])
    # the summary's step figures are the record's
    assert summary["metrics"]["steps_recorded"] == 4 and summary["last_loss"] == records[-1]["loss"]
    if tensorboard:
        _check_tensorboard(tmp_path / "run", records, summary_text="s")  # _up's --summary is tmp_path/s.json


def _check_tensorboard(run_dir: Path, records: list[dict], summary_text: str) -> None:
    """The run's TensorBoard events, read back with TensorBoard's own reader, hold every number of each
    step's record at its step, the config, tags and summary texts and the curve image; RUN_DIR/tracking.json
    ends at the last step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from earl_stream.tracking import flatten
    from earl_stream.tracking.feed import STATE_FILE

    state = json.loads((run_dir / STATE_FILE).read_text())
    assert state["last_step"] == records[-1]["step"]
    (logdir,) = (run_dir / "tensorboard").iterdir()
    assert logdir.name == state["ids"]["id"]
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0, "images": 0})
    acc.Reload()
    for record in records:
        for key, value in flatten(record).items():
            (event,) = [e for e in acc.Scalars(key) if e.step == record["step"]]
            assert event.value == pytest.approx(value, rel=1e-6), key
    assert "loss" in acc.Tags()["scalars"] and "staleness/0" in acc.Tags()["scalars"]
    assert acc.Tags()["images"] == ["learning_curve"]
    # a file's text goes under its name: the summary's is `up --summary`'s file name
    assert {"config", "tags", summary_text} <= {t.removesuffix("/text_summary") for t in acc.Tags()["tensors"]}


@pytest.mark.live
@pytest.mark.parametrize("dispatch", ["pull", "central"])
def test_up_with_two_trainer_ranks(tmp_path: Path, tiny_model_dir: Path, dispatch: str) -> None:
    _, summary = _up(tmp_path, tiny_model_dir, 2, "trainer.nproc=2", "rollout.workers=1", f"store.dispatch={dispatch}")
    assert summary["policy_version"] >= 2
    assert summary["samples_trained"] >= 2 * 2 * 4


@pytest.mark.live
def test_up_relays_weights_through_the_rollout_pool(tmp_path: Path, tiny_model_dir: Path) -> None:
    """store.weight_sync=relay: the first rollout worker pulls each version from the trainer and serves it
    on; the second pulls it from the first (store/relay.py, routed by the supervisor). The run goes on until
    both have loaded a version that way (a 4-step run could end before a late second worker pulled once)."""
    logs_dir = tmp_path / "run" / "logs"
    pattern = re.compile(r"loaded policy version (\d+) in \S+ \(relayed from ([^)]*)\)")

    def relayed() -> dict[str, list[tuple[str, str]]]:
        return {p.name: pattern.findall(p.read_text()) for p in logs_dir.glob("rollout-*.log")}

    def chain_seen() -> bool:
        found = relayed()
        return (any(via.startswith("the trainer") for f in found.values() for _, via in f)
                and any(re.fullmatch(r"[\d.]+:\d+", via) for f in found.values() for _, via in f))

    cmd = [sys.executable, "-m", "earl_stream", "up", "--steps", "0", f"model.path={tiny_model_dir}",
           f"run_dir={tmp_path / 'run'}", "trainer.groups_per_step=2", "trainer.group_size=4",
           "rollout.groups_in_flight=2", "supervisor.heartbeat_s=0.2", "store.weight_sync=relay", "rollout.workers=2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: proc.poll() is not None or chain_seen(), 240,
                 "a version loaded from the trainer by one worker and relayed through it to the other")
        stopped_at = time.strftime("%Y-%m-%d %H:%M:%S")
    finally:
        proc.send_signal(signal.SIGINT)
        out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0 and chain_seen(), out[-3000:]  # a requested stop exits 0
    # no relayed pull fell back to the trainer while the run trained (other than for a version the run had
    # moved past: a worker routed while it joined); once it stops, a worker may still be pulling the last
    # version while the trainer and the other worker exit (refused or reset connections)
    logs = [p.read_text() for p in logs_dir.glob("rollout-*.log")]
    failures = [line for text in logs for line in text.splitlines()
                if ("failed" in line or "instead" in line) and "superseded" not in line and line[:19] < stopped_at]
    assert not failures, failures


@pytest.mark.ucx
@pytest.mark.skipif(not ucx_available(), reason="ucxx is not installed (make test-ucx runs this in .venv-ucx)")
def test_up_pulls_samples_and_weights_over_ucx(tmp_path: Path, tiny_model_dir: Path) -> None:
    """store.transport=ucx: every pull (samples by the two trainer ranks, weights by the rollout worker, the
    ranks' pieces from each other) goes over UCX, or the run fails saying why."""
    _, summary = _up(tmp_path, tiny_model_dir, 3, "store.transport=ucx", "trainer.nproc=2", "rollout.workers=1")
    assert summary["policy_version"] >= 3 and summary["samples_trained"] >= 3 * 2 * 4
    logs = "".join(p.read_text() for p in (tmp_path / "run" / "logs").glob("*.log"))
    over = set(re.findall(r"pulling from shard node \S+ over (\w+)", logs))
    assert over == {"ucx"}, over


@pytest.mark.live
def test_piped_up_stopped_by_ctrl_c_writes_its_summary(tmp_path: Path, tiny_model_dir: Path) -> None:
    """`earl-stream up | tee log` and Ctrl-C: the terminal sends SIGINT to both, tee exits first and the run's
    output has no reader; the run still stops its processes and writes its summary and learning curve."""
    log = tmp_path / "log"
    shell = (f"{sys.executable} -m earl_stream up --steps 0 model.path={tiny_model_dir} run_dir={tmp_path / 'run'} "
             "trainer.groups_per_step=2 trainer.group_size=4 rollout.groups_in_flight=2 supervisor.heartbeat_s=0.2 "
             f"| tee {log}")
    proc = subprocess.Popen(["bash", "-c", shell], start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    summary = tmp_path / "run" / "summary.json"
    try:
        wait_for(lambda: proc.poll() is not None or re.search(r"step +[1-9]", log.read_text() if log.exists() else ""),
                 240, "the piped run to show a trained step")
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C does: the whole foreground group, tee included
        proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert summary.exists(), proc.stderr.read()[-3000:] if proc.stderr else ""
    written = json.loads(summary.read_text())
    assert written["steps"] >= 1 and written["learning_curve_png"]
    assert Path(written["learning_curve_png"]).read_bytes()[:4] == b"\x89PNG"


def test_up_reports_bad_model_dir(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "earl_stream", "up", "--steps", "1", f"model.path={tmp_path}/nope",
                           f"run_dir={tmp_path / 'run'}"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr.splitlines()[-1]
    assert f"model directory {tmp_path}/nope does not exist" in proc.stderr.splitlines()[-1]
    assert not (tmp_path / "run" / "logs" / "trainer.log").exists()  # refused before any process started


@pytest.mark.faults
def test_resume_with_more_steps_trains_every_step_on_data(tmp_path: Path, tiny_model_dir: Path) -> None:
    """`up --resume --steps M` after a finished run goes on; the earlier run's workers are declared dead at
    once, so no step is spent on samples whose producers are gone."""
    _up(tmp_path, tiny_model_dir, 2)
    _, summary = _up(tmp_path, tiny_model_dir, 4, "--resume")
    assert summary["policy_version"] == 4
    assert summary["samples_trained"] == 4 * 2 * 4
    assert [r["step"] for r in read_records(tmp_path / "run")] == [1, 2, 3, 4]  # appended, each step once
    assert "belongs to the earlier run: declared dead" in (tmp_path / "run" / "logs" / "supervisor.log").read_text()
    trainer_log = (tmp_path / "run" / "logs" / "trainer.log").read_text()
    assert [int(n) for n in re.findall(r"\((\d+) samples", trainer_log)][-2:] == [8, 8]


def _pid_of(role: str, run_dir: Path) -> int:
    """The pid of this run's `earl-stream ROLE` process (its command line names the run's config)."""
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if role.encode() in cmd and any(str(run_dir).encode() in part for part in cmd):
            return int(proc.name)
    raise AssertionError(f"no {role} process of {run_dir}")


@pytest.mark.faults
def test_up_survives_kill_9_of_a_rollout_worker_and_of_the_supervisor(tmp_path: Path, tiny_model_dir: Path) -> None:
    steps, run = 12, tmp_path / "run"
    secret = create_secret_file(tmp_path / "secret")
    summary_path = tmp_path / "s.json"
    cmd = [sys.executable, "-m", "earl_stream", "up", "--steps", str(steps), "--restart", "2",
           "--summary", str(summary_path), f"model.path={tiny_model_dir}", f"run_dir={run}",
           "trainer.groups_per_step=2", "trainer.group_size=4", "rollout.groups_in_flight=2",
           "supervisor.heartbeat_s=0.2", "supervisor.lease_s=3"]
    log = tmp_path / "up.log"
    with open(log, "wb") as out:
        up = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, SECRET_ENV: str(secret)})

    def status() -> dict:
        try:  # `up` rewrites the ready file when it restarts the supervisor
            address = json.loads((run / "supervisor.json").read_text())["address"]
        except (OSError, ValueError, KeyError):
            return {}
        client = P.ControlClient(address, timeout_s=5, secret=load_secret(str(secret)))
        try:
            return json.loads(client.call(P.StatusRequest()).status_json)
        finally:
            client.close()

    try:
        s = wait_for(lambda: (st := status()) and st["policy_version"] >= 2 and st, 240, "two training steps")
        victim = next(w["pid"] for w in s["workers"] if w["role"] == "rollout" and w["alive"])
        os.kill(victim, signal.SIGKILL)
        version = s["policy_version"]
        s = wait_for(lambda: (st := status()) and st["policy_version"] >= version + 2 and st, 240,
                     "training to go on after a rollout worker was killed")
        os.kill(_pid_of("supervisor", run), signal.SIGKILL)
        version = s["policy_version"]
        wait_for(lambda: (st := status()) and st["policy_version"] >= version + 2, 240,
                 "training to go on after the supervisor was killed")
        assert up.wait(300) == 0, log.read_text()[-3000:]
    finally:
        if up.poll() is None:
            up.terminate()
            up.wait(60)
    text = log.read_text()
    for who in (r"rollout worker \d", "supervisor"):
        assert re.search(who + r" \(pid \d+\) was killed by SIGKILL; its log: \S+; starting it again", text), text[-3000:]
    summary = json.loads(summary_path.read_text())
    assert summary["policy_version"] == steps
    # nothing counted twice: what was trained, lost or refused as stale all came from what was produced
    assert summary["samples_trained"] + summary["samples_lost"] + summary["samples_stale"] <= summary["samples_produced"]
    assert summary["samples_trained"] >= (steps - 2) * 2 * 4  # at most the steps around the kills lose groups
    # the restarted supervisor appended to RUN_DIR/metrics.jsonl: every step once
    assert [r["step"] for r in read_records(run)] == list(range(1, steps + 1))
