"""How the slurm launcher (cli/launchers/slurm.py) stops a run, without a cluster: the trainer's step first,
by a SIGINT that srun passes on to its tasks (--disable-status), given trainer.stop_grace_s to finish its
step; then the rollout workers' and the supervisor's steps, the same way. A step that outlives its grace
gets the SIGTERM that makes srun kill its tasks. The real stop on a real Slurm: tests/cli/test_slurm_launcher.py."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
from cluster import wait_for

from earl_stream.cli.launchers import RunSpec
from earl_stream.cli.launchers import slurm as launcher_module
from earl_stream.cli.launchers.slurm import SlurmLauncher
from earl_stream.cli.procs import Child
from earl_stream.cli.up import prepare
from earl_stream.config import load_config
from earl_stream.security.secret import create_secret_file

# Stands in for srun around one task on this host, with the signal handling of Slurm 22.05's srun
# (src/srun/libsrun/srun_job.c): a SIGTERM kills the step's tasks at once ("forcing job termination"); a single
# SIGINT is passed on to them only under --disable-status (without it srun prints their state). Its task, a Python
# process like torchrun (a bash loop once lost a SIGINT on a loaded machine: its trap never ran), stands in for the
# earl-stream process: on a signal it notes it, takes $FAKE_STOP_S_<step> seconds to finish
# its work and exits 0. The supervisor's step writes its ready file.
FAKE_SRUN = f"""#!{sys.executable}
import json, os, signal, subprocess, sys, time
from pathlib import Path

args = sys.argv[1:]
name = "trainer" if "trainer" in args else "rollout" if "rollout" in args else "supervisor"
events = Path(os.environ["FAKE_SLURM_DIR"]) / f"{{name}}.events"
if "--ready-file" in args:  # whole, as the supervisor writes it
    ready = Path(args[args.index("--ready-file") + 1])
    ready.with_suffix(".tmp").write_text(json.dumps({{"address": "tcp://127.0.0.1:1"}}))
    ready.with_suffix(".tmp").rename(ready)


def on_signal(signum, _frame):  # Slurm signals every process of the step: here the task's process group
    with events.open("a") as out:
        out.write(f"srun {{signal.Signals(signum).name}} {{time.time()}}\\n")
    if signum == signal.SIGTERM:
        os.killpg(task.pid, signal.SIGKILL)
    elif "--disable-status" in args:
        os.killpg(task.pid, signal.SIGINT)

signal.signal(signal.SIGINT, on_signal)
signal.signal(signal.SIGTERM, on_signal)
task = subprocess.Popen([sys.executable, "-c", '''
import os, signal, sys, time
events, took = sys.argv[1], float(sys.argv[2])
def note(line):
    with open(events, "a") as out:
        out.write(line + "\\\\n")
def on(signum, _frame):
    note(f"task {{signal.Signals(signum).name[3:]}} {{time.time()}}")
    time.sleep(took)
    note(f"task exit {{time.time()}}")
    os._exit(0)
signal.signal(signal.SIGINT, on)
signal.signal(signal.SIGTERM, on)
note(f"task started {{os.environ.get('TORCH_ELASTIC_SHUTDOWN_TIMEOUT', '-')}}")
while True:
    time.sleep(0.05)''', str(events), os.environ.get(f"FAKE_STOP_S_{{name}}", "0")], start_new_session=True)
code = task.wait()
sys.exit(128 - code if code < 0 else code)
"""
FAKE_SCONTROL = """#!/bin/sh
case "$1 $2" in
    "show hostnames") printf 'n0\\nn1\\nn2\\n' ;;
    "show node") echo "NodeName=$3 Arch=x86_64 NodeAddr=127.0.0.1 NodeHostName=$3" ;;
esac
"""


def _launcher(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *overrides: str) -> SlurmLauncher:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n[0-2]")
    monkeypatch.setenv("FAKE_SLURM_DIR", str(tmp_path))
    cfg = load_config(None, [f"model.path={tmp_path / 'model'}", f"run_dir={tmp_path / 'run'}", "launcher.kind=slurm",
                             f"launcher.slurm.srun={bin_dir / 'srun'}", "trainer.nproc=2", *overrides])
    cfg, config_file = prepare(cfg)
    return SlurmLauncher(RunSpec(cfg, config_file, create_secret_file(tmp_path / "secret")))


def _events(tmp_path: Path, name: str) -> list[tuple[str, str, str]]:
    """(who, what, when or what else) of one step, in order: who is its srun or its task."""
    return [(w, x, rest) for w, x, rest in (line.split() for line in (tmp_path / f"{name}.events").read_text().splitlines())]


def _started(tmp_path: Path, *names: str) -> None:
    """Wait until the steps' sruns and tasks handle their signals (a loaded machine starts them slowly)."""
    wait_for(lambda: all((tmp_path / f"{n}.events").exists() and "task started" in (tmp_path / f"{n}.events").read_text()
                         for n in names), 30, f"the steps of {', '.join(names)}")


def _when(events: list[tuple[str, str, str]], who: str, what: str) -> float:
    return next(float(t) for w, x, t in events if (w, x) == (who, what))


@pytest.mark.parametrize("trainer_nodes", [1, 2])
def test_the_trainer_step_is_interrupted_first_and_given_its_grace(trainer_nodes: int, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_STOP_S_trainer", "2")  # its last step and checkpoint
    launcher = _launcher(tmp_path, monkeypatch, f"launcher.slurm.trainer_nodes={trainer_nodes}",
                         "trainer.stop_grace_s=30")
    _, address = launcher.start_supervisor()
    worker = launcher.start_rollout_worker(0, address)
    trainer = launcher.start_trainer_pool(address)
    _started(tmp_path, "supervisor", "rollout", "trainer")
    started = time.monotonic()
    launcher.stop()
    took = time.monotonic() - started
    launcher.stop()  # twice is safe
    assert worker.poll() is not None and trainer.poll() == 0  # the trainer finished: not killed
    sup, roll, train = (_events(tmp_path, n) for n in ("supervisor", "rollout", "trainer"))
    assert [(w, x) for w, x, _ in train] == [("task", "started"), ("srun", "SIGINT"), ("task", "INT"), ("task", "exit")]
    assert _when(train, "task", "exit") >= _when(train, "srun", "SIGINT") + 2.0
    # then the rollout worker and last the supervisor, each interrupted the same way and let finish (a rollout
    # worker's clean stop writes the samples it holds)
    for events in (roll, sup):
        assert [(w, x) for w, x, _ in events] == [("task", "started"), ("srun", "SIGINT"), ("task", "INT"),
                                                  ("task", "exit")]
    assert _when(train, "task", "exit") <= _when(roll, "srun", "SIGINT")
    assert _when(roll, "task", "exit") <= _when(sup, "srun", "SIGINT")
    assert isinstance(trainer, Child)
    if trainer_nodes == 1:  # `worker --nproc` passes the grace on to its ranks
        assert trainer.args[-2:] == ["--stop-grace", "30.0"], trainer.args
    else:  # torchrun gives its ranks as long before it kills them
        assert train[0] == ("task", "started", "30"), train
    print(f"stopped in {took:.1f}s")
    assert took < 10.0, took


def test_a_trainer_past_its_grace_is_terminated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_STOP_S_trainer", "60")
    monkeypatch.setattr(launcher_module, "STOP_GRACE_S", 0.5)  # beyond trainer.stop_grace_s, for the pool process
    launcher = _launcher(tmp_path, monkeypatch, "trainer.stop_grace_s=1")
    _, address = launcher.start_supervisor()
    trainer = launcher.start_trainer_pool(address)
    _started(tmp_path, "supervisor", "trainer")
    started = time.monotonic()
    launcher.stop()
    took = time.monotonic() - started
    assert trainer.poll() == 128 + 9  # srun, told to terminate the step, killed its task
    train = _events(tmp_path, "trainer")
    assert [(w, x) for w, x, _ in train] == [("task", "started"), ("srun", "SIGINT"), ("task", "INT"), ("srun", "SIGTERM")]
    # each side stamps its own receipt: a late SIGINT stamp shortens the gap by that delay (1.4999 s seen)
    assert _when(train, "srun", "SIGTERM") - _when(train, "srun", "SIGINT") >= 1.5 - 0.05
    assert took < 6.0, took


def test_a_rollout_worker_past_its_grace_is_terminated_before_the_supervisor_is_interrupted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_STOP_S_rollout", "60")
    monkeypatch.setattr(launcher_module, "STOP_GRACE_S", 0.5)
    launcher = _launcher(tmp_path, monkeypatch)
    _, address = launcher.start_supervisor()
    worker = launcher.start_rollout_worker(0, address)
    _started(tmp_path, "supervisor", "rollout")
    started = time.monotonic()
    launcher.stop()
    took = time.monotonic() - started
    assert worker.poll() == 128 + 9  # srun, told to terminate the step, killed its task
    roll, sup = _events(tmp_path, "rollout"), _events(tmp_path, "supervisor")
    assert [(w, x) for w, x, _ in roll] == [("task", "started"), ("srun", "SIGINT"), ("task", "INT"), ("srun", "SIGTERM")]
    assert [(w, x) for w, x, _ in sup][:2] == [("task", "started"), ("srun", "SIGINT")]
    # the rollout's grace waited out and its step terminated before the supervisor it talks to is interrupted
    assert _when(roll, "srun", "SIGINT") + 0.4 <= _when(roll, "srun", "SIGTERM") <= _when(sup, "srun", "SIGINT")
    assert took < 6.0, took
