"""`earl-stream slurm render|submit` without a cluster: the knobs, the rendered heterogeneous job (valid
bash, one component per pool, addresses from the node lists), and one clear error when sbatch refuses
or is absent. The job itself runs on a real Slurm in `make test-slurm` (scripts/test-slurm.sh)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from earl_stream.cli import slurm as S
from earl_stream.errors import ConfigError, SlurmError
from earl_stream.security.keys import KeyRole, role_of


def _config(tmp_path: Path) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(f"run_dir: {tmp_path / 'run'}\nsteps: 3\nslurm:\n  partition: gpu\n  gpus_per_node: 8\n"
                    "  trainer_nodes: 2\n  trainer_ranks_per_node: 8\n")
    return path


def test_render_one_component_per_pool(tmp_path: Path) -> None:
    cfg, slurm = S.load(str(_config(tmp_path)), ["slurm.rollout_nodes=3", "slurm.time=2:00:00", "trainer.lr=1e-5"])
    assert cfg.steps == 3 and cfg.trainer.lr == 1e-5 and slurm.rollout_nodes == 3 and slurm.partition == "gpu"
    script = S.write(cfg, slurm)
    text = script.read_text()
    assert script.parent == (tmp_path / "run").resolve() and (script.parent / "config.yaml").is_file()
    # the run's config stays a RunConfig: the `slurm:` section is the script's (launcher.slurm is up's own)
    assert "slurm" not in yaml.safe_load((script.parent / "config.yaml").read_text())
    assert text.count("#SBATCH hetjob") == 2 and "#SBATCH --partition=gpu" in text
    components = text.split("#SBATCH hetjob")
    assert "--ntasks=1" in components[0] and "--gpus-per-node" not in components[0]
    assert "--nodes=3" in components[1] and "--gpus-per-node=8" in components[1]
    assert "--nodes=2" in components[2] and "--time=2:00:00" in components[0]
    for group, what in ((0, "supervisor --config"), (1, "worker --role rollout"), (2, "torchrun --nnodes=2")):
        line = next(ln for ln in text.splitlines() if ln.startswith(f"srun --het-group={group}"))
        assert what in line, line
    assert "--nproc-per-node=8" in text and "SLURM_JOB_NODELIST_HET_GROUP_0" in text
    # stopping: the time limit's SIGTERM reaches the batch shell alone, early enough for the trainer's grace
    # (120 s) and the rollout workers' and supervisor's 15 s each plus 30 s; the shell stops the pools in order
    assert "#SBATCH --signal=B:TERM@180" in components[0] and "trap stop_run TERM" in text
    assert "export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=120" in text
    for group in (1, 2):  # srun passes a SIGINT on to its tasks only with --disable-status
        assert "--disable-status" in next(ln for ln in text.splitlines() if ln.startswith(f"srun --het-group={group}"))
    subprocess.run(["bash", "-n", str(script)], check=True)  # valid bash


@pytest.mark.parametrize(("given", "encrypted"), [([], True), (["security.encrypt=auto"], True),
                                                   (["security.encrypt=false"], False)])
def test_the_job_encrypts_its_planes_by_default(tmp_path: Path, given: list[str], encrypted: bool) -> None:
    """The job's components run on different nodes: every process of it encrypts unless the user says not to."""
    cfg, slurm = S.load(str(_config(tmp_path)), given)
    text = S.write(cfg, slurm).read_text()
    written = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert cfg.security.encrypt is encrypted and written["security"]["encrypt"] is encrypted  # the supervisor's
    export = next(ln for ln in text.splitlines() if ln.startswith("export EARL_STREAM_ENCRYPT="))  # the workers'
    assert f"EARL_STREAM_ENCRYPT={int(encrypted)}" in export and f"EARL_STREAM_TLS={int(encrypted)}" in export
    assert ("HTTP endpoints encrypted" if encrypted else "not encrypted") in text


def test_bad_knobs_are_reported_together(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        S.load(str(_config(tmp_path)), ["slurm.rollout_nodes=0", "slurm.colour=red", "trainer.lr=fast"])
    message = str(err.value)
    assert "slurm.rollout_nodes" in message and "slurm.colour: unknown field" in message and "trainer.lr" in message


def test_submit_reports_sbatch_refusal_and_absence(tmp_path: Path) -> None:
    cfg, slurm = S.load(str(_config(tmp_path)), [])
    script = S.write(cfg, slurm)
    fake = tmp_path / "sbatch"
    fake.write_text("#!/bin/sh\necho 'sbatch: error: invalid partition specified: gpu' >&2\nexit 1\n")
    fake.chmod(0o755)
    with pytest.raises(SlurmError, match="sbatch refused .*invalid partition specified: gpu"):
        S.submit(script, cfg, sbatch=str(fake))
    assert (tmp_path / "run" / "secret").is_file()  # the job's supervisor finds the run's secret there
    worker_key = (tmp_path / "run" / "keys" / "worker").read_bytes().strip()  # and its workers their key
    assert role_of(worker_key) is KeyRole.WORKER and (tmp_path / "run" / "secret").read_bytes() not in worker_key
    text = script.read_text()
    assert text.index('export EARL_STREAM_SECRET_FILE="$RUN_DIR/keys/worker"') < text.index("--het-group=1")
    fake.write_text("#!/bin/sh\necho '4242;cluster'\n")
    assert S.submit(script, cfg, sbatch=str(fake)) == 4242
    with pytest.raises(SlurmError, match="not on PATH"):
        S.submit(script, cfg, sbatch="no-such-sbatch")


def test_cli_render_and_clear_error(tmp_path: Path) -> None:
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    cmd = [sys.executable, "-m", "earl_stream", "slurm"]
    out = subprocess.run([*cmd, "render", "--config", str(_config(tmp_path))], capture_output=True, text=True,
                         env=env, check=True).stdout
    assert out.strip().endswith(S.SCRIPT_NAME)
    fake = tmp_path / "sbatch"
    fake.write_text("#!/bin/sh\necho 'sbatch: error: Batch job submission failed: Invalid account' >&2\nexit 1\n")
    fake.chmod(0o755)
    proc = subprocess.run([*cmd, "submit", "--config", str(_config(tmp_path))], capture_output=True, text=True, env=env)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("earl-stream slurm: error: sbatch refused")
    fields = subprocess.run([*cmd, "fields"], capture_output=True, text=True, check=True).stdout
    assert "slurm.partition" in fields and "slurm.gpus_per_node" in fields


def test_the_jobs_summary_is_read_with_the_secret_not_the_worker_key(tmp_path: Path) -> None:
    """The workers run under the worker key, which may not read the run's status: the batch shell's summary asks
    with the cluster secret."""
    cfg, slurm = S.load(str(_config(tmp_path)), [])
    lines = S.write(cfg, slurm).read_text().splitlines()
    status = next(i for i, ln in enumerate(lines) if " status --supervisor " in ln)
    assert lines[status].startswith('EARL_STREAM_SECRET_FILE="$RUN_DIR/secret" ')
    workers = next(i for i, ln in enumerate(lines) if ln.startswith('export EARL_STREAM_SECRET_FILE="$RUN_DIR/keys/worker"'))
    assert workers < status
