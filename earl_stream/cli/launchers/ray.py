"""The `ray` launcher: `up --launcher ray [--ray-address ADDR]` places the run on a Ray cluster.

Each process runs in its own actor (`ray_host.ProcessHost`) on a Ray node, reserving the resources its
role declares (launcher.ray.{supervisor,rollout,trainer}: num_cpus, num_gpus, custom resources). GPUs follow
`launcher.gpus` as for the local launcher (cli/launchers/gpus.py: split = a GPU of its own for each trainer
rank and rollout worker while the cluster has enough, shared = none reserved), as amounts of Ray's GPU
resource: Ray picks the devices and sets each actor's CUDA_VISIBLE_DEVICES, which its process inherits. A
role whose launcher.ray.<role>.num_gpus is set (> 0) turns that off: then every role reserves what it sets. The
trainer pool's ranks are the bundles of one placement group (PACK: filled node by node); MASTER_ADDR is
the node of the first bundle, and the ranks form their torch.distributed group across the nodes. Ray
restarts a rollout worker that dies (launcher.ray.rollout_max_restarts); the new one re-registers.
`stop` stops the trainer pool first and gives its ranks trainer.stop_grace_s to finish their step and write
its checkpoint (the actor's SIGTERM, then SIGKILL), as the local launcher does; then the rollout workers
and the supervisor, with the short grace (cli/procs.py: STOP_GRACE_S).

Bad input fails fast with one error naming what is missing: ray not installed, a Ray address nothing
listens on, a role's resources that no node has; a placement that does not happen in
launcher.ray.placement_timeout_s (resources held by others) fails naming the role and its demand.
Multi-host: the model directory (model.path) must be readable at the same path on every node; the
run's config and secret travel with the actors. Logs go to RUN_DIR/logs on each process's node.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

from earl_stream.cli.launchers import Placed, RunSpec
from earl_stream.cli.launchers.gpus import ray_shares_for
from earl_stream.cli.launchers.ray_host import ProcessHost
from earl_stream.cli.procs import STOP_GRACE_S
from earl_stream.config import RayRoleConfig
from earl_stream.errors import ChildProcessFailed, ConfigError
from earl_stream.files import write_durably

log = logging.getLogger(__name__)
CALL_TIMEOUT_S = 30.0  # an actor call (poll, start, read) that takes longer means its node is gone
RESTART_GRACE_S = 60.0  # a restartable actor whose calls fail this long is gone for good


class RayProcess:
    """One process in one actor (the supervisor, a rollout worker, a trainer rank)."""

    def __init__(self, name: str, actor: Any, restartable: bool = False) -> None:
        self.name = name
        self.actor = actor
        self.restartable = restartable  # Ray restarts the actor when its process dies
        self.node: dict[str, str] = {}
        self.failing_since = 0.0  # monotonic time of the first failed call since the last answer

    def poll(self) -> int | None:
        """The process's exit code, None while it runs. A restartable actor whose calls fail is being
        restarted by Ray (a call in flight when it left fails; later ones fail too until Ray has noticed
        and started the new one, which on a loaded node takes seconds): it counts as failed only when
        its calls keep failing for RESTART_GRACE_S, i.e. Ray's restarts of it are spent or its node is
        gone."""
        import ray

        try:
            code = ray.get(self.actor.poll.remote(), timeout=CALL_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:  # Ray is restarting it: not failed (yet)
            return None
        except ray.exceptions.RayActorError:
            if not self.restartable:
                return 1
            now = time.monotonic()
            self.failing_since = self.failing_since or now
            if now - self.failing_since < RESTART_GRACE_S:
                time.sleep(0.5)
                return None
            return 1
        self.failing_since = 0.0
        return code

    def describe_exit(self) -> str:
        import ray

        try:
            return ray.get(self.actor.describe_exit.remote(), timeout=CALL_TIMEOUT_S)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
            return f"{self.name}'s Ray actor is gone ({type(exc).__name__}), Ray's restarts of it spent or its node lost"


class RayTrainerPool:
    """The trainer ranks, one actor each, in one placement group; restarted whole from the checkpoint."""

    def __init__(self, launcher: RayLauncher, address: str) -> None:
        self.name = "trainer pool"
        self.launcher = launcher
        self.address = address
        self.restarts_left = launcher.run.restart
        self.ranks: list[RayProcess] = []
        self.group: Any = None
        self.start()

    def start(self) -> None:
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        cfg, rc = self.launcher.run.cfg, self.launcher.rc
        bundle = self.launcher.demand("trainer")
        self.launcher.check_fits("trainer", bundle, count=cfg.trainer.nproc)
        self.group = placement_group([bundle] * cfg.trainer.nproc, strategy="PACK")
        if not self.group.wait(timeout_seconds=rc.placement_timeout_s):
            remove_placement_group(self.group)
            raise ConfigError(f"Ray could not place the trainer pool's placement group ({cfg.trainer.nproc} x {bundle}, "
                              f"PACK) within {rc.placement_timeout_s:.0f}s; available now: {_available()}")
        self.ranks = [self.launcher.place(f"trainer rank {r}", "trainer", strategy=PlacementGroupSchedulingStrategy(
            self.group, placement_group_bundle_index=r)) for r in range(cfg.trainer.nproc)]
        master = self.ranks[0]
        port = self.launcher.call(master.actor.free_port.remote(), "a port for the trainer pool")
        nodes = [p.node["node_id"] for p in self.ranks]  # LOCAL_RANK: a rank's index among the pool's on its node
        for r, p in enumerate(self.ranks):
            env = {"RANK": str(r), "LOCAL_RANK": str(nodes[:r].count(nodes[r])), "WORLD_SIZE": str(len(nodes)),
                   "LOCAL_WORLD_SIZE": str(nodes.count(nodes[r])), "MASTER_ADDR": master.node["ip"],
                   "MASTER_PORT": str(port)}
            self.launcher.call(p.actor.start.remote(p.name, ["worker", "--role", "trainer", "--supervisor", self.address,
                                                             "--advertise", "{ip}"], env,
                                                    self.launcher.log_path(f"trainer-{r}.log")), f"starting {p.name}")
        log.info("trainer pool placed: %s", ", ".join(f"rank {r} on {p.node['ip']} (node {p.node['node_id'][:12]})"
                                                      for r, p in enumerate(self.ranks)))

    def poll(self) -> int | None:
        codes = [p.poll() for p in self.ranks]
        failed = [c for c in codes if c not in (None, 0)]
        if not failed:
            return 0 if all(c == 0 for c in codes) else None
        if self.restarts_left <= 0:
            return failed[0]
        self.restarts_left -= 1
        log.warning("%s: restarting the trainer pool (%d restarts left); it resumes from its latest checkpoint",
                    self.describe_exit().splitlines()[0], self.restarts_left)
        self.stop()
        self.start()
        return None

    def describe_exit(self) -> str:
        failed = [p for p in self.ranks if p.poll() not in (None, 0)]
        return (failed or self.ranks)[0].describe_exit()

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """Stop every rank (SIGKILL after `grace_s`: the short grace when a rank failed and the others are
        stuck in a collective with it; trainer.stop_grace_s when the run stops) and free the placement group."""
        from ray.util.placement_group import remove_placement_group

        self.launcher.stop_all(self.ranks, grace_s)
        if self.group is not None:
            remove_placement_group(self.group)
            self.group = None


class RayLauncher:
    def __init__(self, run: RunSpec) -> None:
        self.run = run
        self.rc = run.cfg.launcher.ray
        self.owns_ray = connect(self.rc.address, self.rc.connect_timeout_s)
        try:
            self.num_gpus = self._gpus_per_process()
        except ConfigError:
            self._disconnect()
            raise
        self.secret = run.secret_file.read_bytes()  # the supervisor's; workers get the worker key (security/keys.py)
        self.worker_key = run.worker_key_file().read_bytes()
        self.processes: list[RayProcess] = []
        self.pools: list[RayTrainerPool] = []

    def _gpus_per_process(self) -> dict[str, float]:
        """Ray GPUs each process of a role reserves: launcher.gpus's split of the cluster's GPUs, unless a role
        sets launcher.ray.<role>.num_gpus (then each role's own setting)."""
        import ray

        own = {role: getattr(self.rc, role).num_gpus for role in ("supervisor", "rollout", "trainer")}
        if any(own.values()):
            log.info("Ray GPUs as launcher.ray.<role>.num_gpus set them: %s", own)
            return own
        gpus = int(ray.cluster_resources().get("GPU", 0.0))
        shares = ray_shares_for(self.run.cfg, gpus)
        if gpus:
            log.info("Ray GPUs (launcher.gpus=%s, %d in the cluster): each trainer rank reserves %g, each rollout "
                     "worker %g", self.run.cfg.launcher.gpus, gpus, shares.trainer, shares.rollout)
        return {"supervisor": 0.0, "rollout": shares.rollout, "trainer": shares.trainer}

    def demand(self, role: str) -> dict[str, float]:
        """What one process of `role` reserves on its node (a placement group bundle for a trainer rank)."""
        return _bundle(getattr(self.rc, role), self.num_gpus[role])

    # ---- the Launcher protocol

    def start_supervisor(self) -> tuple[Placed, str]:
        sup = self.place("supervisor", "supervisor", files={"config.yaml": self.run.config_file.read_text()})
        host, _, port = self.run.bind.rpartition(":")
        host = sup.node["ip"] if host in ("", "127.0.0.1", "localhost") else host
        args = ["supervisor", "--config", "{dir}/config.yaml", "--bind", f"{host}:{port}", "--ready-file",
                "{dir}/ready.json", *(["--forget-workers"] if self.run.resume else [])]
        self.call(sup.actor.start.remote("supervisor", args, {}, self.log_path("supervisor.log")), "starting the supervisor")
        return sup, self._wait_ready(sup)

    def start_rollout_worker(self, index: int, address: str) -> Placed:
        name = f"rollout worker {index}"
        start = {"name": name, "args": ["worker", "--role", "rollout", "--supervisor", address, "--advertise", "{ip}"],
                 "env": {}, "log_path": self.log_path(f"rollout-{index}.log")}
        return self.place(name, "rollout", start=start, max_restarts=self.rc.rollout_max_restarts)

    def start_trainer_pool(self, address: str) -> Placed:
        pool = RayTrainerPool(self, address)
        self.pools.append(pool)
        return pool

    def revive(self, placed: Placed, address: str) -> None:
        if isinstance(placed, RayTrainerPool):
            placed.stop()
            placed.start()
            return
        assert isinstance(placed, RayProcess)
        args = self.call(placed.actor.args.remote(), f"the arguments of {placed.name}")
        if "--bind" in args:  # the supervisor: the same address, its state from run_dir, its workers alive
            args[args.index("--bind") + 1] = address.removeprefix("tcp://")
            args = [a for a in args if a != "--forget-workers"]
            (Path(self.run.cfg.run_dir) / "supervisor.json").unlink(missing_ok=True)
        self.call(placed.actor.restart.remote(args), f"restarting {placed.name}")
        if "--bind" in args:
            self._wait_ready(placed)

    def stop(self) -> None:
        for pool in self.pools:  # first: its ranks finish their step and checkpoint it
            pool.stop(self.run.cfg.trainer.stop_grace_s)
        self.stop_all(self.processes[1:][::-1])
        self.stop_all(self.processes[:1])
        self._disconnect()

    def _disconnect(self) -> None:
        import ray

        if self.owns_ray:
            ray.shutdown()

    # ---- placing

    def place(self, name: str, role: str, *, files: dict[str, str] | None = None, start: dict[str, Any] | None = None,
              max_restarts: int = 0, strategy: Any = None) -> RayProcess:
        """An actor for one process of `role` on a node with the role's resources; waits until it is placed."""
        import ray

        spec: RayRoleConfig = getattr(self.rc, role)
        if strategy is None:
            self.check_fits(role, self.demand(role))
        options: dict[str, Any] = {"num_cpus": spec.num_cpus, "num_gpus": self.num_gpus[role],
                                   "max_restarts": max_restarts}
        if spec.resources:
            options["resources"] = {k: float(v) for k, v in spec.resources.items()}
        if strategy is not None:
            options["scheduling_strategy"] = strategy
        key = self.secret if role == "supervisor" else self.worker_key
        actor = ray.remote(ProcessHost).options(**options).remote(
            key, files or {}, os.getcwd(), start, exit_with_child=max_restarts != 0, env=self.run.encrypt_env())
        proc = RayProcess(name, actor, restartable=max_restarts != 0)
        self.processes.append(proc)
        try:
            proc.node = ray.get(actor.node.remote(), timeout=self.rc.placement_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise ConfigError(f"Ray could not place {name} within {self.rc.placement_timeout_s:.0f}s: it needs "
                              f"{self.demand(role)} (launcher.ray.{role}.*); available now: {_available()}") from None
        log.info("%s placed on %s (Ray node %s)%s", name, proc.node["ip"], proc.node["node_id"][:12],
                 f", {self.num_gpus[role]:g} GPU" if self.num_gpus[role] else "")
        return proc

    def check_fits(self, role: str, demand: dict[str, float], count: int = 1) -> None:
        """ConfigError, at once, when no node could ever hold one process of `role` (or the cluster `count`)."""
        import ray

        nodes = [n for n in ray.nodes() if n.get("Alive")]
        if not any(all(n["Resources"].get(k, 0.0) >= v for k, v in demand.items()) for n in nodes):
            have = "; ".join(f"{n['NodeManagerAddress']} ({n['NodeID'][:12]}): {_fmt(n['Resources'])}" for n in nodes)
            missing = sorted({k for k, v in demand.items() if all(n["Resources"].get(k, 0.0) < v for n in nodes)})
            raise ConfigError(f"no Ray node has the resources of one {role} process {demand} (launcher.ray.{role}.*)"
                              + (f"; no node has enough {', '.join(missing)}" if missing else "")
                              + f"; the cluster's nodes: {have or 'none alive'}")
        total = ray.cluster_resources()
        short = {k: v * count for k, v in demand.items() if total.get(k, 0.0) < v * count}
        if short:
            raise ConfigError(f"the Ray cluster cannot hold {count} {role} processes: they need {short} in all, it has "
                              f"{_fmt({k: total.get(k, 0.0) for k in short})} (launcher.ray.{role}.*, trainer.nproc)")

    def call(self, ref: Any, what: str) -> Any:
        import ray

        try:
            return ray.get(ref, timeout=CALL_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise ChildProcessFailed(f"Ray did not answer within {CALL_TIMEOUT_S:.0f}s: {what}") from None
        except ray.exceptions.RayActorError as exc:
            raise ChildProcessFailed(f"{what}: its Ray actor is gone ({exc})") from None

    def stop_all(self, procs: list[RayProcess], grace_s: float = STOP_GRACE_S) -> None:
        """Stop the processes of `procs` together, each given `grace_s` after its SIGTERM, then kill their
        actors (also those that did not answer in time: the grace and STOP_GRACE_S more, or CALL_TIMEOUT_S)."""
        import ray

        refs = [p.actor.stop.remote(grace_s) for p in procs]
        timeout = max(CALL_TIMEOUT_S, grace_s + STOP_GRACE_S)
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout) if refs else ([], [])
        for p in procs:
            ray.kill(p.actor, no_restart=True)
            p.restartable = False  # killed for good: a failed call now means it is gone, without a grace
        for p in procs:
            if p in self.processes:
                self.processes.remove(p)
        if len(ready) < len(refs):
            log.warning("%d of %d Ray actors did not stop within %.0fs: killed", len(refs) - len(ready), len(refs),
                        timeout)

    def log_path(self, name: str) -> str:
        return str((Path(self.run.cfg.run_dir) / "logs" / name).resolve())

    def _wait_ready(self, sup: RayProcess) -> str:
        deadline = time.monotonic() + 60.0
        while time.monotonic() < deadline:
            text = self.call(sup.actor.read.remote("ready.json"), "the supervisor's ready file")
            if text:
                # here too, so that `earl-stream status` in this directory finds the run and its secret
                write_durably(Path(self.run.cfg.run_dir) / "supervisor.json", text.encode())
                return str(json.loads(text)["address"])
            if sup.poll() is not None:
                raise ChildProcessFailed(sup.describe_exit())
            time.sleep(0.1)
        raise ChildProcessFailed(f"the supervisor did not come up within 60s on {sup.node.get('ip')}; "
                                 f"its log: {self.log_path('supervisor.log')}")


def connect(address: str, timeout_s: float) -> bool:
    """Join the Ray cluster (True if this call started Ray, and so must shut it down)."""
    try:
        import ray
    except ImportError:
        raise ConfigError("the ray launcher needs ray: pip install 'earl_stream[ray]'") from None
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if ray.is_initialized() and not address:
        return False
    address = address or os.environ.get("RAY_ADDRESS", "")
    if address and address != "auto":
        _check_reachable(address, timeout_s)
    try:
        ray.init(address=address or None, log_to_driver=False, configure_logging=False)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise ConfigError(f"cannot join the Ray cluster at {address or 'a new local instance'}: {exc}") from exc
    return True


def _check_reachable(address: str, timeout_s: float) -> None:
    """A TCP connect to the cluster's address first: ray.init retries an unreachable one for minutes."""
    hostport = address.removeprefix("ray://").removeprefix("tcp://")
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"Ray address {address!r} must look like HOST:PORT, ray://HOST:PORT or auto "
                          "(--ray-address, launcher.ray.address)")
    try:
        socket.create_connection((host, int(port)), timeout=min(timeout_s, 10.0)).close()
    except OSError as exc:
        raise ConfigError(f"cannot reach the Ray cluster at {address}: {exc} (is `ray start --head` running "
                          "there? --ray-address, launcher.ray.address)") from None


def _bundle(spec: RayRoleConfig, num_gpus: float) -> dict[str, float]:
    demand = {"CPU": spec.num_cpus, "GPU": num_gpus, **{k: float(v) for k, v in spec.resources.items()}}
    return {k: v for k, v in demand.items() if v > 0} or {"CPU": 0.01}


def _available() -> str:
    import ray

    return _fmt(ray.available_resources())


def _fmt(resources: dict[str, float]) -> str:
    shown = {k: round(v, 2) for k, v in resources.items() if not k.startswith(("node:", "memory", "object_store"))}
    return json.dumps(shown, sort_keys=True)
