"""The newcomer path: every command a run prints works when pasted, and a refusal for the cluster
secret says what to pass and where the run's secret is.

The end-to-end test starts `earl-stream up` the way a user does (no secret in the environment, the
default run directory `runs/latest` under the working directory), pastes the worker commands it
prints, and sees the rollout pool grow.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cluster import wait_for

from earl_stream.cli.up import worker_commands
from earl_stream.security.secret import (
    SECRET_ENV,
    create_secret_file,
    find_run_secret,
    is_secret_refusal,
    same_supervisor,
    secret_refusal_hint,
    use_secret,
)


def _run_dir(root: Path, name: str, address: str, *, secret: bool = True) -> Path:
    run = root / "runs" / name
    run.mkdir(parents=True)
    (run / "supervisor.json").write_text(json.dumps({"address": address, "metrics_address": "127.0.0.1:1"}))
    if secret:
        create_secret_file(run / "secret")
    return run


def test_a_run_is_found_by_the_address_its_ready_file_records(tmp_path: Path) -> None:
    run = _run_dir(tmp_path, "latest", "tcp://127.0.0.1:5601")
    _run_dir(tmp_path, "other", "tcp://127.0.0.1:5602")
    for typed in ("tcp://127.0.0.1:5601", "127.0.0.1:5601", "localhost:5601"):
        found = find_run_secret(typed, tmp_path)
        assert found is not None and found.secret_file == run.resolve() / "secret", typed
    assert find_run_secret("tcp://127.0.0.1:5603", tmp_path) is None
    assert find_run_secret("tcp://127.0.0.1:5601", tmp_path / "runs") is None  # only here and in runs/*/


def test_a_run_without_a_secret_file_is_not_used_and_the_newest_run_wins(tmp_path: Path) -> None:
    _run_dir(tmp_path, "nosecret", "tcp://127.0.0.1:5611", secret=False)
    assert find_run_secret("tcp://127.0.0.1:5611", tmp_path) is None
    old = _run_dir(tmp_path, "old", "tcp://127.0.0.1:5612")
    new = _run_dir(tmp_path, "new", "tcp://127.0.0.1:5612")  # a later run on a reused port
    os.utime(old / "supervisor.json", (time.time() - 60, time.time() - 60))
    found = find_run_secret("tcp://127.0.0.1:5612", tmp_path)
    assert found is not None and found.run_dir == new.resolve()


def test_a_supervisor_on_every_interface_matches_this_hosts_addresses() -> None:
    assert same_supervisor("tcp://0.0.0.0:5555", "tcp://127.0.0.1:5555")
    assert same_supervisor("tcp://0.0.0.0:5555", "localhost:5555")
    assert not same_supervisor("tcp://0.0.0.0:5555", "tcp://127.0.0.1:5556")
    assert not same_supervisor("tcp://127.0.0.1:5555", "tcp://192.0.2.1:5555")  # TEST-NET: never this host
    assert not same_supervisor("garbage", "tcp://127.0.0.1:5555")


def test_a_flag_or_the_variable_wins_over_the_run_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = _run_dir(tmp_path, "latest", "tcp://127.0.0.1:5621")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(SECRET_ENV, raising=False)
    found = use_secret(None, "tcp://127.0.0.1:5621")
    assert found is not None and os.environ[SECRET_ENV] == str(run.resolve() / "secret")
    monkeypatch.setenv(SECRET_ENV, "/elsewhere/secret")
    assert use_secret(None, "tcp://127.0.0.1:5621") is None and os.environ[SECRET_ENV] == "/elsewhere/secret"
    assert use_secret("given", "tcp://127.0.0.1:5621") is None
    assert os.environ[SECRET_ENV] == str(tmp_path / "given")
    monkeypatch.delenv(SECRET_ENV)
    assert use_secret(None, "tcp://127.0.0.1:5699") is None and SECRET_ENV not in os.environ


def test_a_refusal_says_what_to_pass_and_where_the_secret_is(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = _run_dir(tmp_path, "latest", "tcp://127.0.0.1:5631")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(SECRET_ENV, raising=False)
    assert is_secret_refusal("supervisor refused Register: authentication failed")
    assert is_secret_refusal("the reply from tcp://x:1 is not signed with our cluster secret")
    assert not is_secret_refusal("cluster secret file /x does not exist")
    hint = secret_refusal_hint("tcp://127.0.0.1:5631")
    assert "no cluster secret was given" in hint and str(run.resolve() / "secret") in hint
    assert "--secret-file" in hint and SECRET_ENV in hint
    monkeypatch.setenv(SECRET_ENV, str(create_secret_file(tmp_path / "stale")))
    hint = secret_refusal_hint("tcp://127.0.0.1:5631")
    assert f"the secret in {tmp_path / 'stale'} is not this run's" in hint and str(run.resolve() / "secret") in hint
    hint = secret_refusal_hint("tcp://127.0.0.1:5632")  # no run here: say where `up` keeps one
    assert "runs/latest/secret" in hint and "--secret-file" in hint


def test_creating_a_secret_never_writes_through_a_link(tmp_path: Path) -> None:
    given = create_secret_file(tmp_path / "given")
    before = given.read_text()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "secret").symlink_to(given)
    create_secret_file(tmp_path / "run" / "secret")
    assert given.read_text() == before and not (tmp_path / "run" / "secret").is_symlink()
    assert (tmp_path / "run" / "secret").stat().st_mode & 0o777 == 0o600


def test_up_prints_a_command_for_here_and_one_for_anywhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = _run_dir(tmp_path, "latest", "tcp://127.0.0.1:5641")
    monkeypatch.chdir(tmp_path)
    here, anywhere, note = worker_commands("tcp://127.0.0.1:5641", str(run / "keys" / "worker"))
    assert here.endswith(": earl-stream worker --role rollout --supervisor tcp://127.0.0.1:5641")
    # the worker key, never the cluster secret (security/keys.py)
    assert anywhere.endswith(f"--supervisor tcp://127.0.0.1:5641 --secret-file {run.resolve() / 'keys' / 'worker'}")
    assert "loopback" in note and "worker key" in note and "never the cluster secret" in note
    # a run directory this directory does not hold: both commands carry the key file
    here, _, _ = worker_commands("tcp://127.0.0.1:5642", "/somewhere/keys/worker")
    assert here.endswith("--secret-file /somewhere/keys/worker")
    _, anywhere, note = worker_commands("tcp://0.0.0.0:5643", "/somewhere/keys/worker")
    assert "tcp://0.0.0.0" not in anywhere and "--advertise" in note


ROOT = Path(__file__).resolve().parents[1]

CONFIG_SECTIONS = ("trainer", "rollout", "store", "supervisor", "selector", "model", "envs", "sandbox")
FILE_SUFFIXES = ("py", "md", "json", "jsonl", "state", "yml", "png")


def _code_references(markdown: str) -> list[tuple[str, str]]:
    """(file or module, name) pairs a page cites: `path/to/x.py`, `x.py: Name.attr`, `module.name`."""
    refs = [(f, n) for f, n in re.findall(r"`([\w/]+\.py)(?:: ([\w.]+))?`", markdown)]
    for module, name in re.findall(r"`(\w+)\.([A-Za-z_][\w.]*)`", markdown):
        if module in CONFIG_SECTIONS or name in FILE_SUFFIXES:
            continue
        refs.append((module if module[0].isupper() else f"{module}.py", name))  # a class: `Class.method`
    return refs


def test_the_architecture_page_names_code_that_exists() -> None:
    """docs/ARCHITECTURE.md names modules and functions; a rename that leaves it behind fails here."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    package = ROOT / "earl_stream"
    refs = _code_references(text)
    assert len(refs) > 30
    stale = []
    for file, name in refs:
        if not file.endswith(".py"):  # a class: the files that define it
            found = [p for p in package.rglob("*.py") if re.search(rf"^class {file}\b", p.read_text(), re.M)]
        else:
            found = [p for p in [package / file, ROOT / file] if p.is_file()] or sorted(package.rglob(Path(file).name))
        if not found:
            stale.append(file)
            continue
        last = name.split(".")[-1] if name else ""
        if last and not any(re.search(rf"(def|class) {re.escape(last)}\b|^{re.escape(last)} =|^    {re.escape(last)}: ",
                                      p.read_text(), re.M)  # a function, a class, a constant, a class's field
                            for p in found):
            stale.append(f"{file}: {name}")
    assert not stale, f"docs/ARCHITECTURE.md names what the code no longer has: {stale}"


# ---- end to end: `earl-stream up`, then paste what it prints ----------------------------------------

def terminal_env() -> dict[str, str]:
    """The environment of a new terminal: no secret set, the project's `earl-stream` on PATH."""
    env = {k: v for k, v in os.environ.items() if k != SECRET_ENV}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def _paste(command: str, cwd: Path, log: Path, **env: str) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen(command, shell=True, cwd=cwd, env={**terminal_env(), **env}, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def _run(command: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(command, shell=True, cwd=cwd, env={**terminal_env(), **env}, capture_output=True, text=True,
                          timeout=60)


def _rollout_workers(cwd: Path, address: str) -> int:
    res = _run(f"earl-stream status --supervisor {address} --json", cwd)
    if res.returncode != 0:
        return -1
    return sum(w["role"] == "rollout" and w["alive"] for w in json.loads(res.stdout)["workers"])


def stop_group(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.live
@pytest.mark.slow
def test_the_printed_worker_commands_work_when_pasted(tmp_path: Path, tiny_model_dir: Path) -> None:
    """`up` with no rollout worker of its own: each pasted command adds one to an empty pool."""
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    project.mkdir()
    elsewhere.mkdir()
    up = _paste(f"earl-stream up model.path={tiny_model_dir} rollout.workers=0 trainer.groups_per_step=2 "
                "trainer.group_size=4 rollout.groups_in_flight=2 supervisor.heartbeat_s=0.2", project, tmp_path / "up.log")
    pasted: list[subprocess.Popen] = []
    try:
        def printed() -> tuple[str, str] | None:
            text = (tmp_path / "up.log").read_text()
            assert up.poll() is None, text[-3000:]
            here = re.search(r"add a rollout worker from this directory with: (.+)$", text, re.M)
            anywhere = re.search(r"^from another directory or host: (.+)$", text, re.M)
            return (here.group(1), anywhere.group(1)) if here and anywhere else None

        here, anywhere = wait_for(printed, 120, "up to print the worker commands")
        address = here.split("--supervisor ")[1].split()[0]
        secret = project.resolve() / "runs" / "latest" / "secret"
        worker_key = secret.parent / "keys" / "worker"
        assert "--secret-file" not in here and anywhere == f"{here} --secret-file {worker_key}"
        assert _rollout_workers(project, address) == 0

        # a second terminal in the same directory, and a terminal somewhere else (both start at once)
        pasted.append(_paste(here, project, tmp_path / "here.log"))
        pasted.append(_paste(anywhere, elsewhere, tmp_path / "anywhere.log"))
        wait_for(lambda: _rollout_workers(project, address) == 2, 180, "both pasted workers to join")
        # a worker says it is ready just after the supervisor has counted it: wait for both lines
        wait_for(lambda: all(re.search(r"rollout-\d+ ready: shards at", (tmp_path / log).read_text())
                             for log in ("here.log", "anywhere.log")), 60, "both pasted workers to say they are ready")
        assert f"using the worker key of the run in {secret.parent}" in (tmp_path / "here.log").read_text()

        # the other commands of a run need no flag in its directory either
        listed = _run(f"earl-stream env list --supervisor {address}", project)
        assert listed.returncode == 0 and "tictactoe" in listed.stdout, listed.stderr[-2000:]
        wait_for(lambda: "=== " in _run(f"earl-stream episodes tail --last 1 --supervisor {address}", project).stdout,
                 120, "a finished episode through `episodes tail`")

        # refusals say what to pass and where the secret is
        missing = _run(f"earl-stream status --supervisor {address}", elsewhere)
        assert missing.returncode == 2 and "Traceback" not in missing.stderr
        assert "no cluster secret was given" in missing.stderr
        assert "--secret-file" in missing.stderr and SECRET_ENV in missing.stderr
        wrong = _run(f"earl-stream status --supervisor {address}", project,
                     **{SECRET_ENV: str(create_secret_file(tmp_path / "stale"))})
        assert wrong.returncode == 2 and f"this run keeps its secret in {secret}" in wrong.stderr, wrong.stderr
    finally:
        for proc in pasted:
            stop_group(proc)
        stop_group(up, signal.SIGINT)


def test_version_is_one_number_everywhere() -> None:
    """`earl-stream --version`, `earl_stream.__version__`, pyproject.toml and CHANGELOG.md's newest entry agree."""
    import earl_stream

    root = Path(__file__).resolve().parents[1]
    found = re.search(r'^version = "([^"]+)"', (root / "pyproject.toml").read_text(), re.M)
    assert found
    declared = found.group(1)
    assert earl_stream.__version__ == declared
    shown = subprocess.run([sys.executable, "-m", "earl_stream", "--version"], capture_output=True, text=True, check=True)
    assert shown.stdout.strip() == f"earl-stream {declared}"
    newest = re.search(r"^## \[?(\d+\.\d+\.\d+)", (root / "CHANGELOG.md").read_text(), re.M)
    assert newest and newest.group(1) == declared
    cff = (root / "CITATION.cff").read_text()
    assert f"version: {declared}" in cff


def test_the_readme_diagram_fits_100_columns() -> None:
    """The README's first screen: its architecture diagram (its first code block) reads in a 100-column terminal."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    diagram = readme.split("```\n", 2)[1]
    assert "supervisor" in diagram and "trainer pool" in diagram
    assert max(len(line) for line in diagram.splitlines()) <= 100
