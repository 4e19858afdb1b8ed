"""The `earl-stream` command line: the parser and the dispatch to each command's module in this package.
Every user error ends in one clear line and a non-zero exit."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from earl_stream import __version__
from earl_stream.cli.flags import add_param_args
from earl_stream.cli.local_run import RUN_DIR_HELP, LocalRun, add_run_args
from earl_stream.config import GROUP_SEEDS, TrainerConfig
from earl_stream.errors import EarlError

log = logging.getLogger("earl_stream")

RESTART_HELP = ("when a trainer rank dies, stop the whole trainer pool and start it again, up to N times; it "
                "resumes from its latest checkpoint with nothing skipped or repeated (like torchrun --max-restarts; "
                "default 0: the pool stops with an error naming the rank, and relaunching it resumes the same way)")
OVERRIDES_HELP = "dotted config overrides, e.g. trainer.lr=3e-4 rollout.workers=3 (see `config show --fields`)"


def _add_secret_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--secret-file", metavar="PATH", help="cluster secret guarding the control and data planes, "
                   "or a role key from `earl-stream keys derive ROLE` (a command then signs with that key, and the "
                   "supervisor refuses what its role may not do); with the cluster secret a command signs with the "
                   "key of the role it needs (default: $EARL_STREAM_SECRET_FILE, else the secret of the run in this "
                   "directory, or in runs/*/, whose ready file names the --supervisor address; without --supervisor, "
                   "the secret of the run found by --run-dir; `up` creates one in its run directory)")
    p.add_argument("--encrypt", action="store_true", help="the run encrypts both planes (security.encrypt=true): "
                   "connect with CURVE and encrypted data frames (default: $EARL_STREAM_ENCRYPT=1, else the run "
                   "found in this directory says so in its config.yaml, else off)")


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="PATH", help="YAML config file (default: the embedded Tic-Tac-Toe run)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help=OVERRIDES_HELP)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="earl-stream", description=(
        "Asynchronous streaming agentic RL for LLMs: rollout and trainer pools around a distributed, "
        "layout-indexed experience store."))
    parser.add_argument("--log-level", default=os.environ.get("EARL_LOG_LEVEL", "INFO"), help="logging level")
    parser.add_argument("--version", action="version", version=f"earl-stream {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("up", help="start a whole run (supervisor, rollout workers, trainer) here or on a Ray cluster",
                       description="Start a supervisor, rollout workers and a trainer pool as separate processes "
                                   "(on this machine, or placed by --launcher) and train until --steps (or Ctrl-C).")
    _add_config_args(p)
    p.add_argument("--bind", default="127.0.0.1:0", metavar="HOST:PORT", help="supervisor address (port 0 = any free)")
    p.add_argument("--steps", type=int, help="training steps (overrides steps=)")
    p.add_argument("--summary", metavar="PATH", help="write the JSON summary here (default RUN_DIR/summary.json)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in run_dir: the supervisor's ledger and the trainer's latest checkpoint")
    p.add_argument("--restart", type=int, default=0, metavar="N",
                   help=RESTART_HELP + ". `up` also starts a rollout worker or the supervisor that dies again, up to N "
                   "times in all (the supervisor on the same address, from the run's state: nothing is lost)")
    p.add_argument("--launcher", metavar="KIND", help="how the processes are placed: local (child processes on "
                   "this machine, the default), ray (actors on a Ray cluster; see `config show --fields` for "
                   "launcher.ray.*), slurm, or module:Name (overrides launcher.kind=)")
    p.add_argument("--ray-address", metavar="ADDR", help="the Ray cluster to join with --launcher ray (HOST:6379, "
                   "ray://HOST:10001, auto; overrides launcher.ray.address=)")
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
    p.add_argument("--drain-on-term", action="store_true",
                   help="rollout only: on SIGTERM, drain (take no new prompts, leave once every sample it produced is "
                        "trained and released) instead of stopping at once; a second SIGTERM stops at once. For hosts "
                        "that stop workers on their own: Kubernetes scale-down, preemptible nodes")
    p.add_argument("--nproc", type=int, default=1, help="trainer ranks to start on this host (gloo)")
    p.add_argument("--restart", type=int, default=0, metavar="N",
                   help=RESTART_HELP + ". Trainer only; under torchrun use its --max-restarts instead")
    p.add_argument("--collective-timeout", type=float, default=300.0, metavar="SECONDS",
                   help="trainer only: a collective with the other ranks (or joining them) that takes longer fails "
                        "with an error naming the step, instead of hanging the pool")
    p.add_argument("--stop-grace", type=float, default=TrainerConfig.stop_grace_s, metavar="SECONDS",
                   help="trainer pool (--nproc, --restart): on SIGTERM or SIGINT its ranks get this long to finish their "
                        "step and write a checkpoint before they are killed; a second signal stops them at once. `up` "
                        "passes trainer.stop_grace_s")
    p.add_argument("--tls", action="store_true", help="the run serves its HTTP endpoints over TLS (security.tls=true; "
                   "implied by --encrypt): this worker's OpenAI and metrics endpoints serve HTTPS with a certificate "
                   "from the run CA (derived from the cluster secret), and its metrics ask for the read-only key; with "
                   "your own certificate set EARL_STREAM_TLS_CERT, EARL_STREAM_TLS_KEY and EARL_STREAM_TLS_CA to its files")
    _add_secret_arg(p)

    p = sub.add_parser("status", help="show the state of a running system (default: the run in runs/latest)",
                       description="Show the state of a live run: the one --supervisor names, else the local run "
                                   "(--run-dir, else runs/latest here), so that no flag is needed where `up` runs.")
    add_run_args(p)
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
    add_param_args(ea, "constructor arguments as one JSON object")
    ea.add_argument("--group-seed", default="auto", choices=GROUP_SEEDS,
                    help="what a GRPO group's episodes reset the environment with: shared = one seed (one task); "
                    "per_episode = a seed each (where the seed only draws chance, e.g. an opponent); auto = what the "
                    "environment's seed_per_episode says, else shared (envs[].group_seed)")
    ea.add_argument("--wait", type=float, default=60.0, help="seconds to wait for the workers to load it (0 = don't)")
    ea.add_argument("--address", metavar="HOST:PORT", help="attach the environment `env serve` serves there; SPEC is "
                    "then the NAME it gets in this run")
    ed = esub.add_parser("detach", help="stop new prompts for an environment; episodes in flight finish")
    ed.add_argument("name")
    esub.add_parser("list", help="list the environments of the run")
    for e in (ea, ed, esub.choices["list"]):
        add_run_args(e)
        _add_secret_arg(e)
    from earl_stream.cli.env import add_serve_parser

    _add_secret_arg(add_serve_parser(esub))

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
        add_run_args(e)
        _add_secret_arg(e)

    p = sub.add_parser("stop", help="stop a run as Ctrl-C on its `up` does (default: the run in runs/latest)",
                       description="End the run in RUN_DIR (default: this directory if it is a run directory, else "
                                   "runs/latest, else the newest runs/*/) exactly as Ctrl-C on its `earl-stream up` "
                                   "does: the workers drain, the trainer checkpoints, `up` writes the summary and "
                                   "exits 0. Waits until `up` has exited and prints where the summary is. A run "
                                   "started by hand (no `up`) is told by its supervisor to finish.")
    p.add_argument("run_dir", nargs="?", metavar="RUN_DIR", help=RUN_DIR_HELP)
    p.add_argument("--supervisor", metavar="tcp://HOST:PORT", help="a run started by hand, without `up`: tell "
                   "this supervisor to finish (default: the run in RUN_DIR)")
    p.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS",
                   help="how long to wait for `up` to drain, checkpoint and exit (default 600)")
    _add_secret_arg(p)

    from earl_stream.cli import eval as eval_cli
    from earl_stream.cli import keys, scale, slurm

    eval_cli.add_parser(sub)
    scale.add_parser(sub, _add_secret_arg)
    keys.add_parser(sub, _add_secret_arg)
    slurm.add_parser(sub)

    p = sub.add_parser("config", help="configuration tools")
    csub = p.add_subparsers(dest="config_command", required=True)
    cs = csub.add_parser("show", help="print the effective configuration as YAML")
    _add_config_args(cs)
    cs.add_argument("--fields", action="store_true", help="list every field with its help instead")

    p = sub.add_parser("init-model", help="build a tiny random Hugging Face model and tokenizer in DIR")
    p.add_argument("dir", metavar="DIR")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warm-start-seconds", type=float, default=0.0,
                   help="supervised warm start on synthetic legal play of --game (0 = leave it random)")
    p.add_argument("--game", default="tictactoe", help="environment spec of the warm start's game (it must list "
                   "legal_moves(), as tictactoe and connect_four do)")

    from earl_stream.model.commands import add_model_commands

    add_model_commands(sub)
    from earl_stream.cli import doctor, runs_cmd, sft

    sft.add_parser(sub)
    runs_cmd.add_parser(sub)
    doctor.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(build_parser(), argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname).1s %(processName)s %(name)s: %(message)s")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # no "Loading weights" bars in our logs
    from earl_stream.security.keys import WORKER_KEY_FILE
    from earl_stream.security.secret import SECRET_ENV, is_secret_refusal, secret_refusal_hint, use_secret

    try:
        args.local_run = _local_run(args)
    except EarlError as exc:
        print(f"earl-stream {args.command}: error: {exc}", file=sys.stderr)
        return 2
    address = getattr(args, "supervisor", None)
    run = use_secret(getattr(args, "secret_file", None), address)
    if run is not None and args.command == "worker" and (run.run_dir / WORKER_KEY_FILE).is_file():
        os.environ[SECRET_ENV] = str(run.run_dir / WORKER_KEY_FILE)  # a worker needs the worker key, not the secret
        log.info("using the worker key of the run in %s (its ready file names %s)", run.run_dir, address)
    elif run is not None:
        log.info("using the cluster secret of the run in %s (its ready file names %s)", run.run_dir, address)
    run_dir = run.run_dir if run is not None else args.local_run.run_dir if args.local_run is not None else None
    run_dir = run_dir or _run_dir_of_secret(os.environ.get(SECRET_ENV))
    if getattr(args, "encrypt", False) or (run_dir is not None and _run_encrypts(run_dir)):
        from earl_stream.security.encryption import export_encrypt

        export_encrypt(True)
    if getattr(args, "tls", False):
        from earl_stream.security.tls import TLS_ENV

        os.environ[TLS_ENV] = "1"
    try:
        return _dispatch(args)
    except EarlError as exc:
        message = str(exc)
        if is_secret_refusal(message):
            message += _agent_key_hint() or secret_refusal_hint(address)
        print(f"earl-stream {args.command}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """The arguments, with config overrides (KEY=VALUE) taken wherever they stand: argparse fills a `nargs="*"`
    positional from its first run of values only, so `up a=1 --config F b=2` would refuse `b=2`."""
    args, extra = parser.parse_known_args(argv)
    if extra and hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
        args.overrides = list(args.overrides) + extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


LIVE_COMMANDS = ("status", "scale", "env", "episodes", "keys", "stop")


def _local_run(args: argparse.Namespace) -> LocalRun | None:
    """The local run a live-run command talks to when --supervisor is not given (or --run-dir is): sets
    args.supervisor to its address and, when no secret is given, args.secret_file to its secret."""
    from earl_stream.cli.local_run import find_run
    from earl_stream.security.secret import SECRET_ENV

    if args.command not in LIVE_COMMANDS or getattr(args, "env_command", "") == "serve":
        return None
    secret_given = bool(args.secret_file or os.environ.get(SECRET_ENV))
    if args.run_dir is None and (args.supervisor or (args.command == "keys" and secret_given)):
        return None
    run = find_run(args.run_dir)
    args.supervisor = args.supervisor or run.address
    if not secret_given and run.secret_file is not None:
        args.secret_file = str(run.secret_file)
    return run


def _agent_key_hint() -> str:
    """When the credential given is an agent key: why the control plane refused it."""
    from earl_stream.security.keys import KeyRole, role_of
    from earl_stream.security.secret import load_secret

    try:
        held = role_of(load_secret())
    except EarlError:
        return ""
    return ("; the file given holds an agent key, which only the OpenAI endpoint takes (for its episode's "
            "requests): commands need the cluster secret or a role key (`earl-stream keys derive ROLE`)"
            if held is KeyRole.AGENT else "")


def _run_dir_of_secret(secret_file: str | None) -> Path | None:
    """The run directory a secret or key file belongs to (`RUN/secret`, `RUN/keys/worker`): the nearest of
    its parent and grandparent that holds the run's config.yaml, so that `--secret-file RUN/secret` learns
    whether the run encrypts as `--supervisor` alone does."""
    if not secret_file:
        return None
    parent = Path(secret_file).resolve().parent
    return next((d for d in (parent, parent.parent) if (d / "config.yaml").is_file()), None)


def _run_encrypts(run_dir: Path) -> bool:
    """Whether the run `up` started in `run_dir` encrypts its planes (its effective config.yaml says so)."""
    from earl_stream.config import load_config

    try:
        return bool(load_config(str(run_dir / "config.yaml"), []).security.encrypt)
    except (OSError, EarlError):
        return False


def _dispatch(args: argparse.Namespace) -> int:
    from earl_stream.config import load_config
    from earl_stream.errors import ConfigError

    if args.command == "up":
        from earl_stream.cli.up import up

        if args.restart < 0:
            raise ConfigError("--restart must be >= 0")
        overrides = list(args.overrides) + ([f"steps={args.steps}"] if args.steps is not None else [])
        overrides += [f"launcher.kind={args.launcher}"] if args.launcher else []
        overrides += [f"launcher.ray.address={args.ray_address}"] if args.ray_address else []
        overrides += ["security.encrypt=true"] if args.encrypt else []
        return up(load_config(args.config, overrides), bind=args.bind, summary_path=args.summary, resume=args.resume,
                  restart=args.restart)
    if args.command == "supervisor":
        from earl_stream.security.secret import load_secret
        from earl_stream.supervisor.serve import serve

        cfg = load_config(args.config, list(args.overrides) + (["security.encrypt=true"] if args.encrypt else []))
        if cfg.security.encrypt:
            from earl_stream.security.encryption import export_encrypt

            export_encrypt(True)
        serve(cfg, args.bind, ready_file=args.ready_file, secret=load_secret(), state_dir=args.state_dir,
              forget_workers=args.forget_workers)
        return 0
    if args.command == "worker":
        from earl_stream.cli.worker import run_worker

        return run_worker(args)
    if args.command == "status":
        return _status(args)
    if args.command == "episodes":
        from earl_stream.cli.episodes import run_episodes_command

        return run_episodes_command(args)
    if args.command == "env":
        from earl_stream.cli.env import run_env_command

        return run_env_command(args)
    if args.command == "eval":
        from earl_stream.cli.eval import run_eval

        return run_eval(args)
    if args.command == "scale":
        from earl_stream.cli.scale import run_scale

        return run_scale(args)
    if args.command == "keys":
        from earl_stream.cli.keys import run_keys_command

        return run_keys_command(args)
    if args.command == "stop":
        from earl_stream.cli.local_run import finish_by_supervisor, stop_run

        print(stop_run(args.local_run, args.timeout) if args.local_run is not None
              else finish_by_supervisor(args.supervisor))
        return 0
    if args.command == "slurm":
        from earl_stream.cli.slurm import run

        return run(args)
    if args.command == "config":
        from earl_stream.config import config_to_yaml, field_help

        if args.fields:
            for name, text in field_help():
                print(f"{name:36s} {text}")
            return 0
        print(config_to_yaml(load_config(args.config, args.overrides)), end="")
        return 0
    if args.command == "init-model":
        from earl_stream.model import init_model, warm_start

        path = init_model(args.dir, seed=args.seed)
        if args.warm_start_seconds > 0:
            report = warm_start(path, args.game, seconds=args.warm_start_seconds, seed=args.seed)
            print(f"warm start: {report}")
        print(f"model and tokenizer written to {path}")
        return 0
    if args.command == "model":
        from earl_stream.model.commands import run_model_command

        return run_model_command(args)
    if args.command == "sft":
        from earl_stream.cli.sft import run_sft_command

        return run_sft_command(args)
    if args.command == "runs":
        from earl_stream.cli.runs_cmd import run_runs

        return run_runs(args)
    if args.command == "doctor":
        from earl_stream.cli.doctor import run_doctor

        return run_doctor(args)
    raise AssertionError(args.command)


def _status(args: argparse.Namespace) -> int:
    from earl_stream import protocol as P
    from earl_stream.cli.live import status_line
    from earl_stream.security.keys import KeyRole, key_for
    from earl_stream.security.secret import load_secret

    client = P.ControlClient(args.supervisor, timeout_s=5, secret=key_for(load_secret(), KeyRole.READONLY))
    status = json.loads(client.call(P.StatusRequest(), what="status").status_json)
    if args.json:
        print(json.dumps(status, indent=2))
    else:
        print(status_line(status, 0))
        for w in status["workers"]:
            health = "alive" if w["alive"] else "DEAD"
            node = f" (Ray node {w['ray_node_id'][:12]})" if w.get("ray_node_id") else ""
            openai = f", OpenAI API at {w['openai_url']}" if w.get("openai_url") else ""
            state = " draining" if w.get("draining") else " drained" if w.get("drained") else ""
            print(f"  {w['id']:12s} {w['role']:8s} {health:5s}{state} pid {w['pid']} on {w['host']}{node} "
                  f"(seen {w['last_seen_s']}s ago{openai})")
    return 0
