"""Starting a program in a sandbox (`spec.SandboxSpec`) and telling, once it ended, which limit it went past.

`start(argv, spec)` returns a `Sandboxed` (a `subprocess.Popen` and the control groups it runs in); `run(...)`
runs a program to its end and returns a `SandboxResult`. How each limit holds:

- CPU seconds: RLIMIT_CPU (SIGXCPU at the limit, SIGKILL a second later); `Sandboxed.allow_cpu` moves the limit
  on for a sandbox that is reused for the next run.
- Wall seconds: the caller's (`run` kills the whole sandbox at `limits.wall_seconds`).
- Memory: a memory control group of its own (cgroup v1 or v2, where this process may make one: root), whose
  OOM kill is read back as `Breach.MEMORY`; elsewhere RLIMIT_AS (an allocation past it fails).
- Processes: a pids control group of its own; elsewhere RLIMIT_NPROC (which binds only a user that is not root).

`bwrap` builds the filesystem from nothing: /usr (and the merged-/usr links), the few /etc files programs read
(passwd, group, hosts, resolv.conf, ssl), the interpreter's prefixes and installed packages (editable installs'
source folders included), the spec's paths, a private /tmp, /proc and /dev. The caller's home, working
directory, run directory and everything else do not exist inside. It runs as uid/gid 65534 in new user, pid,
IPC, UTS and network namespaces (the network only shared when the spec names one) and dies with its parent.
`process` runs the program as uid 65534 where the caller is root (and that uid may run the program), in a
private temporary directory, with the same limits; it sees the host's files (those 65534 may read) and network, which is why it warns.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import resource
import shutil
import signal
import site
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from earl_stream.sandbox.cgroups import Groups
from earl_stream.sandbox.spec import Breach, SandboxMode, SandboxSpec

NOBODY = 65534
_ETC = ("/etc/passwd", "/etc/group", "/etc/hosts", "/etc/resolv.conf", "/etc/nsswitch.conf", "/etc/localtime",
        "/etc/ssl", "/etc/ca-certificates", "/etc/alternatives")
_HIDDEN_ENV = ("EARL_STREAM_SECRET_FILE", "EARL_STREAM_TLS_KEY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN",
               "OPENAI_API_KEY", "AWS_SECRET_ACCESS_KEY", "WANDB_API_KEY")


@functools.lru_cache(maxsize=1)
def bwrap_problem() -> str | None:
    """Why bubblewrap cannot sandbox here (None: it can): missing, or unable to make its namespaces."""
    path = shutil.which("bwrap")
    if path is None:
        return "bubblewrap is not installed (scripts/install-sandbox.sh installs it)"
    try:
        probe = subprocess.run([path, *_bwrap_args(SandboxSpec()), "--", "/bin/true"], capture_output=True,
                               text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"bwrap did not run: {exc}"
    if probe.returncode != 0:
        return f"bwrap cannot make its namespaces here: {probe.stderr.strip().splitlines()[-1:] or probe.returncode}"
    return None


def resolve_mode(requested: SandboxMode | str) -> tuple[SandboxMode, str]:
    """The mode to run under, and a warning to log when it is not the one asked for (bwrap missing)."""
    mode = SandboxMode(requested)
    if mode is SandboxMode.BWRAP:
        why = bwrap_problem()
        if why is not None:
            return SandboxMode.PROCESS, (f"sandbox.mode=bwrap is not available ({why}): untrusted code runs as "
                                         "plain processes under the limits, seeing this host's files and network")
    return mode, ""


def visible_roots() -> list[str]:
    """The interpreter's prefixes, its site-packages and the source folders of editable installs: what a Python
    program in the sandbox needs to start, each outside /usr (bound whole) and none inside another. Never the
    caller's other import paths (a test's or a script's folder, the working directory)."""
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, *site.getsitepackages()}
    for packages in site.getsitepackages():
        for finder in Path(packages).glob("__editable___*_finder.py"):
            paths.update(_editable_sources(finder))
    real = sorted({os.path.realpath(p) for p in paths if os.path.exists(p)})
    kept: list[str] = []
    for p in real:
        if p == "/usr" or p.startswith("/usr/") or any(p.startswith(k + "/") for k in kept):
            continue
        kept.append(p)
    return kept


def _editable_sources(finder: Path) -> list[str]:
    """The folders a setuptools editable-install finder maps packages to (its MAPPING)."""
    spec = importlib.util.spec_from_file_location(f"_earl_sandbox_{finder.stem}", finder)
    if spec is None or spec.loader is None:
        return []
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception:  # noqa: BLE001  (someone else's file: unreadable means nothing to bind)
        return []
    mapping = getattr(module, "MAPPING", {})
    return [str(v) for v in mapping.values()] if isinstance(mapping, dict) else []


def _bwrap_args(spec: SandboxSpec) -> list[str]:
    args = ["--die-with-parent", "--new-session", "--unshare-all", "--uid", str(NOBODY), "--gid", str(NOBODY),
            "--ro-bind", "/usr", "/usr"]
    if spec.network:
        args.append("--share-net")
    for name in ("bin", "lib", "lib32", "lib64", "libx32", "sbin"):
        top = Path("/") / name
        if top.is_symlink():
            args += ["--symlink", os.readlink(top), str(top)]
        elif top.exists():
            args += ["--ro-bind", str(top), str(top)]
    args += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]  # first: the binds below may lie in /tmp
    for path in _ETC:
        args += ["--ro-bind-try", path, path]
    for path in [*visible_roots(), *spec.read_only]:
        args += ["--ro-bind", path, path]
    for path in spec.writable:
        args += ["--bind", path, path]
    return args + ["--chdir", "/tmp"]


def sandbox_environment(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The program's environment: `base` (default: this process's) less the variables that name secrets, keys
    or tokens, with a HOME and TMPDIR of /tmp (its private one under bwrap)."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if k not in _HIDDEN_ENV}
    return {**env, "HOME": "/tmp", "TMPDIR": "/tmp"}


@dataclasses.dataclass
class Launch:
    """A sandbox made ready for one program (`prepare`): the command to start (bwrap's, or the program's), its
    working directory, environment and pre-exec hook (limits, control groups, uid), for `subprocess.Popen` or
    `asyncio.create_subprocess_exec` alike; afterwards, the limit it went past and the cleanup."""

    command: list[str]
    cwd: str | None
    env: dict[str, str]
    preexec: Callable[[], None] | None
    spec: SandboxSpec
    _groups: Groups | None
    _scratch: tempfile.TemporaryDirectory[str] | None
    killed_for: Breach | None = None

    def has_group(self, controller: str) -> bool:
        """Whether a control group of `controller` ("memory", "pids") holds the limit (else an rlimit does)."""
        return self._groups is not None and controller in self._groups.paths

    def kill(self, pid: int, why: Breach | None = None) -> None:
        """Kill everything in the sandbox: the process group of `pid` (its leader) and its control groups' tasks."""
        self.killed_for = self.killed_for or why
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self._groups is not None:
            self._groups.kill()

    def allow_cpu(self, seconds: float) -> None:
        """Move the CPU limit of every process in the sandbox to what it has used plus `seconds` (a sandbox reused
        for another run gets that run's budget); needs its control groups to find them (else nothing moves)."""
        for pid in self._groups.pids() if self._groups is not None else []:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                used = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
                soft = max(1, int(used + seconds + 0.999))
                resource.prlimit(pid, resource.RLIMIT_CPU, (soft, soft + 1))
            except (OSError, ValueError, IndexError):
                continue  # (gone meanwhile)

    def breach(self, returncode: int | None) -> Breach | None:
        """The limit the program went past, once it ended with `returncode` (None: none, as far as can be told)."""
        if self.killed_for is not None:
            return self.killed_for
        if returncode in (-signal.SIGXCPU, 128 + signal.SIGXCPU):  # (the kernel's signal: the surest evidence)
            return Breach.CPU
        return self._groups.breach() if self._groups is not None else None

    def cleanup(self) -> None:
        """After the program ended: free its control groups and scratch folder."""
        if self._groups is not None:
            self._groups.remove()
        if self._scratch is not None:
            self._scratch.cleanup()


def prepare(argv: Sequence[str], spec: SandboxSpec, *, env: Mapping[str, str] | None = None) -> Launch:
    """Make a sandbox of `spec.mode` ready for `argv` (`resolve_mode` first, to fall back from a missing bwrap)."""
    limits = spec.limits
    groups = None if spec.mode is SandboxMode.NONE else Groups(limits.memory_bytes, limits.processes)
    scratch = None
    command, cwd = list(argv), None
    if spec.mode is SandboxMode.BWRAP:
        path = shutil.which("bwrap")
        if path is None:
            raise FileNotFoundError("bwrap is not installed: call resolve_mode first")
        command = [path, *_bwrap_args(spec), "--", *argv]
    elif spec.mode is SandboxMode.PROCESS:
        scratch = tempfile.TemporaryDirectory(prefix="earl-sandbox-")
        os.chmod(scratch.name, 0o777)
        cwd = scratch.name
    environment = dict(env) if env is not None else sandbox_environment()
    if scratch is not None:
        environment.update(HOME=scratch.name, TMPDIR=scratch.name)
    preexec = None if spec.mode is SandboxMode.NONE else _limiter(argv, spec, groups)
    return Launch(command, cwd, environment, preexec, spec, groups, scratch)


@dataclasses.dataclass
class Sandboxed:
    """A program started in a sandbox (`start`)."""

    proc: subprocess.Popen[bytes]
    launch: Launch
    started: float

    @property
    def mode(self) -> SandboxMode:
        return self.launch.spec.mode

    def kill(self, why: Breach | None = None) -> None:
        self.launch.kill(self.proc.pid, why)

    def breach(self) -> Breach | None:
        return self.launch.breach(self.proc.returncode)

    def close(self) -> None:
        """After the program ended: kill what is left of it and free its control groups and scratch folder."""
        self.kill()
        self.proc.wait()
        self.launch.cleanup()


def start(argv: Sequence[str], spec: SandboxSpec, *, env: Mapping[str, str] | None = None,
          pass_fds: Sequence[int] = (), stdin: int | None = None, stdout: int | None = None,
          stderr: int | None = None) -> Sandboxed:
    """Start `argv` in a sandbox of `spec.mode` (`resolve_mode` first to fall back from a missing bwrap)."""
    launch = prepare(argv, spec, env=env)
    proc = subprocess.Popen(launch.command, env=launch.env, cwd=launch.cwd, pass_fds=tuple(pass_fds), stdin=stdin,
                            stdout=stdout, stderr=stderr, preexec_fn=launch.preexec,
                            start_new_session=spec.mode is SandboxMode.NONE)
    return Sandboxed(proc, launch, time.monotonic())


def _limiter(argv: Sequence[str], spec: SandboxSpec, groups: Groups | None) -> Callable[[], None]:
    limits, files = spec.limits, groups.procs_files() if groups is not None else []
    has_memory_group = groups is not None and "memory" in groups.paths
    drop = spec.mode is SandboxMode.PROCESS and os.geteuid() == 0 and others_can_run(argv[0])
    no_pids_group = groups is None or "pids" not in groups.paths
    cpu = max(1, int(limits.cpu_seconds + 0.999))

    def limit() -> None:  # in the child, between fork and exec: no locks, no imports
        os.setsid()
        for path in files:
            with open(path, "w") as f:
                f.write(str(os.getpid()))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if not has_memory_group:
            resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
        if drop:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
        if no_pids_group and (drop or os.geteuid() != 0):  # (root is not bound by it)
            resource.setrlimit(resource.RLIMIT_NPROC, (limits.processes, limits.processes))

    return limit


def others_can_run(program: str) -> bool:
    """Whether a user other than the owner may run `program` (and reach the interpreter's prefixes): the
    `process` mode drops to uid 65534 only then (an interpreter under root's 0700 home cannot be run by it)."""
    found = shutil.which(program)
    if found is None:
        return False
    same = os.path.realpath(found) == os.path.realpath(sys.executable)
    targets = [found, sys.prefix, sys.base_prefix] if same else [found]
    for target in targets:
        path = Path(os.path.realpath(target))
        for part in [path, *path.parents]:
            mode = part.stat().st_mode
            if not mode & 0o001:  # others may not traverse (or run) it
                return False
    return True


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    returncode: int
    stdout: bytes
    stderr: bytes
    breach: Breach | None
    seconds: float
    mode: SandboxMode


def run(argv: Sequence[str], spec: SandboxSpec, *, env: Mapping[str, str] | None = None,
        input: bytes | None = None) -> SandboxResult:
    """Run `argv` to its end in a sandbox (killed at `spec.limits.wall_seconds`); its output, exit code and the
    limit it went past, if any."""
    box = start(argv, spec, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = box.proc.communicate(input, timeout=spec.limits.wall_seconds)
    except subprocess.TimeoutExpired:
        box.kill(Breach.WALL)
        out, err = box.proc.communicate()
    except BaseException:
        box.close()
        raise
    seconds, breach = time.monotonic() - box.started, box.breach()  # (its control groups are gone after close)
    if breach is None and box.proc.returncode != 0 and not box.launch.has_group("memory") and b"MemoryError" in err[-4096:]:
        breach = Breach.MEMORY  # under RLIMIT_AS a Python program's allocation fails and it says so
    box.close()
    return SandboxResult(box.proc.returncode, out, err, breach, seconds, box.mode)
