"""Simulated hosts for the cluster benchmarks: network namespaces on one bridge, each link rate-limited.

`Hosts(n, rate_bits_per_s)` makes n namespaces ("hosts") with addresses 10.232.0.1.. on a bridge that
lives in a hub namespace (as tests/test_netns.py does), each host joined by a veth pair whose both
ends are limited by a token bucket (tc tbf: the host end's egress is the host's upload, the hub end's
egress its download; full duplex like a NIC), plus a fixed delay where the kernel has netem.
`enter(name)` moves the calling process into a host's namespace (call it first thing in a fresh
process: threads started later inherit it). `counters()` reads every link's byte counters,
`tcp_losses()` the hosts' TCP retransmissions (drops at a full link queue, `queue_ms` of the rate).
`missing_prerequisites()` says what this machine lacks (root, ip, tc, namespaces).

Everything made is removed by `close()` (also after a failure half-way through making it); the
caller runs it in `finally` and turns SIGINT/SIGTERM into exceptions (`raise_on_signals`). A run killed
outright (SIGKILL) leaves a state file under /run/earl-bench-hosts; the next run's `sweep_stale` removes
what it names.
"""

from __future__ import annotations

import ctypes
import json
import os
import secrets
import shutil
import signal
import subprocess
from types import FrameType

SUBNET = "10.232.0"
CLONE_NEWNET = 0x40000000
STATE_DIR = "/run/earl-bench-hosts"  # one file per live run naming its namespaces, for `sweep_stale`
_libc = ctypes.CDLL(None, use_errno=True)


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(list(args), capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: {out.stderr.strip() or out.stdout.strip()}")
    return out


def missing_prerequisites() -> list[str]:
    """What running the cluster benchmark here lacks (empty: nothing)."""
    missing = []
    if os.geteuid() != 0:
        missing.append("root (network namespaces and tc need CAP_NET_ADMIN; run as root)")
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2")):
        if shutil.which(tool) is None:
            missing.append(f"the `{tool}` command ({package}: apt-get install -y iproute2)")
    if not missing:
        probe = f"esprobe{secrets.token_hex(3)}"
        made = _run("ip", "netns", "add", probe, check=False)
        if made.returncode != 0:
            missing.append(f"`ip netns add` fails here: {made.stderr.strip()}")
        else:
            _run("ip", "netns", "del", probe, check=False)
    return missing


def sweep_stale() -> list[str]:
    """Remove the namespaces of earlier runs that were killed outright (SIGKILL: no `finally` ran);
    returns their names. A run's state file names its namespaces; its pid tells whether it still runs."""
    removed: list[str] = []
    if not os.path.isdir(STATE_DIR):
        return removed
    for entry in os.listdir(STATE_DIR):
        path = os.path.join(STATE_DIR, entry)
        pid = int(entry.split(".")[0]) if entry.split(".")[0].isdigit() else -1
        if pid > 0 and os.path.exists(f"/proc/{pid}"):
            continue
        with open(path) as f:
            names = [line.strip() for line in f if line.strip()]
        for ns in names:
            if _run("ip", "netns", "del", ns, check=False).returncode == 0:
                removed.append(ns)
        os.unlink(path)
    return removed


def raise_on_signals() -> None:
    """SIGINT and SIGTERM raise KeyboardInterrupt, so that `finally` blocks remove what was made."""
    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


def enter(name: str) -> None:
    """Move the calling thread (and every thread it starts later) into network namespace `name`."""
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {name}: {os.strerror(err)}")
    finally:
        os.close(fd)


class Hosts:
    """n hosts on one bridge, every link limited to `rate_bits_per_s` each way (+ `delay_ms` if netem exists)."""

    def __init__(self, n: int, rate_bits_per_s: int, delay_ms: float = 0.1, queue_ms: int = 50) -> None:
        self.tag = f"{os.getpid() % 10000:04d}{secrets.token_hex(2)}"
        self.hub = f"es{self.tag}hub"
        self.names = [f"es{self.tag}h{i}" for i in range(n)]
        self.rate, self.delay_ms, self.queue_ms = rate_bits_per_s, delay_ms, queue_ms
        self.delay_applied = False
        self._made: list[str] = []
        self._pairs: list[str] = []
        self._state = os.path.join(STATE_DIR, f"{os.getpid()}.{self.tag}")

    def address(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def hub_dev(self, i: int) -> str:
        return f"v{self.tag}{i}b"  # <= 15 characters with i < 100

    def create(self) -> Hosts:
        os.makedirs(STATE_DIR, exist_ok=True)
        with open(self._state, "w") as f:  # before anything exists, so a SIGKILL at any point leaves a trace
            f.write("\n".join((self.hub, *self.names)) + "\n")
        for ns in (self.hub, *self.names):
            _run("ip", "netns", "add", ns)
            self._made.append(ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        _run("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.hub, "link", "set", "br0", "up")
        for i, ns in enumerate(self.names):
            here, there = f"v{self.tag}{i}a", self.hub_dev(i)
            _run("ip", "link", "add", here, "type", "veth", "peer", "name", there)
            self._pairs.append(here)
            _run("ip", "link", "set", here, "netns", ns)
            _run("ip", "link", "set", there, "netns", self.hub)
            _run("ip", "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", here)
            _run("ip", "-n", ns, "link", "set", here, "up")
            _run("ip", "-n", self.hub, "link", "set", there, "master", "br0")
            _run("ip", "-n", self.hub, "link", "set", there, "up")
            self._limit(ns, here)
            self._limit(self.hub, there)
        return self

    def _limit(self, ns: str, dev: str) -> None:
        # burst: >= one 64 KiB GSO segment and ~2 ms at the rate, so the bucket never drops a whole segment
        burst = max(256 << 10, self.rate // 8 // 500)
        _run("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "tbf", "rate", f"{self.rate}bit",
             "burst", str(burst), "latency", f"{self.queue_ms}ms")  # the queue: packets beyond it are dropped
        if self.delay_ms > 0:
            out = _run("tc", "-n", ns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", "netem", "delay",
                       f"{self.delay_ms}ms", "limit", "100000", check=False)
            self.delay_applied = out.returncode == 0

    def tcp_losses(self) -> dict[str, int]:
        """TCP's own loss counters summed over every host so far: segments retransmitted, and retransmission
        timeouts (each stalls its connection for at least the 200 ms minimum RTO)."""
        total = {"retransmitted_segments": 0, "retransmission_timeouts": 0}
        for ns in self.names:
            out = _run("ip", "netns", "exec", ns, "nstat", "-asz", "--json", check=False)
            if out.returncode != 0:
                continue  # no nstat here: the counters stay out of the results
            kernel = json.loads(out.stdout).get("kernel", {})
            total["retransmitted_segments"] += int(kernel.get("TcpRetransSegs", 0))
            total["retransmission_timeouts"] += int(kernel.get("TcpExtTCPTimeouts", 0))
        return total

    def counters(self) -> list[dict[str, int]]:
        """Per host i: bytes it sent (`tx`) and received (`rx`) so far, read from the hub end of its link."""
        out = json.loads(_run("ip", "-n", self.hub, "-s", "-j", "link", "show").stdout)
        by_dev = {d["ifname"]: d["stats64"] for d in out}
        # the hub end receives what the host sends
        return [{"tx": by_dev[self.hub_dev(i)]["rx"]["bytes"], "rx": by_dev[self.hub_dev(i)]["tx"]["bytes"]}
                for i in range(len(self.names))]

    def close(self) -> None:
        for ns in reversed(self._made):  # deleting a namespace deletes its veth ends and their qdiscs
            _run("ip", "netns", "del", ns, check=False)
        for dev in self._pairs:  # a pair still in the root namespace when making it failed half-way
            if os.path.exists(f"/sys/class/net/{dev}"):
                _run("ip", "link", "del", dev, check=False)
        self._made, self._pairs = [], []
        if os.path.exists(self._state):
            os.unlink(self._state)

    def __enter__(self) -> Hosts:
        try:
            return self.create()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()
