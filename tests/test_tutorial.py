"""docs/TUTORIAL.md as a reader runs it: every fenced bash block, in order, in an empty directory.

Python blocks with `title="FILE"` are saved to FILE first, as the tutorial asks. Blocks that keep
running (`earl-stream up`, `prometheus`) start in the background, as in a terminal of their own; every
other block runs to completion under `bash -euo pipefail` and must succeed. The ports 5555 and 9090
become free ones. A block whose point is what it shows (a finished episode, a scraped metric, episodes
of the attached environment) is run again until it shows it, as a reader would. The Prometheus blocks
need the `prometheus` binary (`bash scripts/install-prometheus.sh`) and skip without it.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from cluster import wait_for
from test_newcomer import stop_group, terminal_env

from earl_stream import protocol as P
from earl_stream.security.secret import load_secret

pytestmark = pytest.mark.slow

TUTORIAL = Path(__file__).resolve().parents[1] / "docs" / "TUTORIAL.md"
FENCE = re.compile(r"^```(\w+)([^\n]*)\n(.*?)^```[ \t]*$", re.M | re.S)
LONG_RUNNING = ("earl-stream up ", "prometheus ")
# what a block is there to show; it is run again until it does
SHOWS: dict[str, re.Pattern[str]] = {
    "episodes tail": re.compile(r"^=== ", re.M),
    "api/v1/query": re.compile(r'"__name__":"earl_policy_version"'),
    "env list": re.compile(r"^countdown\s+attached\s+weight \S+\s+episodes [1-9]", re.M),
}


@dataclass(frozen=True)
class Block:
    lang: str
    title: str
    text: str

    @property
    def prometheus(self) -> bool:
        """Part of the Prometheus section: writes its config, runs it, or queries it."""
        return "9090" in self.text or "prometheus.yml" in self.text


def parse(markdown: str) -> list[Block]:
    blocks = []
    for lang, info, text in FENCE.findall(markdown):
        title = re.search(r'title="([^"]+)"', info)
        blocks.append(Block(lang, title.group(1) if title else "", text))
    return blocks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Reader:
    """A reader's directory and terminals."""

    cwd: Path
    ports: dict[str, str]
    background: list[subprocess.Popen] = field(default_factory=list)
    ran: list[str] = field(default_factory=list)

    def command(self, block: Block) -> str:
        text = block.text
        for old, new in self.ports.items():
            text = text.replace(old, new)
        return text

    def start(self, block: Block) -> subprocess.Popen:
        """A terminal of its own for a command that keeps running."""
        log = open(self.cwd / f"terminal-{len(self.background)}.log", "wb")
        proc = subprocess.Popen(["bash", "-c", self.command(block)], cwd=self.cwd, env=terminal_env(), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        self.background.append(proc)
        self.ran.append(block.text)
        return proc

    def run(self, block: Block, timeout: float = 120) -> str:
        """Run to completion (again, until it shows what it is there to show); returns its output."""
        key = next((k for k in SHOWS if k in block.text), None)
        shows = SHOWS[key] if key else None
        deadline = time.monotonic() + timeout
        command = self.command(block)
        while True:
            res = subprocess.run(["bash", "-euo", "pipefail", "-c", command], cwd=self.cwd,
                                 env=terminal_env(), capture_output=True, text=True, timeout=timeout)
            # again: only the lines that show it (a block's other commands, e.g. `env attach`, ran once)
            command = "\n".join(line for line in self.command(block).splitlines() if key and key in line)
            assert res.returncode == 0, f"{block.text}\nexit {res.returncode}\n{res.stdout[-2000:]}{res.stderr[-3000:]}"
            if shows is None or shows.search(res.stdout):
                self.ran.append(block.text)
                return res.stdout
            assert time.monotonic() < deadline, f"{block.text} never showed {shows.pattern}:\n{res.stdout[-2000:]}"
            time.sleep(2)

    def save(self, block: Block) -> None:
        (self.cwd / block.title).write_text(block.text)
        self.ran.append(block.text)

    def alive(self) -> None:
        for i, proc in enumerate(self.background):
            log = (self.cwd / f"terminal-{i}.log").read_text(errors="replace")
            assert proc.poll() is None, f"a long-running tutorial command exited:\n{log[-3000:]}"


def _policy_version(cwd: Path, address: str) -> int:
    client = P.ControlClient(address, timeout_s=5, secret=load_secret(str(cwd / "runs" / "latest" / "secret")))
    try:
        return int(json.loads(client.call(P.StatusRequest()).status_json)["policy_version"])
    finally:
        client.close()


def _wait_for_the_supervisor(r: Reader) -> None:
    address = f"tcp://127.0.0.1:{r.ports['5555']}"

    def answers() -> bool:
        r.alive()
        return (r.cwd / "runs" / "latest" / "supervisor.json").exists() and _policy_version(r.cwd, address) >= 0

    wait_for(answers, 120, "the tutorial's run to start")


def _wait_for_prometheus(r: Reader) -> None:
    ready = f"http://127.0.0.1:{r.ports['9090']}/-/ready"

    def answers() -> bool:
        r.alive()
        try:
            with urllib.request.urlopen(ready, timeout=2) as resp:
                return resp.status == 200
        except OSError:
            return False

    wait_for(answers, 60, "prometheus to start")


def _blocks() -> list[Block]:
    return parse(TUTORIAL.read_text())


@pytest.fixture(scope="module")
def reader(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Reader]:
    """Everything up to and including `earl-stream up`, which then runs until the module is done."""
    r = Reader(tmp_path_factory.mktemp("tutorial"), {"5555": str(_free_port()), "9090": str(_free_port())})
    try:
        for block in _blocks():
            if block.lang == "python" and block.title:
                r.save(block)
            elif block.lang == "bash" and block.text.startswith("earl-stream up "):
                r.start(block)
                _wait_for_the_supervisor(r)
                break
            elif block.lang == "bash":
                r.run(block)
        yield r
    finally:
        for proc in reversed(r.background):
            stop_group(proc, signal.SIGINT)


def test_the_tutorial_runs_as_written(reader: Reader) -> None:
    blocks = [b for b in _blocks() if b.lang == "bash"]
    assert any(b.text.startswith("earl-stream up ") for b in blocks), "the tutorial starts no run"
    for block in blocks:
        if block.text not in reader.ran and not block.prometheus:
            reader.alive()
            reader.run(block)
    reader.alive()
    assert "earl-stream env attach my_envs.py:CountDown" in "".join(reader.ran)


def test_the_tutorials_prometheus_part(reader: Reader) -> None:
    if shutil.which("prometheus") is None:
        pytest.skip("the prometheus server is not installed (Debian: `bash scripts/install-prometheus.sh` as root)")
    blocks = [b for b in _blocks() if b.lang == "bash" and b.prometheus]
    assert len(blocks) == 3, [b.text[:40] for b in blocks]
    for block in blocks:
        reader.alive()
        if block.text.startswith(LONG_RUNNING):
            reader.start(block)
            if block.text.startswith("prometheus "):
                _wait_for_prometheus(reader)
        else:
            reader.run(block)


def test_every_bash_block_is_run_or_started_by_these_tests() -> None:
    """What the two tests above run covers the tutorial: a block this harness does not know fails here."""
    for block in _blocks():
        assert block.lang in ("bash", "python"), f"a {block.lang} block: run it in tests/test_tutorial.py"
        if block.lang == "python":
            assert block.title, "a python block the reader is not told to save"
        elif block.text.startswith(LONG_RUNNING):
            assert len(block.text.strip().splitlines()) == 1, "a long-running block must be one command"
