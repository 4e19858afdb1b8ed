"""Hostile programs in the sandbox: each tries to read the run's secret, keys and checkpoints, open a
socket to a server of the host, fork without bound, allocate without bound and spin for ever. Under bwrap every
attempt fails or ends the program with the limit named; `process` (the fallback) keeps the limits and the secret's
file mode, and is documented to see the host's files and network."""

from __future__ import annotations

import os
import socket
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from earl_stream.errors import ConfigError
from earl_stream.sandbox import Breach, Limits, SandboxMode, SandboxSpec, bwrap_problem, cgroups, resolve_mode, run
from earl_stream.sandbox.cgroups import control_groups
from earl_stream.sandbox.launch import others_can_run

BWRAP = pytest.mark.skipif(bwrap_problem() is not None, reason=f"no bwrap here: {bwrap_problem()}")
ROOT = os.geteuid() == 0
MIB = 1 << 20


def python(code: str, spec: SandboxSpec) -> tuple[int, str, str, Breach | None]:
    result = run([sys.executable, "-c", textwrap.dedent(code)], spec)
    return result.returncode, result.stdout.decode(), result.stderr.decode(), result.breach


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A run directory as `up` writes it: the cluster secret (0600), role keys and a checkpoint."""
    run = tmp_path / "run"
    (run / "keys").mkdir(parents=True)
    (run / "checkpoints" / "step_4").mkdir(parents=True)
    secret = run / "secret"
    secret.write_text("s3cr3t")
    secret.chmod(0o600)
    (run / "keys" / "operator.key").write_text("operator-key")
    (run / "keys" / "operator.key").chmod(0o600)
    (run / "checkpoints" / "step_4" / "model.safetensors").write_bytes(b"weights")
    return run


SNOOP = """
import sys
found = []
for path in sys.argv[1:]:
    try:
        with open(path) as f:
            found.append(f"{path}={f.read()}")
    except OSError as exc:
        found.append(f"{path}:{type(exc).__name__}")
print("\\n".join(found))
"""


@BWRAP
def test_bwrap_sees_no_run_directory_home_or_repository(run_dir: Path) -> None:
    targets = [run_dir / "secret", run_dir / "keys" / "operator.key",
               run_dir / "checkpoints" / "step_4" / "model.safetensors", Path(__file__), Path.home() / ".bashrc"]
    result = run([sys.executable, "-c", SNOOP, *map(str, targets)], SandboxSpec(mode=SandboxMode.BWRAP))
    lines = result.stdout.decode().splitlines()
    assert result.returncode == 0, result.stderr.decode()
    assert len(lines) == len(targets) and all(line.endswith(":FileNotFoundError") for line in lines), lines
    # the program still runs Python with the installed packages (earl_stream among them) and its own /tmp
    code, out, err, _ = python("import earl_stream, os, tempfile; tempfile.mkstemp(); print(os.getuid(), os.getcwd())",
                               SandboxSpec(mode=SandboxMode.BWRAP))
    assert (code, out.split()) == (0, ["65534", "/tmp"]), err


@BWRAP
def test_bwrap_read_only_paths_are_visible_and_not_writable(tmp_path: Path) -> None:
    shared = tmp_path / "env_files"
    shared.mkdir()
    (shared / "task.txt").write_text("the task")
    code, out, _, _ = python(f"""
        print(open({str(shared / 'task.txt')!r}).read())
        try:
            open({str(shared / 'new.txt')!r}, "w")
        except OSError as exc:
            print(type(exc).__name__)
    """, SandboxSpec(mode=SandboxMode.BWRAP, read_only=(str(shared),)))
    assert code == 0 and out.split("\n")[:2] == ["the task", "OSError"], out
    assert not (shared / "new.txt").exists()


@pytest.mark.skipif(not ROOT, reason="the process mode changes uid only where the caller is root")
def test_process_mode_cannot_read_the_secret_when_others_can_run_python(run_dir: Path) -> None:
    if not others_can_run(sys.executable):
        pytest.skip(f"uid 65534 cannot run {sys.executable} (its prefix is not world-traversable)")
    result = run([sys.executable, "-c", SNOOP, str(run_dir / "secret")], SandboxSpec(mode=SandboxMode.PROCESS))
    assert result.stdout.decode().strip().endswith(":PermissionError")


@pytest.fixture
def host_server() -> Iterator[tuple[str, int]]:
    """A TCP server of this host (as the supervisor's control port would be), on every interface."""
    server = socket.create_server(("0.0.0.0", 0))
    accepted: list[bool] = []

    def serve() -> None:
        server.settimeout(20)
        try:
            conn, _ = server.accept()
            accepted.append(True)
            conn.close()
        except OSError:
            pass

    threading.Thread(target=serve, daemon=True).start()
    yield ("127.0.0.1", server.getsockname()[1])
    server.close()


CONNECT = """
import socket, sys
for host in sys.argv[1:-1]:
    try:
        socket.create_connection((host, int(sys.argv[-1])), timeout=3).close()
        print(host, "connected")
    except OSError as exc:
        print(host, type(exc).__name__)
"""


def _host_address() -> str:
    """An address of this host other than loopback (the interface a neighbour would reach)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET: no packet is sent
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


@BWRAP
def test_bwrap_has_no_network_unless_the_spec_names_one(host_server: tuple[str, int]) -> None:
    _, port = host_server
    hosts = ["127.0.0.1", _host_address(), "8.8.8.8"]
    result = run([sys.executable, "-c", CONNECT, *hosts, str(port)], SandboxSpec(mode=SandboxMode.BWRAP))
    lines = result.stdout.decode().splitlines()
    assert len(lines) == 3 and not any(line.endswith("connected") for line in lines), lines
    shared = run([sys.executable, "-c", CONNECT, "127.0.0.1", str(port)],
                 SandboxSpec(mode=SandboxMode.BWRAP, network=(f"127.0.0.1:{port}",)))
    assert shared.stdout.decode().strip() == "127.0.0.1 connected"


MODES = [pytest.param(SandboxMode.BWRAP, marks=BWRAP), SandboxMode.PROCESS]


@pytest.mark.parametrize("mode", MODES)
def test_spinning_for_ever_ends_at_the_cpu_limit(mode: SandboxMode) -> None:
    code, _, _, breach = python("while True: pass", SandboxSpec(mode=mode, limits=Limits(cpu_seconds=1, wall_seconds=60)))
    assert code != 0 and breach is Breach.CPU


@pytest.mark.parametrize("mode", MODES)
def test_sleeping_for_ever_ends_at_the_wall_limit(mode: SandboxMode) -> None:
    result = run([sys.executable, "-c", "import time; time.sleep(600)"],
                 SandboxSpec(mode=mode, limits=Limits(wall_seconds=1.5)))
    assert result.breach is Breach.WALL and result.seconds < 30


@pytest.mark.parametrize("mode", MODES)
def test_allocating_without_bound_ends_at_the_memory_limit(mode: SandboxMode) -> None:
    code, _, err, breach = python("""
        chunks = []
        while True:
            chunks.append(bytearray(16 << 20))
    """, SandboxSpec(mode=mode, limits=Limits(memory_bytes=256 * MIB)))
    assert code != 0 and breach is Breach.MEMORY, (code, err[-300:])


@pytest.mark.parametrize("mode", MODES)
def test_without_control_groups_rlimits_hold_memory(mode: SandboxMode, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cgroups, "ROOT", tmp_path / "no-cgroups")  # a host where none can be made
    assert control_groups() == frozenset()
    code, _, err, breach = python("""
        chunks = []
        while True:
            chunks.append(bytearray(16 << 20))
    """, SandboxSpec(mode=mode, limits=Limits(memory_bytes=512 * MIB)))
    assert code != 0 and breach is Breach.MEMORY and "MemoryError" in err, (code, err[-300:])


@pytest.mark.parametrize("mode", MODES)
def test_a_fork_bomb_is_held_at_the_process_limit(mode: SandboxMode) -> None:
    code, out, err, breach = python("""
        import os, time
        children = 0
        try:
            for _ in range(1000):
                if os.fork() == 0:
                    time.sleep(5)
                    os._exit(0)
                children += 1
        except OSError as exc:
            print("refused after", children, type(exc).__name__)
    """, SandboxSpec(mode=mode, limits=Limits(processes=16, wall_seconds=20)))
    assert "refused after" in out, (code, out, err[-300:])
    assert int(out.split()[2]) < 16
    if "pids" in control_groups():  # (RLIMIT_NPROC refuses the fork without counting it)
        assert breach is Breach.PROCESSES


def test_process_mode_keeps_secrets_out_of_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EARL_STREAM_SECRET_FILE", "/run/secret")
    monkeypatch.setenv("HF_TOKEN", "hf_x")
    code, out, _, _ = python("import os; print([k for k in ('EARL_STREAM_SECRET_FILE', 'HF_TOKEN') if k in os.environ])",
                             SandboxSpec(mode=SandboxMode.PROCESS))
    assert (code, out.strip()) == (0, "[]")


def test_bad_specs_and_the_fallback_are_said() -> None:
    with pytest.raises(ConfigError, match="choose one of"):
        SandboxSpec(mode="docker")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="host:port"):
        SandboxSpec(network=("example.com",))
    with pytest.raises(ConfigError, match="must be > 0"):
        Limits(cpu_seconds=0)
    mode, warning = resolve_mode("bwrap")
    if bwrap_problem() is None:
        assert (mode, warning) == (SandboxMode.BWRAP, "")
    else:
        assert mode is SandboxMode.PROCESS and "not available" in warning

