"""The two measurements of bench/dispatch_cluster.py on simulated hosts (bench/hosts.py).

`Experience`: half the hosts produce (a shard node each), half consume (two trainer ranks each), a
central dispatcher on the next host; one step per layout and mode (pull, central). `WeightSync`: N
rollout hosts get each new version from two trainer hosts: rank0 (full copy from rank 0), sharded
(each rank's own blocks, `pull_weights` following the manifest's peers), relay (`pull_weights_relay`,
a chain in host order). Every process enters its host's namespace first (`in_host`), binds its shard
node to the host's address and never uses shared memory: these are separate hosts.
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import TYPE_CHECKING, Any

from bench.dispatch_common import BYTES_PER_TOKEN, deliver, make_lengths, producer_main
from bench.hosts import Hosts, enter
from earl_stream.store import CentralClient, CentralDispatcher, Layout, ShardClient, ShardNode, partition

if TYPE_CHECKING:  # torch is imported by the weight processes only: the experience processes stay light
    import torch

log = logging.getLogger("bench.dispatch_cluster")
MODES = ("pull", "central")
WEIGHT_TENSORS, WEIGHT_COLS = 8, 1024
TIMEOUT_S = 300.0


def in_host(conn: Any, ns: str, target: Any, *args: Any) -> None:
    enter(ns)  # first thing: every socket and thread of this process lives on that host
    target(conn, *args)


def _spawn(ctx: Any, procs: list[Any], ns: str, target: Any, *args: Any) -> Any:
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=in_host, args=(child, ns, target, *args), daemon=True)
    proc.start()
    child.close()
    procs.append(proc)
    return parent


def _stop(procs: list[Any], conns: list[Any]) -> None:
    for conn in conns:
        try:
            conn.send(("stop",))
        except (OSError, ValueError):
            pass
    for proc in procs:
        proc.join(15)
        if proc.is_alive():
            proc.kill()
            proc.join(5)


def _replies(conns: list[Any], what: str) -> list[Any]:
    replies = [conn.recv() for conn in conns]
    failed = [r for r in replies if r[0] != "ok"]
    if failed:
        raise RuntimeError(f"{what}: {failed[0][1]}")
    return [r[1] for r in replies]


# --- experience -------------------------------------------------------------------------------------


def consumer_main(conn: Any, claim: list[Any], dispatcher: str) -> None:
    client = ShardClient(timeout_s=TIMEOUT_S, shm=False)
    central = CentralClient(ShardClient(timeout_s=TIMEOUT_S, shm=False), dispatcher)
    conn.send("ready")
    while (msg := conn.recv())[0] != "stop":
        _, mode, lay, rank, step, verify = msg
        try:
            conn.send(("ok", deliver(client, central, claim, mode, lay, rank, step, verify)))
        except Exception as exc:  # reported to the driver, which stops the run
            conn.send(("error", repr(exc)))
    client.close()
    central.close()


def dispatcher_main(conn: Any, host: str) -> None:
    with CentralDispatcher(host, shm=False, keep_steps=1, timeout_s=TIMEOUT_S) as dispatcher:
        conn.send(dispatcher.address)
        try:
            conn.recv()
        except EOFError:
            pass


def layouts_for(ranks: int) -> dict[str, dict[str, int]]:
    """dp, dp x tp and dp x sp over `ranks` consumer ranks (tp / sp pairs are the two ranks of one host)."""
    return {"dp": {"dp": ranks, "tp": 1, "cp": 1}, "dp_tp": {"dp": ranks // 2, "tp": 2, "cp": 1},
            "dp_sp": {"dp": ranks // 2, "tp": 1, "cp": 2}}


class Experience:
    """Producers on hosts 0..P-1, consumer ranks 2 per host on hosts P..n-1, the dispatcher on host n."""

    def __init__(self, ctx: Any, hosts: Hosts, n: int, nbytes: int, rate_bits_per_s: int) -> None:
        self.hosts, self.n, self.bps = hosts, n, rate_bits_per_s / 8
        self.producers = n // 2
        self.ranks = 2 * (n - self.producers)
        self.lengths = make_lengths(nbytes, seed=0)
        self.owners = [i % self.producers for i in range(len(self.lengths))]
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        self.step_no = 0
        try:
            self._start(ctx)
        except BaseException:
            self.close()
            raise

    def _start(self, ctx: Any) -> None:
        h = self.hosts
        prods = []
        for p in range(self.producers):
            rows = [i for i, o in enumerate(self.owners) if o == p]
            prods.append(_spawn(ctx, self.procs, h.names[p], producer_main, p, rows, [self.lengths[i] for i in rows],
                                {"host": h.address(p), "shm": False}))
        self.conns += prods
        metas = {m.sample_id: m for conn in prods for m in conn.recv()["metas"]}
        claim = [metas[f"r{i}"] for i in range(len(self.lengths))]
        disp = _spawn(ctx, self.procs, h.names[self.n], dispatcher_main, h.address(self.n))
        self.conns.append(disp)
        dispatcher = disp.recv()
        self.consumers = [_spawn(ctx, self.procs, h.names[self.producers + r // 2], consumer_main, claim, dispatcher)
                          for r in range(self.ranks)]
        self.conns += self.consumers
        for conn in self.consumers:
            assert conn.recv() == "ready"

    def host_names(self) -> list[str]:
        return ([f"producer{i}" for i in range(self.producers)]
                + [f"consumer{i}" for i in range(self.n - self.producers)] + ["controller"])

    def step(self, mode: str, lay: dict[str, int], verify: bool) -> tuple[float, int]:
        self.step_no += 1
        t0 = time.perf_counter()
        for rank, conn in enumerate(self.consumers):
            conn.send(("step", mode, lay, rank, self.step_no, verify))
        moved = sum(_replies(self.consumers, f"{mode} {lay}"))
        return time.perf_counter() - t0, moved

    def bounds(self, lay: dict[str, int]) -> dict[str, float]:
        """Link-bound seconds from the bytes each link must carry under this layout and placement."""
        tx, rx = [0] * self.n, [0] * self.n
        for rank in range(self.ranks):
            part = partition(self.lengths, Layout.from_rank(rank, dp=lay["dp"], tp=lay["tp"], cp=lay["cp"]))
            ranges = part.ranges_by_position() if lay["cp"] > 1 else None
            for pos, row in enumerate(part.rows):
                tokens = sum(e - s for s, e in ranges[pos]) if ranges else self.lengths[row]
                tx[self.owners[row]] += tokens * BYTES_PER_TOKEN
                rx[self.producers + rank // 2] += tokens * BYTES_PER_TOKEN
        whole, delivered = sum(self.lengths) * BYTES_PER_TOKEN, sum(rx)
        return {"bytes_step": whole, "bytes_delivered": delivered,
                "pull_link_bound_seconds": max(max(tx), max(rx)) / self.bps,
                # the dispatcher gathers every row whole, then scatters: both through its one link
                "central_link_bound_seconds": (whole + delivered) / self.bps,
                "central_pipelined_link_bound_seconds": max(whole, delivered) / self.bps}

    def measure(self, reps: int) -> dict[str, Any]:
        layouts = layouts_for(self.ranks)
        secs: dict[str, dict[str, list[float]]] = {k: {m: [] for m in MODES} for k in layouts}
        util: dict[str, dict[str, list[list[dict[str, float]]]]] = {k: {m: [] for m in MODES} for k in layouts}
        for rep in range(reps + 1):  # rep 0 warms up (connections) and checks every byte
            for name, lay in layouts.items():
                for mode in MODES:
                    before = self.hosts.counters()
                    seconds, _ = self.step(mode, lay, verify=rep == 0)
                    after = self.hosts.counters()
                    log.info("N=%d rep %d %s %s: %.3f s", self.n, rep, name, mode, seconds)
                    if rep:
                        secs[name][mode].append(seconds)
                        util[name][mode].append([{d: (a[d] - b[d]) / self.bps / seconds for d in ("tx", "rx")}
                                                 for a, b in zip(after[: self.n + 1], before[: self.n + 1])])
        return {"producers": self.producers, "consumer_hosts": self.n - self.producers, "consumer_ranks": self.ranks,
                "rows": len(self.lengths),
                "layouts": {name: self._summary(lay, secs[name], util[name]) for name, lay in layouts.items()}}

    def _summary(self, lay: dict[str, int], secs: dict[str, list[float]],
                 util: dict[str, list[list[dict[str, float]]]]) -> dict[str, Any]:
        b = self.bounds(lay)
        pull, central = statistics.median(secs["pull"]), statistics.median(secs["central"])
        ideal = b["central_link_bound_seconds"] / b["pull_link_bound_seconds"]
        links: dict[str, Any] = {}
        for mode, reps in util.items():
            per_host = {name: {d: statistics.mean(r[i][d] for r in reps) for d in ("tx", "rx")}
                        for i, name in enumerate(self.host_names())}
            links[mode] = {"hosts": per_host, "busiest": max(max(v.values()) for v in per_host.values())}
        return {"layout": lay, **b, "pull_seconds": pull, "central_seconds": central,
                "speedup_vs_central": central / pull, "ideal_speedup": ideal, "fraction_of_ideal": central / pull / ideal,
                "ideal_speedup_pipelined_controller": b["central_pipelined_link_bound_seconds"] / b["pull_link_bound_seconds"],
                "pull_fraction_of_link_bound": b["pull_link_bound_seconds"] / pull,
                "central_fraction_of_link_bound": b["central_link_bound_seconds"] / central,
                "link_utilisation": links, "samples_seconds": secs}

    def close(self) -> None:
        _stop(self.procs, self.conns)


# --- weights ----------------------------------------------------------------------------------------


def weight_state(nbytes: int) -> dict[str, torch.Tensor]:
    """WEIGHT_TENSORS fp32 tensors [rows, WEIGHT_COLS] of about `nbytes` in all, deterministic content."""
    import torch

    rows = max(2, nbytes // 4 // WEIGHT_COLS // WEIGHT_TENSORS) // 2 * 2
    base = torch.arange(rows * WEIGHT_COLS, dtype=torch.int64).reshape(rows, WEIGHT_COLS)
    return {f"layers.{i}.mlp.up_proj.weight": ((base * (2 * i + 1)) % 65521).to(torch.float32)
            for i in range(WEIGHT_TENSORS)}


def trainer_main(conn: Any, rank: int, host: str, nbytes: int) -> None:
    import torch

    from earl_stream.store.weights import WeightPiece, drop_weights, publish_weights

    torch.set_num_threads(1)
    state = weight_state(nbytes)
    with ShardNode(host, shm=False) as node:
        conn.send(node.address)
        while (msg := conn.recv())[0] != "stop":
            _, version, method, peers = msg
            if method == "rank0":  # rank 0 publishes the gathered full copy, the other ranks nothing
                if rank == 0:
                    publish_weights(node, version, state)
            else:  # each rank its own rows (FSDP-style dim-0 shards); rank 0's manifest names the others
                pieces = []
                for name, t in state.items():
                    half = t.shape[0] // 2
                    pieces.append(WeightPiece(name, t[rank * half:(rank + 1) * half], tuple(t.shape), (rank * half, 0)))
                publish_weights(node, version, pieces, peers=peers if rank == 0 else [])
            drop_weights(node, version - 2)
            conn.send(("ok", None))


def rollout_main(conn: Any, host: str, nbytes: int, trainer0: str) -> None:
    import torch

    from earl_stream.store.relay import pull_weights_relay
    from earl_stream.store.weights import pull_weights

    torch.set_num_threads(1)
    with ShardClient(timeout_s=TIMEOUT_S, shm=False) as client, ShardNode(host, shm=False) as node:
        conn.send(node.address)
        while (msg := conn.recv())[0] != "stop":
            _, version, method, via, chunk, verify = msg
            try:
                t0, c0 = time.perf_counter(), time.process_time()
                if method == "relay":
                    got = pull_weights_relay(client, node, trainer0, version, via=via, chunk_bytes=chunk, timeout_s=TIMEOUT_S)
                else:
                    got = pull_weights(client, trainer0, version, timeout_s=TIMEOUT_S)
                seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
                if verify:
                    want = weight_state(nbytes)
                    bad = [k for k, v in want.items() if not torch.equal(got.get(k, torch.empty(0)), v)]
                    if bad or len(got) != len(want):
                        raise RuntimeError(f"{method} version {version}: wrong tensors {bad[:3]}")
                del got
                conn.send(("ok", (seconds, cpu)))
            except Exception as exc:  # reported to the driver, which stops the run
                conn.send(("error", repr(exc)))


class WeightSync:
    """Rollout workers on hosts 0..n-1, trainer ranks 0 and 1 on hosts n and n+1."""

    def __init__(self, ctx: Any, hosts: Hosts, n: int, nbytes: int, chunk_bytes: int) -> None:
        self.hosts, self.n, self.chunk = hosts, n, chunk_bytes
        self.nbytes = sum(t.nbytes for t in weight_state(nbytes).values())  # the driver imports torch: once
        self.bps = hosts.rate / 8
        self.procs: list[Any] = []
        self.trainers: list[Any] = []
        self.rollouts: list[Any] = []
        self.version = 0
        try:
            self.trainers = [_spawn(ctx, self.procs, hosts.names[n + r], trainer_main, r, hosts.address(n + r), nbytes)
                             for r in range(2)]
            self.trainer_addrs = [c.recv() for c in self.trainers]
            self.rollouts = [_spawn(ctx, self.procs, hosts.names[i], rollout_main, hosts.address(i), nbytes,
                                    self.trainer_addrs[0]) for i in range(n)]
            self.addrs = [c.recv() for c in self.rollouts]
        except BaseException:
            self.close()
            raise

    def sync(self, method: str, verify: bool) -> tuple[float, list[tuple[float, float]]]:
        """Publish a new version, then time from go until every rollout host holds it; (seconds, CPU
        seconds) of each host's pull."""
        self.version += 1
        for conn in self.trainers:
            conn.send(("publish", self.version, method, self.trainer_addrs[1:]))
        _replies(self.trainers, f"publish {method}")
        t0 = time.perf_counter()
        for i, conn in enumerate(self.rollouts):
            via = self.addrs[i - 1] if method == "relay" and i else ""
            conn.send(("pull", self.version, method, via, self.chunk, verify))
        each = _replies(self.rollouts, f"pull {method}")
        return time.perf_counter() - t0, each

    def measure(self, methods: tuple[str, ...], reps: int) -> dict[str, Any]:
        bound = {"rank0": self.n * self.nbytes, "sharded": self.n * self.nbytes / 2, "relay": self.nbytes}
        out = {}
        for method in methods:
            samples, trainer_tx, cpu = [], [], []
            for rep in range(reps + 1):  # rep 0 warms up and checks every tensor
                before = self.hosts.counters()
                seconds, each = self.sync(method, verify=rep == 0)
                log.info("N=%d rep %d weights %s: %.3f s", self.n, rep, method, seconds)
                after = self.hosts.counters()
                if rep:
                    samples.append(seconds)
                    cpu.append(sum(c for _, c in each))
                    trainer_tx.append([(after[i]["tx"] - before[i]["tx"]) / self.bps / seconds
                                       for i in (self.n, self.n + 1)])
            seconds = statistics.median(samples)
            out[method] = {"seconds": seconds, "samples_seconds": samples, "bytes": self.nbytes,
                           "link_bound_seconds": bound[method] / self.bps,
                           "fraction_of_link_bound": bound[method] / self.bps / seconds,
                           "rollout_cpu_seconds_total": statistics.median(cpu),
                           "trainer_links_tx_utilisation": [statistics.mean(r[i] for r in trainer_tx) for i in (0, 1)]}
        return out

    def close(self) -> None:
        _stop(self.procs, self.trainers + self.rollouts)
