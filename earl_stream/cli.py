"""The `earl-stream` command line. Every user error ends in one clear line and a non-zero exit."""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
from collections.abc import Sequence

from earl_stream.errors import EarlError

log = logging.getLogger("earl_stream")

RESTART_HELP = ("when a trainer rank dies, stop the whole trainer pool and start it again, up to N times; it "
                "resumes from its latest checkpoint with nothing skipped or repeated (like torchrun --max-restarts; "
                "default 0: the pool stops with an error naming the rank, and relaunching it resumes the same way)")
OVERRIDES_HELP = "dotted config overrides, e.g. trainer.lr=3e-4 rollout.workers=3 (see `config show --fields`)"


def _add_secret_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--secret-file", metavar="PATH", help="cluster secret guarding the control and data planes "
                   "(default: $EARL_STREAM_SECRET_FILE; `up` creates one in its run directory)")


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="PATH", help="YAML config file (default: the embedded Tic-Tac-Toe run)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help=OVERRIDES_HELP)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="earl-stream", description=(
        "Asynchronous streaming agentic RL for LLMs: rollout and trainer pools around a distributed, "
        "layout-indexed experience store."))
    parser.add_argument("--log-level", default=os.environ.get("EARL_LOG_LEVEL", "INFO"), help="logging level")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("up", help="start a whole run on this machine (supervisor, rollout workers, trainer)",
                       description="Start a supervisor, rollout workers and a trainer pool as separate processes "
                                   "on this machine and train until --steps (or Ctrl-C).")
    _add_config_args(p)
    p.add_argument("--bind", default="127.0.0.1:0", metavar="HOST:PORT", help="supervisor address (port 0 = any free)")
    p.add_argument("--steps", type=int, help="training steps (overrides steps=)")
    p.add_argument("--summary", metavar="PATH", help="write the JSON summary here (default RUN_DIR/summary.json)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in run_dir: the supervisor's ledger and the trainer's latest checkpoint")
    p.add_argument("--restart", type=int, default=0, metavar="N",
                   help=RESTART_HELP + ". `up` also starts a rollout worker or the supervisor that dies again, up to N "
                   "times in all (the supervisor on the same address, from the run's state: nothing is lost)")
    _add_secret_arg(p)

    p = sub.add_parser("supervisor", help="run the supervisor (control plane) of a run")
    _add_config_args(p)
    p.add_argument("--bind", default="127.0.0.1:5555", metavar="HOST:PORT", help="address to listen on")
    p.add_argument("--state-dir", metavar="DIR", help="where the supervisor keeps its state (default RUN_DIR)")
    p.add_argument("--ready-file", metavar="PATH", help="write {address, metrics_address} here once listening")
    p.add_argument("--forget-workers", action="store_true",
                   help="on restoring state, declare the saved run's workers dead at once (their unpulled samples "
                        "lost, their prompts re-issued) instead of waiting for them to reconnect; for when every "
                        "process of that run is known to be gone, as `up --resume` knows")
    _add_secret_arg(p)

    p = sub.add_parser("worker", help="run a rollout worker or a trainer pool against a supervisor")
    p.add_argument("--role", required=True, choices=("rollout", "trainer"))
    p.add_argument("--supervisor", required=True, metavar="tcp://HOST:PORT", help="the supervisor's address")
    p.add_argument("--advertise", default="127.0.0.1", metavar="HOST",
                   help="address other processes use to reach this worker's shard node")
    p.add_argument("--nproc", type=int, default=1, help="trainer ranks to start on this host (gloo)")
    p.add_argument("--restart", type=int, default=0, metavar="N",
                   help=RESTART_HELP + ". Trainer only; under torchrun use its --max-restarts instead")
    p.add_argument("--collective-timeout", type=float, default=300.0, metavar="SECONDS",
                   help="trainer only: a collective with the other ranks (or joining them) that takes longer fails "
                        "with an error naming the step, instead of hanging the pool")
    _add_secret_arg(p)

    p = sub.add_parser("status", help="show the state of a running system")
    p.add_argument("--supervisor", required=True, metavar="tcp://HOST:PORT")
    p.add_argument("--json", action="store_true", help="print the raw JSON status")
    _add_secret_arg(p)

    p = sub.add_parser("env", help="attach, detach or list environments of a running system")
    esub = p.add_subparsers(dest="env_command", required=True)
    ea = esub.add_parser("attach", help="add an environment to a live run (no restart)",
                         description="Every rollout worker imports SPEC and starts sampling it within one episode "
                                     "cycle. SPEC is an entry-point name, module:Class or path/to/file.py:Class.")
    ea.add_argument("spec", metavar="SPEC")
    ea.add_argument("--name", default="", help="name in metrics and status (default: from SPEC)")
    ea.add_argument("--weight", type=float, default=1.0, help="relative share of new prompts")
    ea.add_argument("--param", action="append", default=[], metavar="K=V", help="constructor argument (repeatable)")
    ea.add_argument("--wait", type=float, default=60.0, help="seconds to wait for the workers to load it (0 = don't)")
    ed = esub.add_parser("detach", help="stop new prompts for an environment; episodes in flight finish")
    ed.add_argument("name")
    esub.add_parser("list", help="list the environments of the run")
    for e in (ea, ed, esub.choices["list"]):
        e.add_argument("--supervisor", required=True, metavar="tcp://HOST:PORT")
        _add_secret_arg(e)

    p = sub.add_parser("episodes", help="finished episodes: readable transcripts, Parquet export")
    psub = p.add_subparsers(dest="episodes_command", required=True)
    pt = psub.add_parser("tail", help="print the latest finished episodes as transcripts")
    pt.add_argument("--follow", "-f", action="store_true", help="keep printing new episodes")
    pt.add_argument("--last", type=int, default=5, help="start with this many recent episodes")
    pt.add_argument("--all", action="store_true", help="start with every episode the supervisor still lists")
    pe = psub.add_parser("export", help="write recent episodes with their metadata to a file")
    pe.add_argument("--format", default="parquet", choices=("parquet",))
    pe.add_argument("path", metavar="PATH")
    for e in (pt, pe):
        e.add_argument("--supervisor", required=True, metavar="tcp://HOST:PORT")
        _add_secret_arg(e)

    p = sub.add_parser("config", help="configuration tools")
    csub = p.add_subparsers(dest="config_command", required=True)
    cs = csub.add_parser("show", help="print the effective configuration as YAML")
    _add_config_args(cs)
    cs.add_argument("--fields", action="store_true", help="list every field with its help instead")

    p = sub.add_parser("init-model", help="build a tiny random Hugging Face model and tokenizer in DIR")
    p.add_argument("dir", metavar="DIR")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warm-start-seconds", type=float, default=0.0,
                   help="supervised warm start on synthetic Tic-Tac-Toe play (0 = leave it random)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname).1s %(processName)s %(name)s: %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # no "Loading weights" bars in our logs
    if getattr(args, "secret_file", None):
        from earl_stream.security import SECRET_ENV

        os.environ[SECRET_ENV] = os.path.abspath(args.secret_file)  # children inherit it
    try:
        return _dispatch(args)
    except EarlError as exc:
        print(f"earl-stream {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _dispatch(args: argparse.Namespace) -> int:
    from earl_stream.config import load_config
    from earl_stream.errors import ConfigError

    if args.command == "up":
        from earl_stream.launcher import up

        if args.restart < 0:
            raise ConfigError("--restart must be >= 0")
        overrides = list(args.overrides) + ([f"steps={args.steps}"] if args.steps is not None else [])
        return up(load_config(args.config, overrides), bind=args.bind, summary_path=args.summary, resume=args.resume,
                  restart=args.restart)
    if args.command == "supervisor":
        from earl_stream.security import load_secret
        from earl_stream.supervisor.server import serve

        cfg = load_config(args.config, args.overrides)
        serve(cfg, args.bind, ready_file=args.ready_file, secret=load_secret(), state_dir=args.state_dir,
              forget_workers=args.forget_workers)
        return 0
    if args.command == "worker":
        return _worker(args)
    if args.command == "status":
        return _status(args)
    if args.command == "episodes":
        from earl_stream.episodes import run_episodes_command

        return run_episodes_command(args)
    if args.command == "env":
        from earl_stream.env_cli import run_env_command

        return run_env_command(args)
    if args.command == "config":
        from earl_stream.config import config_to_yaml, field_help

        if args.fields:
            for name, text in field_help():
                print(f"{name:36s} {text}")
            return 0
        print(config_to_yaml(load_config(args.config, args.overrides)), end="")
        return 0
    if args.command == "init-model":
        from earl_stream.modeling import init_model

        path = init_model(args.dir, seed=args.seed)
        if args.warm_start_seconds > 0:
            from earl_stream.warmstart import warm_start

            report = warm_start(path, seconds=args.warm_start_seconds, seed=args.seed)
            print(f"warm start: {report}")
        print(f"model and tokenizer written to {path}")
        return 0
    raise AssertionError(args.command)


def _worker(args: argparse.Namespace) -> int:
    if args.restart < 0 or args.collective_timeout <= 0:
        from earl_stream.errors import ConfigError

        raise ConfigError("--restart must be >= 0 and --collective-timeout > 0")
    if args.role == "rollout":
        from earl_stream.workers.rollout import run_rollout_worker

        run_rollout_worker(args.supervisor, host=args.advertise)
        return 0
    if "RANK" in os.environ:
        if args.restart:
            log.warning("--restart is ignored under torchrun (RANK is set): use torchrun --max-restarts")
    elif args.nproc > 1 or args.restart > 0:
        return _spawn_ranks(args)
    from earl_stream.workers.trainer import run_trainer_rank

    return run_trainer_rank(args.supervisor, host=args.advertise, collective_timeout_s=args.collective_timeout)


def _spawn_ranks(args: argparse.Namespace) -> int:
    """Start --nproc trainer ranks on this host, torchrun-style (RANK, WORLD_SIZE, MASTER_*).

    A rank that dies stops the whole pool (the others would fail in their next collective anyway);
    with --restart N the pool is started again, up to N times, and resumes from its checkpoint.
    """
    import signal

    from earl_stream.errors import ChildProcessFailed

    stopping: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    signal.signal(signal.SIGINT, lambda *_: stopping.append(1))
    for attempt in range(args.restart + 1):
        failure = _run_pool(args, stopping)
        if failure is None or stopping:
            return 0
        if attempt == args.restart:
            raise ChildProcessFailed(f"{failure}; the trainer pool stopped"
                                     + (f" after {args.restart} restarts" if args.restart else
                                        " (relaunch it, or pass --restart N, to resume from its latest checkpoint)"))
        log.warning("%s: restarting the trainer pool (%d of %d); it resumes from its latest checkpoint", failure,
                    attempt + 1, args.restart)
    return 0


def _run_pool(args: argparse.Namespace, stopping: list[int]) -> str | None:
    """Run one incarnation of the pool; returns what failed (None: it finished or was stopped)."""
    import time

    from earl_stream.procs import ProcessGroup, describe_exit

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    group = ProcessGroup()
    for rank in range(args.nproc):
        env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(args.nproc),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        group.start(f"trainer rank {rank}", ["worker", "--role", "trainer", "--supervisor", args.supervisor,
                                             "--advertise", args.advertise, "--collective-timeout",
                                             str(args.collective_timeout)], env=env)
    try:
        while not stopping and any(c.proc.poll() is None for c in group.children):
            failed = [c for c in group.children if c.proc.poll() not in (None, 0)]
            if failed:  # the rank that was killed, rather than the ones that then lost their peer
                return describe_exit(min(failed, key=lambda c: c.proc.returncode))
            time.sleep(0.2)
    finally:
        group.stop()
    return None


def _status(args: argparse.Namespace) -> int:
    from earl_stream import protocol as P
    from earl_stream.live import status_line
    from earl_stream.security import load_secret

    client = P.ControlClient(args.supervisor, timeout_s=5, secret=load_secret())
    status = json.loads(client.call(P.StatusRequest(), what="status").status_json)
    if args.json:
        print(json.dumps(status, indent=2))
    else:
        print(status_line(status, 0))
        for w in status["workers"]:
            health = "alive" if w["alive"] else "DEAD"
            print(f"  {w['id']:12s} {w['role']:8s} {health:5s} pid {w['pid']} on {w['host']} "
                  f"(seen {w['last_seen_s']}s ago)")
    return 0
