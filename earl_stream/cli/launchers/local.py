"""The `local` launcher: every process of the run is a child process of `up` on this machine, started
with the same commands a user runs by hand on other hosts (`earl-stream supervisor`, `earl-stream
worker`). The trainer pool is one `worker --role trainer --nproc N --restart R` child, which starts its
ranks torchrun-style and restarts them from the latest checkpoint itself (cli/worker.py).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from earl_stream.cli.launchers import Placed, RunSpec
from earl_stream.cli.launchers.gpus import placement_for
from earl_stream.cli.procs import STOP_GRACE_S, Child, ProcessGroup, log_tail
from earl_stream.errors import ChildProcessFailed

READY_TIMEOUT_S = 60.0


class LocalLauncher:
    def __init__(self, run: RunSpec) -> None:
        self.run = run
        self.logs = Path(run.cfg.run_dir) / "logs"
        self.ready = Path(run.cfg.run_dir) / "supervisor.json"
        self.group = ProcessGroup()
        self.supervisor: Child | None = None
        self.gpus = placement_for(run.cfg)  # CUDA devices per process (launcher.gpus)

    def start_supervisor(self) -> tuple[Placed, str]:
        # On --resume every process of the earlier `up` is gone: the supervisor need not wait out their leases.
        self.ready.unlink(missing_ok=True)
        sup = self.group.start("supervisor", ["supervisor", "--config", str(self.run.config_file), "--bind",
                                              self.run.bind, "--ready-file", str(self.ready),
                                              *(["--forget-workers"] if self.run.resume else [])],
                               env=self._env(), log_path=str(self.logs / "supervisor.log"))
        self.supervisor = sup
        return sup, wait_ready(sup, self.ready, READY_TIMEOUT_S)["address"]

    def start_rollout_worker(self, index: int, address: str) -> Placed:
        return self.group.start(f"rollout worker {index}", ["worker", "--role", "rollout", "--supervisor", address],
                                env={**self._env(worker=True), **self.gpus.rollout_env(index)},
                                log_path=str(self.logs / f"rollout-{index}.log"))

    def start_trainer_pool(self, address: str) -> Placed:
        # on stop its ranks get trainer.stop_grace_s to finish their step and checkpoint; the pool's own
        # process (`worker --nproc`) a little more, to see them out
        grace = self.run.cfg.trainer.stop_grace_s
        return self.group.start("trainer", ["worker", "--role", "trainer", "--supervisor", address, "--nproc",
                                            str(self.run.cfg.trainer.nproc), "--restart", str(self.run.restart),
                                            "--stop-grace", str(grace)],
                                env={**self._env(worker=True), **self.gpus.trainer_env()},
                                log_path=str(self.logs / "trainer.log"),
                                stop_grace_s=grace + STOP_GRACE_S)

    def revive(self, placed: Placed, address: str) -> None:
        """The supervisor comes back on its address from the run's state (`supervisor.state` in run_dir),
        so the live workers reconnect to it; a rollout worker re-registers, and the supervisor has
        re-issued the prompts its predecessor held."""
        assert isinstance(placed, Child) and placed in self.group.children
        if placed is not self.supervisor:
            self.group.restart(placed)
            return
        args = list(placed.args)
        args[args.index("--bind") + 1] = address.removeprefix("tcp://")
        args = [a for a in args if a != "--forget-workers"]  # the workers of this run are alive
        self.ready.unlink(missing_ok=True)
        self.group.restart(placed, args)
        wait_ready(placed, self.ready, READY_TIMEOUT_S)

    def stop(self) -> None:
        self.group.stop()

    def _env(self, worker: bool = False) -> dict[str, str]:
        """A process's environment: the cluster secret for the supervisor, the worker key for workers."""
        from earl_stream.security.secret import SECRET_ENV

        key = self.run.worker_key_file() if worker else self.run.secret_file
        return {SECRET_ENV: str(key), **self.run.encrypt_env()}


def wait_ready(child: Child, ready: Path, timeout_s: float) -> dict[str, Any]:
    """The supervisor's ready file ({address, metrics_address}) once written; fails if it exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ready.exists():
            return json.loads(ready.read_text())
        if child.proc.poll() is not None:
            raise ChildProcessFailed(child.describe_exit())
        time.sleep(0.05)
    raise ChildProcessFailed(f"the supervisor did not come up within {timeout_s:.0f}s (no {ready})"
                             + log_tail(child.log_path))
