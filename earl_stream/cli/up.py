"""`earl-stream up`: a whole run. A launcher (cli/launchers/: local child processes by default, or
Ray) places a supervisor, the rollout workers and the trainer pool, each running the same command a
user runs by hand on other hosts (`earl-stream supervisor`, `earl-stream worker`); `up` watches them,
restarts a dead one with --restart, shows a live view, feeds the experiment trackers (`logging.backends`,
tracking/feed.py) and writes a summary.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

from earl_stream import protocol as P
from earl_stream.cli.keys import write_key
from earl_stream.cli.launchers import Launcher, Placed, RunSpec, make_launcher
from earl_stream.cli.live import LiveView
from earl_stream.cli.local_run import record_up
from earl_stream.cli.run_files import plot_learning_curve, step_summary
from earl_stream.config import RunConfig, config_to_yaml, load_config, replace
from earl_stream.errors import ChildProcessFailed, EarlError
from earl_stream.security.encryption import export_encrypt
from earl_stream.security.keys import WORKER_KEY_FILE, KeyRole, role_token
from earl_stream.security.secret import RUN_SECRET, SECRET_ENV, create_secret_file, find_run_secret, load_secret
from earl_stream.security.tls import CA_FILE, READONLY_KEY_FILE, tls_env, write_run_ca
from earl_stream.store.durable import EXPERIENCE_DIR
from earl_stream.supervisor.metrics_log import FILE_NAME as METRICS_FILE
from earl_stream.supervisor.metrics_log import read_records
from earl_stream.supervisor.revocation import Revocations, write_worker_key
from earl_stream.tracking import check_installed
from earl_stream.tracking.feed import TrackerFeed

log = logging.getLogger(__name__)
SUMMARY_KEYS = ("steps", "policy_version", "samples_trained", "samples_produced", "mean_reward_last",
                "win_rate_last", "draw_rate_last", "tokens_per_second", "wall_seconds")


def prepare(cfg: RunConfig, *, resume: bool = False) -> tuple[RunConfig, Path]:
    """Resolve the model (building the embedded one once; pinning a Hub id to its commit and the sha256 of
    its files, which every worker checks its own copy against; a resumed run keeps the commit it was
    started with, even if the branch has moved since) and write the run's config file."""
    from earl_stream.model.default import embedded_game
    from earl_stream.model.hub import is_hub_id, pin_model
    from earl_stream.model.loading import check_model_dir

    run_dir = Path(cfg.run_dir)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    path = run_dir / "config.yaml"
    if resume and path.is_file():
        cfg = _keep_pinned_model(cfg, load_config(path))
    cfg = pin_model(cfg)
    game = embedded_game(cfg.model.path)
    if game is not None:
        from earl_stream.model import ensure_default_model

        log.info("preparing the embedded tiny model of %s (built once, then cached)", game)
        model_dir = ensure_default_model(game=game, warm_start_steps=cfg.model.warm_start_steps,
                                         warm_start_seconds=cfg.model.warm_start_seconds)
        cfg = replace(cfg, f"model.path={model_dir}")
    elif cfg.launcher.kind == "local" and not is_hub_id(cfg.model.path):
        check_model_dir(cfg.model.path)  # a bad path fails here, before any process starts (not in a worker's log)
    path.write_text(config_to_yaml(cfg))
    return cfg, path


def _keep_pinned_model(cfg: RunConfig, before: RunConfig) -> RunConfig:
    """`cfg` with the Hub model pin (commit and manifest) of the run being resumed, when it names the same
    model and either no revision or that commit."""
    old, new = before.model, cfg.model
    if old.manifest and not new.manifest and old.path == new.path and new.revision in ("", old.revision):
        log.info("resume: model %s stays at commit %s, the one the run was started with", old.path, old.revision)
        return dataclasses.replace(cfg, model=dataclasses.replace(new, revision=old.revision, manifest=old.manifest))
    return cfg


def _run_secret(run_dir: Path) -> bytes:
    """The run's secret: the one given ($EARL_STREAM_SECRET_FILE, `--secret-file`), else a new one in
    RUN_DIR/secret. A given one gets a link there, so that RUN_DIR/secret is always the run's secret
    and commands run in this directory find it (`security.find_run_secret`)."""
    own = run_dir / RUN_SECRET
    secret = load_secret()
    if secret is None:
        os.environ[SECRET_ENV] = str(create_secret_file(own).resolve())
    else:
        given = Path(os.environ[SECRET_ENV]).resolve()
        if not (own.is_file() and own.resolve() == given):
            own.unlink(missing_ok=True)
            own.symlink_to(given)
    secret = load_secret()
    assert secret is not None
    return secret


def _worker_key(run_dir: Path, secret: bytes, resume: bool) -> Path:
    """RUN_DIR/keys/worker: the worker key at the run's current generation, what the launchers give every worker
    instead of the secret (security/keys.py). A fresh run forgets the worker ids revoked in an earlier one (ids
    start again at 0); revoked key generations stay."""
    revoked = Revocations.load(run_dir)
    if not resume and revoked.workers:
        revoked.forget_workers()
    return write_worker_key(run_dir, secret).resolve()


def worker_commands(address: str, worker_key_file: str, encrypt: bool = False, tls: bool = False) -> list[str]:
    """What `up` prints so that a rollout worker can be added by pasting one line: from this directory
    (where the CLI finds the run's worker key by the address), and from anywhere else (with --secret-file
    naming the worker key, never the cluster secret; and --encrypt when the run encrypts its planes, --tls
    when it serves its endpoints over TLS)."""
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    base = f"earl-stream worker --role rollout --supervisor {address}" + (" --encrypt" if encrypt else "") \
        + (" --tls" if tls and not encrypt else "")
    full = f"{base} --secret-file {Path(worker_key_file).resolve()}"
    run = find_run_secret(address)
    here = base if run is not None and (run.run_dir / WORKER_KEY_FILE).resolve() == Path(worker_key_file).resolve() \
        else full
    copy = "copy the worker key file there (or `earl-stream keys derive worker --out PATH`; never the cluster secret)"
    if host in ("0.0.0.0", "*", "::"):
        full = full.replace(address, f"tcp://{socket.gethostname()}:{port}")
        note = f"(on another host: {copy} and add --advertise ITS_ADDRESS)"
    elif host == "localhost" or host.startswith("127."):
        note = (f"(another host: {copy}, add --advertise ITS_ADDRESS, and needs a supervisor it can reach: this one "
                "listens on loopback only; start `up --bind 0.0.0.0:PORT` for that)")
    else:
        note = f"(on another host: {copy} and add --advertise ITS_ADDRESS)"
    return [f"supervisor at {address} — add a rollout worker from this directory with: {here}",
            f"from another directory or host: {full}", note]


def encryption_line(cfg: RunConfig, bind: str) -> str:
    """Which path the run's planes take, for `up`'s log: encrypted (and why) or the local fast path."""
    if cfg.security.encrypt:
        why = (f"launcher {cfg.launcher.kind} places processes on other hosts" if cfg.launcher.kind != "local"
               else "security.encrypt=true")
        return (f"control plane, data plane and HTTP endpoints encrypted ({why}): CURVE, ChaCha20 frames, TLS; "
                "no UCX")
    host = bind.rpartition(":")[0]
    reach = ("; it listens beyond this host: workers joining from others travel unencrypted unless "
             "security.encrypt=true" if host not in ("", "localhost") and not host.startswith("127.") else "")
    return f"local run: planes not encrypted (the fast path: shared memory, UCX, plain HTTP){reach}"


def endpoint_settings(cfg: RunConfig, run_dir: Path, secret: bytes) -> list[str]:
    """Under TLS or metrics_auth: write the files clients need (RUN_DIR/tls/ca.pem, the run CA's certificate
    unless the user gave a CA; RUN_DIR/keys/readonly, the metrics bearer token) and say how agents and
    Prometheus use them. Validates the TLS files given (a ConfigError names every problem)."""
    sec = cfg.security
    tls_env(sec)
    lines: list[str] = []
    if sec.tls_on:
        ca = Path(sec.tls_ca_file).expanduser().resolve() if sec.tls_ca_file else \
            write_run_ca(secret, run_dir / CA_FILE).resolve()
        lines += [f"HTTPS endpoints (security.tls): clients trust the CA in {ca}",
                  f"  agent programs: base URL https://HOST:PORT/v1 (status --json: openai_url), SSL_CERT_FILE={ca}, "
                  "api_key: an agent key per episode (`earl-stream keys derive agent --episode ID`); the run's own "
                  "agents get theirs from their worker",
                  f"  Prometheus: scheme: https, tls_config: {{ca_file: {ca}}} (dashboards/prometheus.yml)"]
    if sec.metrics_auth_on:
        token = write_key(run_dir / READONLY_KEY_FILE, role_token(secret, KeyRole.READONLY)).resolve()
        lines.append(f"{'  ' if sec.tls_on else ''}metrics need the read-only key as bearer token: Prometheus "
                     f"authorization: {{credentials_file: {token}}}")
    return lines


def up(cfg: RunConfig, *, bind: str = "127.0.0.1:0", summary_path: str | None = None, resume: bool = False,
       restart: int = 0) -> int:
    """Run until `steps` (or a signal), the processes placed by the launcher `launcher.kind` names.
    `restart`: times the trainer pool is restarted from its latest checkpoint when one of its ranks
    dies, and times a rollout worker or the supervisor that dies is started again (0 = the run stops
    with an error naming the process)."""
    check_installed(cfg.logging.backends)  # a tracker's missing package: one error naming its extra, before anything
    cfg, config_file = prepare(cfg, resume=resume)
    run_dir = Path(cfg.run_dir)
    if not resume:  # a fresh run: forget the ledger of an earlier run in the same directory
        (run_dir / "supervisor.state").unlink(missing_ok=True)
        (run_dir / "supervisor.wal").unlink(missing_ok=True)
        (run_dir / "trained.jsonl").unlink(missing_ok=True)
        shutil.rmtree(run_dir / EXPERIENCE_DIR, ignore_errors=True)  # and the samples it had persisted
    secret = _run_secret(run_dir)
    launcher_key = _worker_key(run_dir, secret, resume)
    export_encrypt(bool(cfg.security.encrypt))  # for this process's own clients; the launcher passes it on
    endpoint_lines = [encryption_line(cfg, bind)] + endpoint_settings(cfg, run_dir, secret)
    launcher = make_launcher(RunSpec(cfg, config_file, Path(os.environ[SECRET_ENV]), bind, resume, restart))
    trackers = TrackerFeed.open(cfg, resume=resume)  # logging.backends, fed from metrics.jsonl (tracking/feed.py)
    stopping: list[str] = []
    signal.signal(signal.SIGINT, lambda s, f: stopping.append("interrupted"))
    signal.signal(signal.SIGTERM, lambda s, f: stopping.append("terminated"))
    record_up(run_dir, Path(summary_path) if summary_path else run_dir / "summary.json")  # for `earl-stream stop`
    started = time.time()
    status: dict[str, Any] = {}
    view = LiveView(cfg)
    try:
        sup, address = launcher.start_supervisor()
        for line in worker_commands(address, str(launcher_key), encrypt=bool(cfg.security.encrypt),
                                    tls=cfg.security.tls) + endpoint_lines:
            view.message(line)
        rollout = [launcher.start_rollout_worker(i, address) for i in range(cfg.rollout.workers)]
        placed = [sup] + rollout
        trainer = launcher.start_trainer_pool(address)
        client = P.ControlClient(address, timeout_s=10, secret=secret)
        try:
            _watch(view, launcher, client, trainer, placed, rollout, stopping, status, resume, restart, address,
                   run_dir, trackers)
        except BrokenPipeError:  # `up | tee log` and Ctrl-C: tee is gone; stop the run, keep its summary
            _output_gone()
            stopping.append("interrupted" if not stopping else stopping[0])
        if trainer.poll() not in (None, 0):
            raise ChildProcessFailed(trainer.describe_exit())
        status.update(_final_status(client) or {})
    except BaseException:
        trackers.close()  # the run failed: each tracker's run closed as it stands
        raise
    finally:
        launcher.stop()
    records = read_records(run_dir)  # the supervisor's per-step record: the summary's steps and the curve
    summary = make_summary(status, wall=time.time() - started, records=records)
    summary["metrics"] = step_summary(records, run_dir / METRICS_FILE)
    summary["model"] = {"path": cfg.model.path, "revision": cfg.model.revision}  # a Hub model's pinned commit
    out = Path(summary_path) if summary_path else run_dir / "summary.json"
    if not records and summary["steps"]:
        log.warning("no %s in %s (a supervisor on another host keeps it in its own run_dir): no learning curve",
                    METRICS_FILE, run_dir)
    curve = plot_learning_curve(records, out.parent / "learning_curve.png", status.get("eval"))
    summary["learning_curve_png"] = str(curve) if curve else None
    out.write_text(json.dumps(summary, indent=2))  # before anything is printed: the reader may be gone
    trackers.finish([out, curve])  # the last records, then the summary and the curve as artifacts
    try:
        view.finish(summary, stopping[0] if stopping else "")
    except BrokenPipeError:
        _output_gone()
    return 0  # also when stopped (Ctrl-C, SIGTERM, `earl-stream stop`): a requested, clean end; failures raise


def _output_gone() -> None:
    """Whoever read this process's output (a `| tee` stopped by the same Ctrl-C) is gone: further output
    goes nowhere instead of failing the writes that follow (the summary, the shutdown's logs)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for stream in (sys.stdout, sys.stderr):
        try:
            os.dup2(devnull, stream.fileno())
        except (OSError, ValueError):
            pass


def _watch(view: LiveView, launcher: Launcher, client: P.ControlClient, trainer: Placed, placed: list[Placed],
           rollout: list[Placed], stopping: list[str], status: dict[str, Any], resume: bool, restart: int, address: str,
           run_dir: Path, trackers: TrackerFeed) -> None:
    """The live view until the trainer pool ends or a signal: revives what died (up to `restart` times),
    starts the workers `earl-stream scale` asked for, and refreshes the view, the Prometheus targets,
    the trackers (the steps the supervisor recorded since) and `status` (the latest supervisor status,
    kept by the caller for the summary)."""
    revivals = recovered = 0
    with view:
        while not stopping and trainer.poll() is None:
            failed = next((p for p in placed if p.poll() not in (None, 0)), None)
            if failed is not None:
                if revivals >= restart:
                    raise ChildProcessFailed(failed.describe_exit())
                revivals += 1
                view.message(f"{failed.describe_exit().splitlines()[0]}; starting it again "
                             f"({revivals} of {restart} restarts)")
                launcher.revive(failed, address)
                continue
            status.update(_status(client) or {})
            if resume and status.get("samples_recovered", 0) > recovered:
                recovered = status["samples_recovered"]
                view.message(f"resume: {recovered} samples recovered from {run_dir / EXPERIENCE_DIR}, "
                             f"{status.get('samples_replayed_since_resume') or 0} re-played")
            for new in scale_up(launcher, status, rollout, address):  # `earl-stream scale` asked for more
                view.message(f"rollout pool below its size {status['pools']['rollout']['desired']}: "
                             f"started {new.name}")
                placed.append(new)
            view.update(status)
            write_targets(run_dir / "prometheus_targets.json", status)
            trackers.poll()
            time.sleep(0.5)


def scale_up(launcher: Launcher, status: dict[str, Any], rollout: list[Placed], address: str) -> list[Placed]:
    """Start the rollout workers the pool lacks to reach the size `earl-stream scale` set in the
    supervisor (status pools.rollout.desired; None = never set, nothing to do). Appends them to `rollout`.

    Counted as there: the supervisor's active workers, or this launcher's running ones less those
    draining, whichever is more (a worker just started is running before it registers; one started
    by hand is active without being ours). A drained worker exits 0 and is not revived."""
    pool = status.get("pools", {}).get("rollout", {})
    if pool.get("desired") is None:
        return []
    running = sum(p.poll() is None for p in rollout)
    missing = pool["desired"] - max(pool.get("active", 0), running - pool.get("draining", 0))
    new = [launcher.start_rollout_worker(len(rollout) + i, address) for i in range(max(0, missing))]
    rollout.extend(new)
    return new


def _final_status(client: P.ControlClient, tries: int = 3) -> dict[str, Any] | None:
    """The status the summary rests on, asked once the trainer pool ended: patient (a loaded host may answer
    a status call slower than the live view's 5 s), so the summary does not keep an older poll's step."""
    for _ in range(tries):
        try:
            return json.loads(client.call(P.StatusRequest(), timeout_s=20).status_json)
        except EarlError:
            continue
    return None


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


def make_summary(status: dict[str, Any], *, wall: float, records: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The run's summary from its final `status` (the counters) and its per-step `records` (metrics.jsonl):
    the steps and the last loss come from the last record where there is one (a final status that could not
    be read, or was read before the last publish, does not shorten the run)."""
    trainer = status.get("trainer", {})
    last = records[-1] if records else {}
    version = max(status.get("policy_version", 0), last.get("step", 0))
    return {
        "steps": version,
        "policy_version": version,
        "samples_trained": status.get("samples_consumed", 0),
        "samples_produced": status.get("samples_produced", 0),
        "mean_reward_last": status.get("mean_reward_last"),
        "win_rate_last": status.get("win_rate_last"),
        "draw_rate_last": status.get("draw_rate_last"),
        "tokens_per_second": status.get("tokens_per_second", 0.0),
        "wall_seconds": wall,
        "samples_lost": status.get("samples_lost", 0),
        "samples_recovered": status.get("samples_recovered", 0),  # persisted samples trained, not re-played
        "samples_replayed_since_resume": status.get("samples_replayed_since_resume"),  # None: not resumed
        "samples_stale": status.get("samples_stale", 0),
        "samples_filtered": status.get("samples_filtered", 0),  # equal-reward groups dropped (algo.dynamic_sampling)
        # episodes stopped or refused as longer than the largest plan the pools can run (rollout plan max_episode_tokens)
        "samples_too_long": status.get("samples_too_long", 0),
        # trainer steps that failed to allocate, each re-planned and retried: when, plans before and after, bytes
        "oom_recoveries": (status.get("plans") or {}).get("oom_recoveries", []),
        # episodes kept as several samples (rollout.non_append=split): samples beyond an episode's first
        "episodes_produced": status.get("episodes_produced", 0),
        "segments_split": status.get("segments_split", 0),
        "prompts_issued": status.get("prompts_issued", 0),
        "prompts_reissued": status.get("prompts_reissued", 0),
        "duplicates_detected": status.get("duplicates_detected", 0),
        "samples_in_store": status.get("samples_in_store", 0),
        "samples_claimed": status.get("samples_claimed", 0),
        # evaluation during training (eval.every): env -> latest round (version, value = success, pass@k, mean
        # reward) and its history
        "eval": {env: {k: v for k, v in e.items() if k != "in_progress"} for env, e in status.get("eval", {}).items()},
        # training seeds and evaluation seeds, [start, stop) each: they never meet (earl_stream/env/seeds.py)
        "seed_split": status.get("seed_split"),
        "last_loss": last["loss"] if last.get("loss") is not None else trainer.get("loss"),
        "weight_bytes_per_version": trainer.get("weight_bytes_per_version"),  # the model, or its LoRA adapters
        # where each process ran (host, and ray_node_id under the ray launcher), a trainer's rank, and
        # whether a rollout worker left by draining (`earl-stream scale`)
        "workers": [{k: w.get(k) for k in ("id", "role", "rank", "alive", "host", "ray_node_id", "draining", "drained")}
                    for w in status.get("workers", [])],
    }
