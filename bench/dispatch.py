"""Benchmark: moving one training step's per-token data from P producers to C consumers.

Every producer and consumer is its own process. The producers hold their rows in their shard nodes
(put before timing, as rollout workers do while they play); each timed step then delivers every
consumer its part under a layout (DP=4, DP=2 x TP=2, DP=2 x CP=2 with zig-zag token slices):

- pull:    layout-aware pull, each consumer computes `partition` and pulls only its part straight
           from the producers (shared memory between these same-host processes) into private arrays
- pull_zc: the same with `zero_copy=True`: read-only views into the producers' segments, held for
           as long as the consumer keeps them (as Ray's consumers read its object store in place)
- tcp:     the same with `ShardClient(shm=False)` (the cross-host path, on loopback)
- ucx:     when `ucxx` imports: the same with `ShardClient(transport="ucx")` (worker addresses exchanged
           on the shard node's connection; UCX picks its own transport, shared memory here)
- central: every byte through one `CentralDispatcher` process (gather the whole step, then scatter)
- ray:     when `ray` imports: Ray's object store in the single-controller pattern (the driver gets
           every producer's batch, concatenates, splits per consumer, sends)

The same run measures the same-host ceilings: memcpy in one process, and a copy between two
processes through pre-faulted shared memory (copy in by one, copy out by the other). A step is timed
from "go" to the last consumer holding its part; medians over repetitions (the machine is shared).

    python bench/dispatch.py [--quick] [--json PATH] [--mib N] [--reps N] [--no-ray]
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.dispatch_common import (  # noqa: E402
    BYTES_PER_TOKEN,
    FIELD_DTYPES,
    FIELDS,
    GIB,
    LAYOUTS,
    ROW_TOKENS,
    check_rows,
    deliver,
    make_lengths,
    producer_main,
    row_fields,
)
from bench.provenance import write_result  # noqa: E402
from earl_stream.store import CentralClient, Layout, SampleMeta, ShardClient, partition, start_dispatcher_process  # noqa: E402
from earl_stream.store.ucx import ucx_available, ucx_import_error  # noqa: E402

log = logging.getLogger("bench.dispatch")


def consumer_main(conn: Any, index: int, claim: list[SampleMeta], dispatcher: str) -> None:
    clients = {"pull": ShardClient(timeout_s=300), "tcp": ShardClient(timeout_s=300, shm=False)}
    if ucx_available():
        clients["ucx"] = ShardClient(timeout_s=300, transport="ucx")
    central = CentralClient(ShardClient(timeout_s=300), dispatcher)
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            break
        _, mode, lay, rank, step, verify = msg
        try:
            client = None if mode == "central" else clients["pull" if mode == "pull_zc" else mode]
            moved = deliver(client, central, claim, mode, lay, rank, step, verify)
            conn.send(("ok", moved))
        except Exception as exc:  # reported to the driver, which stops the run
            conn.send(("error", repr(exc)))
    for client in clients.values():
        client.close()
    central.close()


def _shm_file(name: str, nbytes: int, create: bool) -> Any:
    import mmap

    path = f"/dev/shm/{name}"
    fd = os.open(path, (os.O_CREAT | os.O_EXCL | os.O_RDWR) if create else os.O_RDONLY, 0o600)
    try:
        if create:
            os.ftruncate(fd, nbytes)
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if create else 0)
        return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=prot)
    finally:
        os.close(fd)


def ceiling_copy_in(conn: Any, nbytes: int) -> None:
    name = f"earl_bench-{os.getpid()}"
    seg = np.frombuffer(_shm_file(name, nbytes, create=True), np.uint8)
    src = np.random.default_rng(1).integers(0, 255, nbytes, dtype=np.uint8)
    conn.send(name)
    try:
        while conn.recv() == "go":
            t0 = time.perf_counter()
            np.copyto(seg, src)
            conn.send(time.perf_counter() - t0)
    finally:
        os.unlink(f"/dev/shm/{name}")


def ceiling_copy_out(conn: Any, name: str, nbytes: int) -> None:
    seg = np.frombuffer(_shm_file(name, nbytes, create=False), np.uint8)
    dst = np.ones(nbytes, np.uint8)
    conn.send("ready")
    while conn.recv() == "go":
        t0 = time.perf_counter()
        np.copyto(dst, seg)
        conn.send(time.perf_counter() - t0)


# --- Ray's object store, single-controller pattern ------------------------------------------------------


class _RayProducer:
    def make(self, rows: list[int], lengths: list[int]) -> dict[str, np.ndarray]:
        fields = [row_fields(r, n) for r, n in zip(rows, lengths)]
        return {name: np.concatenate([f[name] for f in fields]) for name in FIELDS}


class _RayConsumer:
    def receive(self, part: dict[str, Any], rows: list[int], ranges: Any, lengths: list[int], verify: bool) -> int:
        if verify:  # part[name] is every row's needed tokens back to back
            got, at = [], 0
            for pos, row in enumerate(rows):
                n = sum(e - s for s, e in (ranges[pos] if ranges else [(0, lengths[row])]))
                got.append({name: part[name][at : at + n] for name in FIELDS})
                at += n
            check_rows(rows, got, lengths, ranges)
        return sum(a.nbytes for a in part.values())


class RayPattern:
    """Producers are Ray actors whose batches sit in the object store; the driver routes every byte."""

    def __init__(self, ray: Any, producers: int, consumers: int, lengths: list[int]) -> None:
        self.ray, self.lengths = ray, lengths
        store = max(2 << 30, 6 * sum(lengths) * BYTES_PER_TOKEN)
        ray.init(num_cpus=producers + consumers + 1, object_store_memory=store, include_dashboard=False,
                 log_to_driver=False, logging_level="ERROR")
        producer_cls = ray.remote(num_cpus=1)(_RayProducer)
        consumer_cls = ray.remote(num_cpus=1)(_RayConsumer)
        owned = [[i for i in range(len(lengths)) if i % producers == p] for p in range(producers)]
        self.refs = [producer_cls.remote().make.remote(rows, [lengths[i] for i in rows]) for rows in owned]
        ray.wait(self.refs, num_returns=len(self.refs))
        self.consumers = [consumer_cls.remote() for _ in range(consumers)]
        order = [i for rows in owned for i in rows]  # row order of the concatenated producer batches
        starts = np.concatenate([[0], np.cumsum([lengths[i] for i in order])])
        self.start = {row: int(starts[k]) for k, row in enumerate(order)}

    def __call__(self, lay: dict[str, int], verify: bool) -> tuple[float, int]:
        ray = self.ray
        t0 = time.perf_counter()
        batches = ray.get(self.refs)
        full = {name: np.concatenate([b[name] for b in batches]) for name in FIELDS}
        futures = []
        for dp in range(lay["dp"]):
            for cp in range(lay["cp"]):
                layout = Layout(dp_size=lay["dp"], dp_rank=dp, cp_size=lay["cp"], cp_rank=cp)
                part = partition(self.lengths, layout)
                ranges = part.ranges_by_position() if lay["cp"] > 1 else None
                spans = [(self.start[row] + s, self.start[row] + e) for pos, row in enumerate(part.rows)
                         for s, e in (ranges[pos] if ranges else [(0, self.lengths[row])])]
                ref = ray.put({name: np.concatenate([full[name][s:e] for s, e in spans]) for name in FIELDS})
                for tp in range(lay["tp"]):  # tensor-parallel peers share one object: generous to Ray
                    rank = Layout(dp_size=lay["dp"], dp_rank=dp, tp_size=lay["tp"], tp_rank=tp, cp_size=lay["cp"], cp_rank=cp).rank
                    futures.append(self.consumers[rank].receive.remote(ref, part.rows, ranges, self.lengths, verify))
        moved = sum(ray.get(futures))
        return time.perf_counter() - t0, moved

    def shutdown(self) -> None:
        self.ray.shutdown()


def ray_pattern(producers: int, consumers: int, lengths: list[int]) -> RayPattern | None:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    try:
        import ray
    except ImportError:
        return None
    return RayPattern(ray, producers, consumers, lengths)


def _spawn(ctx: Any, target: Any, *args: Any) -> tuple[Any, Any]:
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, *args), daemon=True)
    proc.start()
    child.close()
    return proc, parent


class Ceilings:
    """Same-host ceilings, sampled between the timed steps so that they see the same machine load:
    memcpy in this process, and a copy through pre-faulted shared memory between two processes
    (one copies its private bytes in, the other copies them out into its own pre-faulted buffer)."""

    def __init__(self, ctx: Any, nbytes: int) -> None:
        self.nbytes = nbytes
        self.src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
        self.dst = np.ones_like(self.src)
        self.writer, self.wconn = _spawn(ctx, ceiling_copy_in, nbytes)
        name = self.wconn.recv()
        self.reader, self.rconn = _spawn(ctx, ceiling_copy_out, name, nbytes)
        self.rconn.recv()  # mapped and pre-faulted
        self.samples: dict[str, list[float]] = {"memcpy": [], "copy_in": [], "copy_out": []}

    def sample(self) -> None:
        t0 = time.perf_counter()
        np.copyto(self.dst, self.src)
        self.samples["memcpy"].append(time.perf_counter() - t0)
        self.wconn.send("go")
        self.samples["copy_in"].append(self.wconn.recv())
        self.rconn.send("go")
        self.samples["copy_out"].append(self.rconn.recv())

    def close(self) -> None:
        for conn, proc in ((self.rconn, self.reader), (self.wconn, self.writer)):
            conn.send("stop")
            proc.join()

    def summary(self) -> dict[str, float]:
        med = {k: statistics.median(v) for k, v in self.samples.items()}
        both = med["copy_in"] + med["copy_out"]
        return {
            "memcpy_seconds": med["memcpy"],
            "memcpy_gibps": self.nbytes / GIB / med["memcpy"],
            "shm_copy_in_seconds": med["copy_in"],
            "shm_copy_out_seconds": med["copy_out"],
            "shm_seconds": both,
            "shm_gibps": self.nbytes / GIB / both,
            "shm_copy_out_gibps": self.nbytes / GIB / med["copy_out"],
            "samples": len(self.samples["memcpy"]),
        }


class Cluster:
    """P producer processes, C consumer processes, a central dispatcher, and the claim."""

    def __init__(self, ctx: Any, producers: int, consumers: int, nbytes: int, seed: int) -> None:
        self.lengths = make_lengths(nbytes, seed)
        self.procs, self.prod_conns, self.cons_conns = [], [], []
        owners = [i % producers for i in range(len(self.lengths))]
        for p in range(producers):
            rows = [i for i, o in enumerate(owners) if o == p]
            proc, conn = _spawn(ctx, producer_main, p, rows, [self.lengths[i] for i in rows])
            self.procs.append(proc)
            self.prod_conns.append(conn)
        replies = [conn.recv() for conn in self.prod_conns]
        self.put_seconds = max(r["put_seconds"] for r in replies)
        metas_by_row = {m.sample_id: m for r in replies for m in r["metas"]}
        self.claim = [metas_by_row[f"r{i}"] for i in range(len(self.lengths))]
        self.dispatcher = start_dispatcher_process(keep_steps=1)
        for c in range(consumers):
            proc, conn = _spawn(ctx, consumer_main, c, self.claim, self.dispatcher.address)
            self.procs.append(proc)
            self.cons_conns.append(conn)
        for conn in self.cons_conns:
            assert conn.recv() == "ready"
        self.step = 0

    def run(self, mode: str, layout: dict[str, int], verify: bool) -> tuple[float, int]:
        """One step in `mode`; returns (seconds from go to the last consumer done, bytes delivered)."""
        self.step += 1
        t0 = time.perf_counter()
        for rank, conn in enumerate(self.cons_conns):
            conn.send(("step", mode, layout, rank, self.step, verify))
        replies = [conn.recv() for conn in self.cons_conns]
        elapsed = time.perf_counter() - t0
        failed = [r for r in replies if r[0] != "ok"]
        if failed:
            raise RuntimeError(f"{mode} {layout}: consumer failed: {failed[0][1]}")
        return elapsed, sum(r[1] for r in replies)

    def close(self) -> None:
        for conn in self.cons_conns + self.prod_conns:
            conn.send(("stop",))
        self.dispatcher.stop()
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()


def run(args: argparse.Namespace) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    nbytes = args.mib << 20
    reps = args.reps
    cluster = Cluster(ctx, args.producers, args.consumers, nbytes, seed=0)
    bytes_per_step = sum(cluster.lengths) * BYTES_PER_TOKEN
    ceilings = Ceilings(ctx, bytes_per_step)
    ray_runner = None
    if not args.no_ray:
        ray_runner = ray_pattern(args.producers, args.consumers, cluster.lengths)
        if ray_runner is None:
            log.warning("ray is not importable: ray_seconds stays null")
    if not ucx_available():
        log.warning("ucxx is not importable: ucx_seconds stays null")
    modes = ["pull", "pull_zc", "tcp", "central"] + (["ucx"] if ucx_available() else []) + (["ray"] if ray_runner else [])
    samples: dict[str, dict[str, list[float]]] = {name: {m: [] for m in modes} for name in LAYOUTS}
    delivered: dict[str, dict[str, int]] = {name: {} for name in LAYOUTS}
    try:
        for rep in range(reps + 1):  # rep 0 warms up (connections, mappings, pools) and verifies
            for name, layout in LAYOUTS.items():
                for mode in modes:
                    if mode == "ray":
                        assert ray_runner is not None
                        secs, got = ray_runner(layout, verify=rep == 0)
                    else:
                        secs, got = cluster.run(mode, layout, verify=rep == 0)
                    delivered[name][mode] = got
                    if rep:
                        samples[name][mode].append(secs)
                if rep:
                    ceilings.sample()
                    log.info("rep %d %s: %s", rep, name, {m: round(v[-1], 4) for m, v in samples[name].items()})
    finally:
        cluster.close()
        ceilings.close()
        if ray_runner is not None:
            ray_runner.shutdown()
    ceil = ceilings.summary()
    layouts = {name: summarize(LAYOUTS[name], samples[name], delivered[name], ceil) for name in LAYOUTS}
    head = layouts["dp4"]
    return {
        "bytes_per_step": bytes_per_step,
        "pull_seconds": head["pull_seconds"],
        "central_seconds": head["central_seconds"],
        "ray_seconds": head["ray_seconds"],
        "speedup_vs_central": head["speedup_vs_central"],
        "speedup_vs_ray": head["speedup_vs_ray"],
        "pull_zero_copy_seconds": head["pull_zero_copy_seconds"],
        "pull_ucx_seconds": head["pull_ucx_seconds"],
        "speedup_vs_ray_zero_copy": head["speedup_vs_ray_zero_copy"],
        "fraction_of_shm_ceiling": head["fraction_of_shm_ceiling"],
        "fraction_of_shm_copy_out_ceiling": head["fraction_of_shm_copy_out_ceiling"],
        "layouts": layouts,
        "ceilings": ceil,
        "config": {
            "producers": args.producers,
            "consumers": args.consumers,
            "rows": len(cluster.lengths),
            "mean_tokens_per_row": float(np.mean(cluster.lengths)),
            "row_tokens_range": list(ROW_TOKENS),
            "fields": {k: np.dtype(v).name for k, v in FIELD_DTYPES.items()},
            "repetitions": reps,
            "quick": args.quick,
            "producer_put_seconds": cluster.put_seconds,
            "ucx": ucx_available(),
            "ucx_import_error": ucx_import_error(),
            "ucx_tls": os.environ.get("UCX_TLS"),
            "cpus": os.cpu_count(),
            "load_average_at_end": os.getloadavg(),
        },
    }


def summarize(layout: dict[str, int], samples: dict[str, list[float]], delivered: dict[str, int], ceil: dict[str, float]) -> dict[str, Any]:
    med = {m: statistics.median(v) for m, v in samples.items()}
    pull = med["pull"]
    ray = med.get("ray")
    moved = delivered["pull"]
    return {
        "layout": layout,
        "bytes_delivered": moved,
        "pull_seconds": pull,
        "pull_zero_copy_seconds": med["pull_zc"],
        "pull_tcp_seconds": med["tcp"],
        "pull_ucx_seconds": med.get("ucx"),
        "central_seconds": med["central"],
        "ray_seconds": ray,
        "pull_gibps": moved / GIB / pull,
        "speedup_vs_central": med["central"] / pull,
        "speedup_vs_tcp": med["tcp"] / pull,
        "speedup_vs_ucx": None if "ucx" not in med else med["ucx"] / pull,
        "speedup_vs_ray": None if ray is None else ray / pull,
        "speedup_vs_ray_zero_copy": None if ray is None else ray / med["pull_zc"],
        # The ceilings move the same number of bytes as this layout delivers.
        "fraction_of_shm_ceiling": moved / GIB / ceil["shm_gibps"] / pull,
        "fraction_of_shm_copy_out_ceiling": moved / GIB / ceil["shm_copy_out_gibps"] / pull,
        "samples_seconds": samples,
    }


def print_table(result: dict[str, Any]) -> None:
    c = result["ceilings"]
    mib = result["bytes_per_step"] / (1 << 20)
    print(f"\n{result['config']['producers']} producers -> {result['config']['consumers']} consumers, "
          f"{mib:.0f} MiB per step, {result['config']['rows']} rows, median of {result['config']['repetitions']}")
    print(f"ceilings: memcpy {c['memcpy_gibps']:.2f} GiB/s; shm between two processes {c['shm_gibps']:.2f} GiB/s "
          f"(copy in {c['shm_copy_in_seconds'] * 1e3:.0f} ms + copy out {c['shm_copy_out_seconds'] * 1e3:.0f} ms)")
    head = f"{'layout':<10}{'MiB out':>8}{'pull ms':>9}{'GiB/s':>7}{'zc ms':>7}{'tcp ms':>8}{'ucx ms':>8}{'central ms':>11}{'ray ms':>8}"
    head += f"{'x central':>10}{'x ray':>7}{'zc x ray':>9}{'of shm':>8}{'of out':>8}"
    print(head)
    for name, r in result["layouts"].items():
        ray = "-" if r["ray_seconds"] is None else f"{r['ray_seconds'] * 1e3:.0f}"
        ucx = "-" if r["pull_ucx_seconds"] is None else f"{r['pull_ucx_seconds'] * 1e3:.0f}"
        xray = "-" if r["speedup_vs_ray"] is None else f"{r['speedup_vs_ray']:.2f}"
        zray = "-" if r["speedup_vs_ray_zero_copy"] is None else f"{r['speedup_vs_ray_zero_copy']:.2f}"
        print(f"{name:<10}{r['bytes_delivered'] / (1 << 20):>8.0f}{r['pull_seconds'] * 1e3:>9.0f}{r['pull_gibps']:>7.2f}"
              f"{r['pull_zero_copy_seconds'] * 1e3:>7.0f}{r['pull_tcp_seconds'] * 1e3:>8.0f}{ucx:>8}{r['central_seconds'] * 1e3:>11.0f}"
              f"{ray:>8}{r['speedup_vs_central']:>10.2f}{xray:>7}{zray:>9}{r['fraction_of_shm_ceiling']:>8.2f}"
              f"{r['fraction_of_shm_copy_out_ceiling']:>8.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="64 MiB per step, 3 repetitions")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--mib", type=int, help="MiB per step (default 256, 64 with --quick)")
    parser.add_argument("--reps", type=int, help="timed repetitions per mode and layout (default 7, 3 with --quick)")
    parser.add_argument("--producers", type=int, default=4)
    parser.add_argument("--consumers", type=int, default=4)
    parser.add_argument("--no-ray", action="store_true", help="skip the Ray pattern even if ray imports")
    args = parser.parse_args()
    args.mib = args.mib or (64 if args.quick else 256)
    args.reps = args.reps or (3 if args.quick else 7)
    if args.consumers != 4:
        parser.error("the layouts (DP=4, DP=2 x TP=2, DP=2 x CP=2) need exactly 4 consumers")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    result = run(args)
    print_table(result)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        write_result(args.json, result, indent=2)
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
