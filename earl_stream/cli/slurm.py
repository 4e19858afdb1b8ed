"""`earl-stream slurm render|submit`: a run as one Slurm heterogeneous job, one component per pool.

Component 0 runs the supervisor, component 1 the rollout pool (one worker per task), component 2 the
trainer pool (`srun` starts one `torchrun` per node, which starts the node's ranks; rank 0's node is
the rendezvous). Addresses come from the job's node lists (`scontrol show hostnames`), so nothing is
known before the job starts. The run's directory must be on a filesystem every node sees: it holds
the config, the cluster secret (the supervisor's) and the worker key (keys/worker, the workers'), the
supervisor's ready file and state, logs and checkpoints.
Stopping (the time limit's `--signal=B:TERM@...`, or `scancel --batch --signal=TERM`) reaches the batch
shell alone, which stops the trainer first, as `up` does; a plain scancel kills after KillWait.

This module owns the Slurm knobs (`SlurmConfig`), the script and the call to `sbatch`; the processes
are the same entry points as everywhere (`earl-stream supervisor`, `earl-stream worker`).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

from earl_stream.cli.launchers.slurm import stopped_is_success
from earl_stream.cli.procs import STOP_GRACE_S
from earl_stream.config import RunConfig, apply_run_override, config_from_dict, config_to_yaml
from earl_stream.config.fields import apply_override, build
from earl_stream.config.fields import field as _f
from earl_stream.errors import ConfigError, SlurmError
from earl_stream.security.encryption import ENCRYPT_ENV
from earl_stream.security.secret import create_secret_file, load_secret
from earl_stream.security.tls import tls_env
from earl_stream.supervisor.revocation import write_worker_key

SCRIPT_NAME = "earl-stream.sbatch"
SECTION = "slurm"  # the config file's section (and the overrides' prefix) read by this module


@dataclasses.dataclass(frozen=True)
class SlurmConfig:
    partition: str = _f("", "partition (queue) to submit to; empty = the cluster's default")
    account: str = _f("", "account to charge; empty = your default")
    time: str = _f("01:00:00", "wall-time limit of the job (Slurm's time format, e.g. 2-00:00:00)")
    job_name: str = _f("earl-stream", "the job's name in squeue")
    rollout_nodes: int = _f(1, "nodes of the rollout pool", minimum=1)
    rollout_workers_per_node: int = _f(1, "rollout workers on each rollout node (one per GPU is usual)", minimum=1)
    trainer_nodes: int = _f(1, "nodes of the trainer pool (torchrun across them)", minimum=1)
    trainer_ranks_per_node: int = _f(1, "trainer ranks on each trainer node (= its GPUs on a GPU cluster)",
                                     minimum=1)
    gpus_per_node: int = _f(0, "GPUs to request on each rollout and trainer node (0 = a CPU run)", minimum=0)
    cpus_per_task: int = _f(1, "CPUs for each supervisor, rollout-worker and trainer-node task", minimum=1)
    mem: str = _f("", "memory per node, e.g. 64G; empty = the partition's default")
    master_port: int = _f(29500, "port of the trainer pool's torch.distributed rendezvous on its first node",
                          minimum=1)
    command: str = _f("earl-stream", "how a node runs earl-stream (a path to a virtualenv's script, or a "
                      "container wrapper such as `apptainer exec IMG earl-stream`)")
    torchrun: str = _f("torchrun", "how a trainer node runs torchrun")
    setup: str = _f("", "shell lines run at the top of the job (module load ..., source venv/bin/activate)")
    ready_timeout_s: int = _f(300, "give up when the supervisor does not listen within this many seconds",
                              minimum=1)
    extra_sbatch: str = _f("", "more #SBATCH options for every component, space-separated, e.g. --constraint=a100")


def load(config: str | None, overrides: list[str]) -> tuple[RunConfig, SlurmConfig]:
    """The run's config and its `slurm:` section (`slurm.KEY=V` overrides go to the latter), validated
    together: one ConfigError lists every problem."""
    raw: dict[str, Any] = {}
    if config:
        path = Path(config)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        loaded = yaml.safe_load(path.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must hold a mapping at the top level")
        raw = loaded
    slurm_raw = {SECTION: raw.pop(SECTION, None) or {}}
    errors: list[str] = []
    for item in overrides:
        if item.startswith(f"{SECTION}.time="):  # as typed: YAML would read 2:00:00 as the number 7200
            slurm_raw[SECTION]["time"] = item.partition("=")[2]
            continue
        if item.startswith(SECTION + "."):
            apply_override(slurm_raw, item, errors)
        else:
            apply_run_override(raw, item, errors)
    if not isinstance(slurm_raw[SECTION].get("time", ""), str):
        errors.append(f"{SECTION}.time: quote it, e.g. '2:00:00' (YAML reads an unquoted 2:00:00 as the number 7200)")
        slurm_raw[SECTION].pop("time")
    slurm = build(SlurmConfig, slurm_raw[SECTION], SECTION + ".", errors)
    security = raw.setdefault("security", {})
    if isinstance(security, dict) and security.get("encrypt", "auto") == "auto":
        security["encrypt"] = True  # the job's components run on different nodes: both planes encrypted by default
    try:
        cfg = config_from_dict(raw)
    except ConfigError as exc:
        errors.append(str(exc).removeprefix("invalid configuration:\n  "))
    if errors:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(errors))
    return cfg, slurm


def _encryption_exports(cfg: RunConfig) -> str:
    """The lines of the job script that make every process of the job encrypt its planes and serve TLS (or
    not), as `up`'s launchers pass it on, and say which in the job's output."""
    env = {ENCRYPT_ENV: "1" if cfg.security.encrypt else "0", **tls_env(cfg.security)}
    said = ("control plane, data plane and HTTP endpoints encrypted (security.encrypt)" if cfg.security.encrypt
            else "planes not encrypted (security.encrypt=false)")
    return "export " + " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + f"\necho {shlex.quote(said)}"


def render(cfg: RunConfig, slurm: SlurmConfig, config_file: Path) -> str:
    """The sbatch script for `cfg` (already written to `config_file`, which every node must see)."""
    run_dir = Path(cfg.run_dir).resolve()
    earl, q = slurm.command, shlex.quote
    gpus = [f"--gpus-per-node={slurm.gpus_per_node}"] if slurm.gpus_per_node else []
    common = [f"--cpus-per-task={slurm.cpus_per_task}", *([f"--mem={slurm.mem}"] if slurm.mem else []),
              *shlex.split(slurm.extra_sbatch)]
    components = [["--nodes=1", "--ntasks=1", *common],
                  [f"--nodes={slurm.rollout_nodes}", f"--ntasks-per-node={slurm.rollout_workers_per_node}",
                   *gpus, *common],
                  [f"--nodes={slurm.trainer_nodes}", "--ntasks-per-node=1", *gpus, *common]]
    grace = math.ceil(cfg.trainer.stop_grace_s)
    # the batch shell (B:) alone gets SIGTERM this long before the time limit (Slurm may send it up to 60 s
    # earlier) and stops the pools in order: the trainer's grace, then STOP_GRACE_S each for the rollout
    # workers and the supervisor, and 30 s to spare
    lead = grace + 2 * math.ceil(STOP_GRACE_S) + 30
    header = ["#!/bin/bash", f"#SBATCH --job-name={slurm.job_name}", f"#SBATCH --time={slurm.time}",
              f"#SBATCH --output={run_dir}/slurm-%j.out", f"#SBATCH --signal=B:TERM@{lead}",
              *([f"#SBATCH --partition={slurm.partition}"] if slurm.partition else []),
              *([f"#SBATCH --account={slurm.account}"] if slurm.account else [])]
    for i, opts in enumerate(components):
        if i:
            header.append("#SBATCH hetjob")
        header += [f"#SBATCH {o}" for o in opts]
    world = slurm.trainer_nodes * slurm.trainer_ranks_per_node
    torchrun = stopped_is_success(
        f"{slurm.torchrun} --nnodes={slurm.trainer_nodes} --nproc-per-node={slurm.trainer_ranks_per_node} "
        f"--node-rank=$SLURM_NODEID --master-addr=$TRAIN_HOST --master-port={slurm.master_port} --no-python "
        f"{earl} worker --role trainer --supervisor $ADDR --advertise $(hostname)")
    body = f"""
# Rendered by `earl-stream slurm render`: supervisor (component 0), {slurm.rollout_nodes * slurm.rollout_workers_per_node}
# rollout worker(s) (component 1), {world} trainer rank(s) on {slurm.trainer_nodes} node(s) (component 2).
set -uo pipefail
{slurm.setup}
RUN_DIR={q(str(run_dir))}
export EARL_STREAM_SECRET_FILE="$RUN_DIR/secret"
{_encryption_exports(cfg)}
[ -r "$EARL_STREAM_SECRET_FILE" ] || {{
    echo "no cluster secret at $EARL_STREAM_SECRET_FILE (earl-stream slurm submit writes one)"; exit 2; }}
# a component's first node, by its address (NodeAddr; the node's name where the two are the same)
first_addr() {{ scontrol show node "$(scontrol show hostnames "$1" | head -n1)" | grep -o 'NodeAddr=[^ ]*' | cut -d= -f2; }}
SUP_HOST=$(first_addr "$SLURM_JOB_NODELIST_HET_GROUP_0")
TRAIN_HOST=$(first_addr "$SLURM_JOB_NODELIST_HET_GROUP_2")
READY="$RUN_DIR/supervisor-$SLURM_JOB_ID.json"
mkdir -p "$RUN_DIR/logs"
srun --het-group=0 --output="$RUN_DIR/logs/supervisor-%j.log" {earl} supervisor --config {q(str(config_file))} \\
    --bind 0.0.0.0:0 --ready-file "$READY" --state-dir "$RUN_DIR" &
SUP_PID=$!
for _ in $(seq {slurm.ready_timeout_s * 10}); do [ -s "$READY" ] && break; kill -0 $SUP_PID 2>/dev/null || break; sleep 0.1; done
[ -s "$READY" ] || {{
    echo "the supervisor did not listen within {slurm.ready_timeout_s}s: see $RUN_DIR/logs/supervisor-*.log"
    kill $SUP_PID; exit 3; }}
PORT=$(grep -o '"address": *"[^"]*"' "$READY" | sed -E 's/.*:([0-9]+)"$/\\1/')
export ADDR="tcp://$SUP_HOST:$PORT" TRAIN_HOST
echo "supervisor at $ADDR; trainer rendezvous at $TRAIN_HOST:{slurm.master_port}"
export EARL_STREAM_SECRET_FILE="$RUN_DIR/keys/worker"  # the workers get the worker key, never the cluster secret
srun --het-group=1 --disable-status --output="$RUN_DIR/logs/rollout-%j-%t.log" \
    bash -c 'exec {earl} worker --role rollout --supervisor $ADDR --advertise $(hostname)' &
ROLL_PID=$!
# A SIGTERM to this shell (Slurm's, {lead} s before the time limit; or `scancel --batch --signal=TERM JOBID`)
# stops the pools in order: srun --disable-status passes a SIGINT on to its tasks, the trainer's ranks
# finish their step and write a checkpoint (trainer.stop_grace_s, {grace} s), then the rollout workers
# persist the samples they hold, then the supervisor stops. A plain scancel kills after the cluster's KillWait.
STOPPING=
stop_run() {{
    STOPPING=1
    echo "SIGTERM: stopping the trainer pool (up to {grace} s for its step and checkpoint)"
    kill -INT $TRAIN_PID 2>/dev/null
}}
trap stop_run TERM
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT={grace}  # torchrun's wait for its stopping ranks
srun --het-group=2 --disable-status --output="$RUN_DIR/logs/trainer-%j-%t.log" bash -c {q(torchrun)} &
TRAIN_PID=$!
while :; do wait $TRAIN_PID; RC=$?; kill -0 $TRAIN_PID 2>/dev/null || break; done  # a trapped signal ends a wait
EARL_STREAM_SECRET_FILE="$RUN_DIR/secret" {earl} status --supervisor "$ADDR" --json \\
    > "$RUN_DIR/summary-$SLURM_JOB_ID.json" || RC=${{RC:-4}}  # status is not the worker key's to read
# the rollout workers stop by themselves once the run is finished; stopped early, they are told to
[ -z "$STOPPING" ] || kill -INT $ROLL_PID 2>/dev/null
for _ in $(seq 300); do kill -0 $ROLL_PID 2>/dev/null || break; sleep 0.1; done
kill $ROLL_PID 2>/dev/null
kill -TERM $SUP_PID 2>/dev/null
wait
echo "trainer pool exited with $RC${{STOPPING:+ (stopped by SIGTERM)}}"
exit $RC
"""
    return "\n".join(header) + "\n" + body


def write(cfg: RunConfig, slurm: SlurmConfig, out_dir: Path | None = None) -> Path:
    """Write the run's config and its sbatch script into `out_dir` (default run_dir); the script's path."""
    out = (out_dir or Path(cfg.run_dir)).resolve()
    out.mkdir(parents=True, exist_ok=True)
    config_file = out / "config.yaml"
    config_file.write_text(config_to_yaml(cfg))
    script = out / SCRIPT_NAME
    script.write_text(render(cfg, slurm, config_file))
    return script


def submit(script: Path, cfg: RunConfig, sbatch: str = "sbatch") -> int:
    """Submit `script` with the run's secret and worker key in place; the job id. A refusal raises SlurmError."""
    secret = Path(cfg.run_dir).resolve() / "secret"
    if not secret.is_file():
        create_secret_file(secret)
    key = load_secret(str(secret))
    assert key is not None
    write_worker_key(secret.parent, key)  # the workers' key: only the supervisor gets the secret
    if shutil.which(sbatch) is None:
        raise SlurmError(f"cannot submit: `{sbatch}` is not on PATH (is this a Slurm login node?); the script is "
                         f"at {script}")
    proc = subprocess.run([sbatch, "--parsable", str(script)], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        why = (proc.stderr or proc.stdout).strip().splitlines()
        raise SlurmError(f"sbatch refused {script}: {why[-1] if why else f'exit code {proc.returncode}'}")
    try:
        return int(proc.stdout.strip().split(";")[0])
    except ValueError:
        raise SlurmError(f"sbatch answered {proc.stdout.strip()!r}, not a job id") from None


def add_parser(sub: Any) -> None:
    """`slurm render|submit` under the top-level parser's subcommands."""
    p = sub.add_parser("slurm", help="run as a Slurm heterogeneous job (supervisor, rollout, trainer)",
                       description="Render (or submit) an sbatch script with one heterogeneous-job component per "
                                   "pool. Knobs live under `slurm:` in the config file or as slurm.KEY=VALUE "
                                   "overrides; `earl-stream slurm fields` lists them.")
    ssub = p.add_subparsers(dest="slurm_command", required=True)
    for name, text in (("render", "write RUN_DIR/config.yaml and the sbatch script, print the script's path"),
                       ("submit", "render, then sbatch it (with a new cluster secret in RUN_DIR) and print the job id")):
        s = ssub.add_parser(name, help=text)
        s.add_argument("--config", metavar="PATH", help="YAML config file, with an optional `slurm:` section")
        s.add_argument("--out", metavar="DIR", help="where to write the script and config (default RUN_DIR)")
        s.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="run overrides and slurm.KEY=VALUE")
    ssub.add_parser("fields", help="list the slurm knobs with their help")


def run(args: argparse.Namespace) -> int:
    if args.slurm_command == "fields":
        for f in dataclasses.fields(SlurmConfig):
            print(f"{SECTION}.{f.name} (default {f.default!r}): {f.metadata['help']}")
        return 0
    cfg, slurm = load(args.config, args.overrides)
    script = write(cfg, slurm, Path(args.out) if args.out else None)
    if args.slurm_command == "render":
        print(script)
        return 0
    print(f"submitted job {submit(script, cfg)} ({script}); summary at "
          f"{Path(cfg.run_dir).resolve()}/summary-JOBID.json when it ends")
    return 0
