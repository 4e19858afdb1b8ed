"""`earl-stream up`: the embedded run. It starts a supervisor, the rollout workers and the trainer
pool as separate processes on this machine, using the same commands a user runs by hand on other
hosts (`earl-stream supervisor`, `earl-stream worker`), shows a live view, and writes a summary.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

from earl_stream import protocol as P
from earl_stream.config import RunConfig, config_to_yaml, replace
from earl_stream.errors import ChildProcessFailed, EarlError
from earl_stream.live import LiveView
from earl_stream.procs import Child, ProcessGroup, describe_exit
from earl_stream.security import SECRET_ENV, create_secret_file, load_secret

log = logging.getLogger(__name__)
SUMMARY_KEYS = ("steps", "policy_version", "samples_trained", "samples_produced", "mean_reward_last",
                "win_rate_last", "draw_rate_last", "tokens_per_second", "wall_seconds")


def prepare(cfg: RunConfig) -> tuple[RunConfig, Path]:
    """Resolve the model (building the embedded one once) and write the run's config file."""
    run_dir = Path(cfg.run_dir)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    if not cfg.model.path:
        from earl_stream.modeling import ensure_default_model

        log.info("preparing the embedded tiny model (built once, then cached)")
        model_dir = ensure_default_model(warm_start_steps=cfg.model.warm_start_steps,
                                         warm_start_seconds=cfg.model.warm_start_seconds)
        cfg = replace(cfg, f"model.path={model_dir}")
    path = run_dir / "config.yaml"
    path.write_text(config_to_yaml(cfg))
    return cfg, path


def _wait_ready(child: Child, ready: Path, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ready.exists():
            return json.loads(ready.read_text())
        if child.proc.poll() is not None:
            raise ChildProcessFailed(describe_exit(child) + _tail(child.log_path))
        time.sleep(0.05)
    raise ChildProcessFailed(f"the supervisor did not come up within {timeout_s:.0f}s" + _tail(child.log_path))


def _tail(path: str | None, lines: int = 12) -> str:
    if not path or not Path(path).exists():
        return ""
    text = Path(path).read_text(errors="replace").strip().splitlines()[-lines:]
    return "\n  last lines of its log:\n    " + "\n    ".join(text)


def up(cfg: RunConfig, *, bind: str = "127.0.0.1:0", summary_path: str | None = None, resume: bool = False,
       restart: int = 0) -> int:
    """Run until `steps` (or a signal). `restart`: times the trainer pool is restarted from its latest
    checkpoint when one of its ranks dies, and times a rollout worker or the supervisor that dies is
    started again (0 = the run stops with an error naming the process)."""
    cfg, config_file = prepare(cfg)
    run_dir = Path(cfg.run_dir)
    if not resume:  # a fresh run: forget the ledger of an earlier run in the same directory
        (run_dir / "supervisor.state").unlink(missing_ok=True)
        (run_dir / "trained.jsonl").unlink(missing_ok=True)
    secret = load_secret()
    if secret is None:
        os.environ[SECRET_ENV] = str(create_secret_file(run_dir / "secret").resolve())
        secret = load_secret()
    logs = run_dir / "logs"
    ready = run_dir / "supervisor.json"
    ready.unlink(missing_ok=True)
    group = ProcessGroup()
    stopping: list[str] = []
    signal.signal(signal.SIGINT, lambda s, f: stopping.append("interrupted"))
    signal.signal(signal.SIGTERM, lambda s, f: stopping.append("terminated"))
    started = time.time()
    status: dict[str, Any] = {}
    view = LiveView(cfg)
    try:
        # On --resume every process of the earlier `up` is gone: the supervisor need not wait out their leases.
        sup = group.start("supervisor", ["supervisor", "--config", str(config_file), "--bind", bind,
                                         "--ready-file", str(ready), *(["--forget-workers"] if resume else [])],
                          log_path=str(logs / "supervisor.log"))
        address = _wait_ready(sup, ready, 60)["address"]
        view.message(f"supervisor at {address} — add workers with: earl-stream worker --role rollout --supervisor {address}")
        for i in range(cfg.rollout.workers):
            group.start(f"rollout worker {i}", ["worker", "--role", "rollout", "--supervisor", address],
                        log_path=str(logs / f"rollout-{i}.log"))
        trainer = group.start("trainer", ["worker", "--role", "trainer", "--supervisor", address, "--nproc",
                                          str(cfg.trainer.nproc), "--restart", str(restart)],
                              log_path=str(logs / "trainer.log"))
        client = P.ControlClient(address, timeout_s=10, secret=secret)
        revivals = 0
        with view:
            while not stopping and trainer.proc.poll() is None:
                failed = group.failed()
                if failed is not None:
                    if failed is trainer or revivals >= restart:
                        raise ChildProcessFailed(describe_exit(failed) + _tail(failed.log_path))
                    revivals += 1
                    view.message(f"{describe_exit(failed)}; starting it again ({revivals} of {restart} restarts)")
                    _revive(group, failed, sup, address, ready)
                    continue
                status = _status(client) or status
                view.update(status)
                write_targets(run_dir / "prometheus_targets.json", status)
                time.sleep(0.5)
        if trainer.proc.returncode not in (None, 0):
            raise ChildProcessFailed(describe_exit(trainer) + _tail(trainer.log_path))
        status = _status(client) or status
    finally:
        group.stop()
    summary = make_summary(status, wall=time.time() - started)
    view.finish(summary, stopping[0] if stopping else "")
    out = Path(summary_path) if summary_path else run_dir / "summary.json"
    curve = view.write_learning_curve(out.parent / "learning_curve.png")
    summary["learning_curve_png"] = str(curve) if curve else None
    out.write_text(json.dumps(summary, indent=2))
    return 130 if stopping else 0


def _revive(group: ProcessGroup, child: Child, sup: Child, address: str, ready: Path) -> None:
    """Start a dead child of `up` again. The supervisor comes back on its address from the run's state
    (`supervisor.state` in run_dir), so the live workers reconnect to it; a rollout worker re-registers
    and the supervisor has re-issued the prompts its predecessor held."""
    if child is not sup:
        group.restart(child)
        return
    args = list(child.args)
    args[args.index("--bind") + 1] = address.removeprefix("tcp://")
    args = [a for a in args if a != "--forget-workers"]  # the workers of this run are alive
    ready.unlink(missing_ok=True)
    group.restart(child, args)
    _wait_ready(child, ready, 60)


def _status(client: P.ControlClient) -> dict[str, Any] | None:
    try:
        return json.loads(client.call(P.StatusRequest(), timeout_s=5).status_json)
    except EarlError:
        return None


def write_targets(path: Path, status: dict[str, Any]) -> None:
    """A Prometheus file_sd targets file with every live process's metrics endpoint."""
    if not status:
        return
    groups = [{"targets": [status["metrics_address"]], "labels": {"role": "supervisor", "instance_name": "supervisor"}}]
    for w in status.get("workers", []):
        if w["alive"] and w.get("metrics_address"):
            groups.append({"targets": [w["metrics_address"]], "labels": {"role": w["role"], "instance_name": w["id"]}})
    text = json.dumps(groups, indent=1)
    if not path.exists() or path.read_text() != text:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)


def make_summary(status: dict[str, Any], *, wall: float) -> dict[str, Any]:
    trainer = status.get("trainer", {})
    return {
        "steps": status.get("policy_version", 0),
        "policy_version": status.get("policy_version", 0),
        "samples_trained": status.get("samples_consumed", 0),
        "samples_produced": status.get("samples_produced", 0),
        "mean_reward_last": status.get("mean_reward_last"),
        "win_rate_last": status.get("win_rate_last"),
        "draw_rate_last": status.get("draw_rate_last"),
        "tokens_per_second": status.get("tokens_per_second", 0.0),
        "wall_seconds": wall,
        "samples_lost": status.get("samples_lost", 0),
        "samples_stale": status.get("samples_stale", 0),
        "prompts_reissued": status.get("prompts_reissued", 0),
        "duplicates_detected": status.get("duplicates_detected", 0),
        "last_loss": trainer.get("loss"),
    }
