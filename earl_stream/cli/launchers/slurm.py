"""The `slurm` launcher: `up --launcher slurm` inside a Slurm allocation places every process as an srun step.

Run it where an allocation is held: `salloc -N 3 earl-stream up --launcher slurm ...`, or as the body of
an sbatch script (`earl-stream slurm render|submit` writes a heterogeneous job instead, for a login node).
The allocation's nodes (`scontrol show hostnames $SLURM_JOB_NODELIST`) are split in two: the last
`launcher.slurm.trainer_nodes` run the trainer pool, the others the supervisor (first node) and the
rollout workers (round-robin); an allocation of fewer nodes shares them. Each process is one
`srun --nodes=1 --ntasks=1 --nodelist=NODE --overlap` step running the same entry point as everywhere
(`earl-stream supervisor`, `earl-stream worker`); the trainer pool is one step of one task per trainer
node: `worker --role trainer --nproc N` on one node, `torchrun` (rendezvous on the first trainer node,
`--max-restarts` = up's --restart) across several. Processes reach each other by the nodes' addresses
(NodeAddr), so the run directory (config, secret, ready file, logs, checkpoints) and the model must be
on a filesystem every node sees, at the same path, as is usual on a Slurm cluster.

Stopping, as under the local launcher: the trainer first, given trainer.stop_grace_s to finish its step and
write its checkpoint, then the rollout workers (a clean stop writes the samples they hold, with
store.durable_experience), then the supervisor. srun is no plain parent: a SIGTERM to it SIGKILLs the
step's tasks at once ("forcing job termination", Slurm 22.05 src/srun/libsrun/srun_job.c), and a single
SIGINT only prints the tasks' state. So every step runs with `--disable-status`, under which srun passes a
SIGINT on to the tasks, and `stop` sends each step that SIGINT and waits; Slurm signals every process of
the step (the pool process or torchrun, and the ranks), and a rank takes the copies that reach it together
as one stop (`workers.common.StopFlag`). torchrun gives its ranks as long before it kills them
(TORCH_ELASTIC_SHUTDOWN_TIMEOUT; an older torch that does not read it gives them 30 s). A step still running
after its grace (the trainer's, else STOP_GRACE_S) gets a SIGTERM to its srun (its tasks are killed).

Outside an allocation (no $SLURM_JOB_ID), with srun or scontrol missing, or with a trainer pool that does
not split over its nodes, it fails at once saying what to do; every wait is bounded.
"""

from __future__ import annotations

import logging
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from earl_stream.cli.launchers import Placed, RunSpec
from earl_stream.cli.launchers.local import READY_TIMEOUT_S, wait_ready
from earl_stream.cli.procs import STOP_GRACE_S, Child, ProcessGroup
from earl_stream.errors import ConfigError, SlurmError
from earl_stream.security.secret import SECRET_ENV

log = logging.getLogger(__name__)
OUTSIDE = ("`up --launcher slurm` places the run inside a Slurm allocation, and $SLURM_JOB_ID is not set: run it "
           "under one (`salloc -N 3 earl-stream up --launcher slurm ...`, or in an sbatch script), or submit the "
           "run from a login node with `earl-stream slurm submit --config ...`")


def allocation_nodes(env: dict[str, str] | None = None) -> list[str]:
    """The nodes of the allocation this process runs in, in Slurm's order (SlurmError outside one)."""
    env = dict(os.environ if env is None else env)
    if not env.get("SLURM_JOB_ID"):
        raise SlurmError(OUTSIDE)
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise SlurmError(f"job {env['SLURM_JOB_ID']}: $SLURM_JOB_NODELIST is not set, so its nodes are unknown")
    return _scontrol(["show", "hostnames", nodelist]).split()


def node_address(node: str) -> str:
    """The address other nodes reach `node` at (its NodeAddr; its name where Slurm gives none)."""
    for field in _scontrol(["show", "node", node]).split():
        if field.startswith("NodeAddr="):
            return field.partition("=")[2] or node
    return node


def _scontrol(args: list[str]) -> str:
    if shutil.which("scontrol") is None:
        raise SlurmError("`scontrol` is not on PATH: the slurm launcher needs Slurm's client commands on this node")
    proc = subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise SlurmError(f"`scontrol {' '.join(args)}` failed: {(proc.stderr or proc.stdout).strip()}")
    return proc.stdout


def split_nodes(nodes: list[str], trainer_nodes: int) -> tuple[list[str], list[str]]:
    """(nodes of the supervisor and rollout workers, nodes of the trainer pool): the trainer takes the
    last `trainer_nodes`; with no node left over, the others share the allocation's nodes."""
    if trainer_nodes > len(nodes):
        raise SlurmError(f"launcher.slurm.trainer_nodes={trainer_nodes} but the allocation has {len(nodes)} node(s) "
                         f"({', '.join(nodes)}): allocate more (salloc -N) or lower it")
    trainer = nodes[len(nodes) - trainer_nodes:]
    return (nodes[:len(nodes) - trainer_nodes] or nodes), trainer


class SlurmLauncher:
    def __init__(self, run: RunSpec) -> None:
        self.run = run
        self.cfg = run.cfg.launcher.slurm
        nproc = run.cfg.trainer.nproc
        if nproc % self.cfg.trainer_nodes:
            raise ConfigError(f"trainer.nproc={nproc} does not split over launcher.slurm.trainer_nodes="
                              f"{self.cfg.trainer_nodes}: each trainer node runs the same number of ranks")
        if not os.environ.get("SLURM_JOB_ID"):
            raise SlurmError(OUTSIDE)
        if shutil.which(self.cfg.srun.split()[0] if self.cfg.srun.split() else "srun") is None:
            raise SlurmError(f"`{self.cfg.srun}` is not on PATH (launcher.slurm.srun): the slurm launcher starts "
                             "every process as an srun step")
        self.nodes = allocation_nodes()
        self.front, self.trainer_nodes = split_nodes(self.nodes, self.cfg.trainer_nodes)
        self.logs = Path(run.cfg.run_dir).resolve() / "logs"
        self.ready = Path(run.cfg.run_dir).resolve() / "supervisor.json"
        self.group = ProcessGroup()
        self.supervisor: Child | None = None
        self.trainer: Child | None = None
        self.placement: dict[str, str] = {}  # process name -> node, for the log and for revive

    def _step(self, node: str | list[str], tasks_per_node: int = 1, *srun_args: str) -> list[str]:
        nodes = [node] if isinstance(node, str) else node
        return [*shlex.split(self.cfg.srun), f"--nodes={len(nodes)}", f"--ntasks={len(nodes) * tasks_per_node}",
                f"--ntasks-per-node={tasks_per_node}", f"--nodelist={','.join(nodes)}", "--overlap",
                "--kill-on-bad-exit=1", "--job-name=earl-stream", "--disable-status", *srun_args,
                *shlex.split(self.cfg.step_args)]  # --disable-status: srun passes a SIGINT on (see `stop`)

    def _start(self, name: str, node: str | list[str], args: list[str], log: str, prefix: list[str],
               env: dict[str, str] | None = None) -> Child:
        self.placement[name] = node if isinstance(node, str) else ",".join(node)
        print(f"slurm: {name} on {self.placement[name]}", flush=True)
        # the cluster secret for the supervisor only; workers get the worker key (security/keys.py)
        key = self.run.secret_file if name == "supervisor" else self.run.worker_key_file()
        return self.group.start(name, args, env={SECRET_ENV: str(key), **self.run.encrypt_env(), **(env or {})},
                                log_path=str(self.logs / log), prefix=prefix)

    def start_supervisor(self) -> tuple[Placed, str]:
        self.ready.unlink(missing_ok=True)
        port = self.run.bind.rpartition(":")[2] or "0"
        node = self.front[0]
        sup = self._start("supervisor", node, ["supervisor", "--config", str(self.run.config_file), "--bind",
                                               f"0.0.0.0:{port}", "--ready-file", str(self.ready),
                                               *(["--forget-workers"] if self.run.resume else [])],
                          "supervisor.log", self._step(node))
        self.supervisor = sup
        ready = wait_ready(sup, self.ready, max(self.cfg.ready_timeout_s, READY_TIMEOUT_S))
        return sup, f"tcp://{node_address(node)}:{ready['address'].rpartition(':')[2]}"

    def start_rollout_worker(self, index: int, address: str) -> Placed:
        node = self.front[index % len(self.front)]
        return self._start(f"rollout worker {index}", node, ["worker", "--role", "rollout", "--supervisor", address,
                                                              "--advertise", node_address(node)],
                           f"rollout-{index}.log", self._step(node))

    def start_trainer_pool(self, address: str) -> Placed:
        nodes, nproc = self.trainer_nodes, self.run.cfg.trainer.nproc
        grace = self.run.cfg.trainer.stop_grace_s
        if len(nodes) == 1:
            self.trainer = self._start("trainer", nodes[0], [
                "worker", "--role", "trainer", "--supervisor", address, "--nproc", str(nproc), "--restart",
                str(self.run.restart), "--advertise", node_address(nodes[0]), "--stop-grace", str(grace)],
                "trainer.log", self._step(nodes[0]))
            return self.trainer
        # one torchrun per node (the step's one task there): its node rank = the task's rank in the step,
        # the rendezvous on the first node; stopped, it gives its ranks the grace (30 s by default)
        torchrun = [_torchrun(), f"--nnodes={len(nodes)}",
                    f"--nproc-per-node={nproc // len(nodes)}", "--node-rank=$SLURM_PROCID",
                    f"--master-addr={node_address(nodes[0])}", f"--master-port={self.cfg.master_port}",
                    f"--max-restarts={self.run.restart}", "--no-python"]
        # Stopped, torchrun exits 1 (SignalException) even when its ranks finished cleanly: that exit code
        # would make srun (--kill-on-bad-exit) kill the other nodes' ranks while they finish too.
        shell = ["bash", "-c", stopped_is_success(" ".join(torchrun) + ' "$@" --advertise "$(hostname)"'), "torchrun"]
        self.trainer = self._start("trainer", nodes, ["worker", "--role", "trainer", "--supervisor", address],
                                   "trainer.log", self._step(nodes) + shell,
                                   env={"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(math.ceil(grace))})
        return self.trainer

    def revive(self, placed: Placed, address: str) -> None:
        """A dead step runs again on its node; the supervisor on its address, from the run's state."""
        assert isinstance(placed, Child) and placed in self.group.children
        if placed is not self.supervisor:
            self.group.restart(placed)
            return
        args = list(placed.args)
        args[args.index("--bind") + 1] = "0.0.0.0:" + address.rpartition(":")[2]
        args = [a for a in args if a != "--forget-workers"]
        self.ready.unlink(missing_ok=True)
        self.group.restart(placed, args)
        wait_ready(placed, self.ready, max(self.cfg.ready_timeout_s, READY_TIMEOUT_S))

    def stop(self) -> None:
        """Each step in turn gets a SIGINT, which its srun passes on to its tasks (--disable-status), and time
        to stop cleanly: the trainer trainer.stop_grace_s (and the pool's own STOP_GRACE_S) for its step and
        checkpoint, then the rollout workers and then the supervisor STOP_GRACE_S. A step still running then
        gets a SIGTERM (srun SIGKILLs its tasks) before the next is interrupted, and its srun a SIGKILL after
        STOP_GRACE_S."""
        if self.trainer is not None:
            self._interrupt([self.trainer], self.run.cfg.trainer.stop_grace_s + STOP_GRACE_S)
        self._interrupt([c for c in self.group.children if c not in (self.trainer, self.supervisor)], STOP_GRACE_S)
        if self.supervisor is not None:
            self._interrupt([self.supervisor], STOP_GRACE_S)
        self.group.stop()

    def _interrupt(self, steps: list[Child], grace_s: float) -> None:
        """SIGINT to each live step's srun, up to `grace_s` for all of them, then a SIGTERM to those left."""
        live = [c for c in steps if c.proc.poll() is None]
        for c in live:
            c.proc.send_signal(signal.SIGINT)
        deadline = time.monotonic() + grace_s
        late = []
        for c in live:
            try:
                c.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s's step (srun pid %d) did not stop within %.0fs of its SIGINT: terminating it",
                            c.name, c.proc.pid, grace_s)
                late.append(c)
        if late:
            self.group.stop(only=late)


def stopped_is_success(command: str) -> str:
    """A bash line running `command` (torchrun) that exits 0 when it was stopped by a SIGINT: stopped,
    torchrun exits 1 (SignalException) even when its ranks finished their step and checkpoint."""
    return f'stopped=; trap stopped=1 INT; {command}; rc=$?; [ -z "$stopped" ] || rc=0; exit $rc'


def _torchrun() -> str:
    """This environment's torchrun (beside its python, as in a virtualenv), else the one on PATH."""
    beside = Path(sys.executable).parent / "torchrun"
    return str(beside) if beside.exists() else shutil.which("torchrun") or "torchrun"
