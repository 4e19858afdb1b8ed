"""Several hosts for real: the supervisor, a rollout worker and a trainer each in its own network
namespace (its own address on a bridge, its own /dev/shm), started with `--bind` / `--advertise`, train
a few steps across the network. Needs root (ip netns, mount); skips with the reason otherwise.

Layout, made here and removed in `finally` (names unique per run):

    hub namespace: bridge br0 <- veth -> ns0 10.231.0.1 (supervisor)
                              <- veth -> ns1 10.231.0.2 (rollout worker)
                              <- veth -> ns2 10.231.0.3 (trainer)
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cluster import Cluster, wait_for

pytestmark = pytest.mark.slow

SUBNET = "10.231.0"
ROLES = ("supervisor", "rollout", "trainer")
# each process gets a private /dev/shm, as on separate hosts, so the store cannot use shared memory
PRIVATE_SHM = ["sh", "-c", 'mount -t tmpfs -o size=512m tmpfs /dev/shm && exec "$@"', "sh"]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


class Hosts:
    """Three namespaces on one bridge; `prefix(i)` runs a command on host i."""

    def __init__(self) -> None:
        tag = f"{os.getpid() % 10000:04d}{secrets.token_hex(2)}"
        self.hub = f"es{tag}hub"
        self.names = [f"es{tag}n{i}" for i in range(len(ROLES))]
        self.made: list[str] = []
        self.tag = tag

    def address(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def prefix(self, i: int) -> list[str]:
        return ["ip", "netns", "exec", self.names[i], *PRIVATE_SHM]

    def create(self) -> None:
        for ns in (self.hub, *self.names):
            _ip("netns", "add", ns)
            self.made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.hub, "link", "set", "br0", "up")
        for i, ns in enumerate(self.names):
            here, there = f"v{self.tag}{i}a", f"v{self.tag}{i}b"  # <= 15 characters
            _ip("link", "add", here, "type", "veth", "peer", "name", there)
            _ip("link", "set", here, "netns", ns)
            _ip("link", "set", there, "netns", self.hub)
            _ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", here)
            _ip("-n", ns, "link", "set", here, "up")
            _ip("-n", self.hub, "link", "set", there, "master", "br0")
            _ip("-n", self.hub, "link", "set", there, "up")

    def remove(self) -> None:
        for ns in reversed(self.made):  # deleting a namespace deletes its veth ends too
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        for i in range(len(self.names)):  # a pair left here when setting up failed half-way
            subprocess.run(["ip", "link", "del", f"v{self.tag}{i}a"], capture_output=True, timeout=30)


@pytest.fixture()
def hosts() -> Iterator[Hosts]:
    if shutil.which("ip") is None:
        pytest.skip("the `ip` command (iproute2) is not installed")
    h = Hosts()
    try:
        try:
            h.create()
            subprocess.run([*h.prefix(0), "true"], check=True, capture_output=True, timeout=30)
            ping = subprocess.run(["ip", "netns", "exec", h.names[1], "ping", "-c", "1", "-W", "5", h.address(0)],
                                  capture_output=True, timeout=30)
        except (subprocess.CalledProcessError, OSError) as exc:
            err = getattr(exc, "stderr", "") or ""
            err = err.decode(errors="replace") if isinstance(err, bytes) else err
            pytest.skip(f"cannot make network namespaces here ({exc}: {err.strip()})")
        if ping.returncode not in (0, None) and shutil.which("ping") is not None:
            pytest.fail(f"namespaces made but {h.address(0)} is unreachable: {ping.stdout!r} {ping.stderr!r}")
        yield h
    finally:
        h.remove()


def _status(c: Cluster, hosts: Hosts) -> dict[str, Any]:
    """`earl-stream status --json`, run from the supervisor's host (the test's own host has no route)."""
    out = subprocess.run(["ip", "netns", "exec", hosts.names[0], sys.executable, "-m", "earl_stream", "status",
                          "--supervisor", c.address, "--json"], env=c.env, capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        return {}
    return json.loads(out.stdout)


def test_three_hosts_train_across_the_network(hosts: Hosts, tmp_path: Path, tiny_model_dir: Path) -> None:
    steps = 3
    c = Cluster(tmp_path, tiny_model_dir, f"steps={steps}")
    try:
        c.start_supervisor(host=hosts.address(0), prefix=hosts.prefix(0))
        assert c.address.startswith(f"tcp://{hosts.address(0)}:")
        c.worker("rollout", "rollout", "--advertise", hosts.address(1), prefix=hosts.prefix(1))
        trainer = c.start("trainer", "--log-level", "DEBUG", "worker", "--role", "trainer", "--supervisor", c.address,
                          "--advertise", hosts.address(2), prefix=hosts.prefix(2))
        assert trainer.wait(300) == 0, (tmp_path / "trainer.log").read_text()[-3000:]
        s = wait_for(lambda: _status(c, hosts), 60, "status from the supervisor's host")
    finally:
        c.stop()
    assert s["policy_version"] == steps and s["samples_consumed"] == steps * 2 * 4
    workers = {w["role"]: w for w in s["workers"]}
    assert workers["rollout"]["host"] == hosts.address(1) and workers["trainer"]["host"] == hosts.address(2)
    assert workers["rollout"]["shard_address"].startswith(hosts.address(1))
    assert workers["trainer"]["shard_address"].startswith(hosts.address(2))
    assert s["samples_produced"] == (s["samples_consumed"] + s["samples_lost"] + s["samples_stale"]
                                     + s["samples_in_store"] + s["samples_claimed"])
    # samples went from the rollout host to the trainer host over TCP (no shared /dev/shm between them),
    # and the rollout worker pulled the trainer's weights back across the bridge
    shard = workers["rollout"]["shard_address"]
    assert f"pulling from shard node {shard} over tcp" in (tmp_path / "trainer.log").read_text()
    # whichever version the heartbeat saw first (a fast trainer may have published several by then)
    assert re.search(r"loaded policy version [1-9]", (tmp_path / "rollout.log").read_text())
    print(f"3 namespaces: {steps} steps; produced {s['samples_produced']}, consumed {s['samples_consumed']}, "
          f"lost {s['samples_lost']}, stale {s['samples_stale']}, waiting {s['samples_in_store']}")
