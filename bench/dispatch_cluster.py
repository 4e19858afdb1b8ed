"""Benchmark: the dispatcher at cluster shape: N simulated hosts with real link limits, experience and weights.
Each host is a network namespace joined to one bridge by a veth pair whose both ends are limited by a
token bucket (tc tbf, 500 Mbit/s per direction by default; a 0.1 ms netem delay where the kernel has
netem), standing in for 100 Gbit/s NICs with every payload scaled down by the same factor (200): a
64 MiB step here is a 12.5 GiB step there, at the same link-bound seconds. Experience: half the hosts
produce (one rollout node each), half consume (two trainer ranks each, as one node with two GPUs), the
central controller sits on a host of its own; per layout (dp, dp x tp, dp x sp) one step is delivered
by layout-aware pull and by central dispatch (gather everything, then scatter), for N = 2, 4, 8, 16.
Weights: N rollout hosts get a new version from 2 trainer hosts three ways: every host pulls the full
copy from rank 0; every host pulls each trainer rank's own shard; a relay chain (store/relay.py).
Reported per N and layout: step-transfer seconds, speedup over central, its link-bound ideal (the
central controller's store-and-forward bytes over the busiest link of the pull; `ideal_speedup`) and
the fraction reached, each link's utilisation (bytes from the veth counters over rate x seconds);
weight sync seconds (go to the last host holding the version) per method. Medians over repetitions.

    sudo python bench/dispatch_cluster.py [--quick] [--json PATH] [--hosts 2 4 8 16] [--rate-mbit 1000]
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.cluster_runs import Experience, WeightSync  # noqa: E402
from bench.hosts import Hosts, missing_prerequisites, raise_on_signals, sweep_stale  # noqa: E402
from bench.provenance import write_result  # noqa: E402

log = logging.getLogger("bench.dispatch_cluster")
NIC_BITS_PER_S = 100 * 10**9  # the links stand in for 100 Gbit/s NICs; payloads are scaled down by as much
LAYOUT_NAMES = ("dp", "dp_tp", "dp_sp")
METHODS = ("rank0", "sharded", "relay")


def run_n(ctx: Any, n: int, args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """Experience and weights for n hosts (n + 2 namespaces: the controller's, and a second trainer host)."""
    with Hosts(n + 2, args.rate_mbit * 10**6, args.delay_ms, args.queue_ms) as hosts:
        if not hosts.delay_applied and args.delay_ms > 0:
            log.warning("no netem qdisc in this kernel: links are rate-limited only, without the %.2f ms delay", args.delay_ms)
        log.info("N=%d: %d namespaces, links %d Mbit/s each way", n, n + 2, args.rate_mbit)
        exp = Experience(ctx, hosts, n, args.mib << 20, args.rate_mbit * 10**6)
        try:
            before = hosts.tcp_losses()
            experience = exp.measure(args.reps)
            after = hosts.tcp_losses()
            experience["tcp_losses"] = {k: after[k] - before[k] for k in after}  # every step of every layout, both modes
        finally:
            exp.close()
        ws = WeightSync(ctx, hosts, n, args.weights_mib << 20, args.chunk_kib << 10)
        try:
            weights = ws.measure(METHODS, args.reps)
        finally:
            ws.close()
        experience["delay_applied"] = hosts.delay_applied
    return experience, weights


def summarize(args: argparse.Namespace, per_n: dict[int, tuple[dict[str, Any], dict[str, Any]]]) -> dict[str, Any]:
    hosts = sorted(per_n)
    exp = {str(n): per_n[n][0] for n in hosts}
    wts = {str(n): per_n[n][1] for n in hosts}
    speedup = {k: {lay: e["layouts"][lay]["speedup_vs_central"] for lay in LAYOUT_NAMES} for k, e in exp.items()}
    ideal = {k: {lay: e["layouts"][lay]["ideal_speedup"] for lay in LAYOUT_NAMES} for k, e in exp.items()}
    fraction = {k: {lay: speedup[k][lay] / ideal[k][lay] for lay in LAYOUT_NAMES} for k in exp}
    sync = {m: {k: w[m]["seconds"] for k, w in wts.items()} for m in METHODS}
    upto8 = [str(n) for n in hosts if 2 <= n <= 8]
    flat = {m: max(sync[m][k] for k in upto8) / min(sync[m][k] for k in upto8) for m in METHODS} if upto8 else {}
    fastest = {k: min(METHODS, key=lambda m: sync[m][k]) for k in wts}
    worst = min((f, k, lay) for k, v in fraction.items() for lay, f in v.items())
    best = max((f, k, lay) for k, v in fraction.items() for lay, f in v.items())
    scale = NIC_BITS_PER_S / (args.rate_mbit * 10**6)
    return {
        "hosts": hosts,
        "speedup_vs_central": speedup,
        "ideal_speedup": ideal,
        "fraction_of_ideal": fraction,
        "weight_sync_seconds": sync,
        "link_rate_bits_per_s": args.rate_mbit * 10**6,
        "scaling": f"links of {args.rate_mbit} Mbit/s stand in for 100 Gbit/s NICs; every payload is scaled down by "
                   f"{scale:g}x (a {args.mib} MiB step stands for {args.mib * scale / 1024:g} GiB, {args.weights_mib} MiB "
                   f"of weights for {args.weights_mib * scale / 1024:g} GiB), so the link-bound seconds match",
        "payload_scale": scale,
        "worst_fraction_of_ideal": {"fraction": worst[0], "hosts": int(worst[1]), "layout": worst[2]},
        "best_fraction_of_ideal": {"fraction": best[0], "hosts": int(best[1]), "layout": best[2]},
        "goal_fraction_of_ideal": 0.8,
        "goal_met_fraction_of_ideal": worst[0] >= 0.8,
        "weight_sync_max_over_min_2_to_8_hosts": flat,
        "goal_weight_sync_flat": 1.5,
        "weight_sync_fastest": fastest,
        "experience": exp,
        "weights": wts,
        "config": {"quick": args.quick, "step_mib": args.mib, "weights_mib": args.weights_mib,
                   "relay_chunk_kib": args.chunk_kib, "repetitions": args.reps, "delay_ms": args.delay_ms,
                   "queue_ms": args.queue_ms,
                   "delay_applied": all(e["delay_applied"] for e in exp.values()), "trainer_hosts_for_weights": 2,
                   "consumer_ranks_per_host": 2, "cpus": os.cpu_count(), "load_average_at_end": os.getloadavg()},
    }


def print_table(r: dict[str, Any]) -> None:
    print(f"\n{r['scaling']}")
    print(f"{'N':>3} {'layout':<7}{'pull s':>8}{'central s':>10}{'speedup':>9}{'ideal':>7}{'of ideal':>9}"
          f"{'pull of link bound':>19}{'busiest link':>13}")
    for k, e in r["experience"].items():
        for lay, x in e["layouts"].items():
            print(f"{k:>3} {lay:<7}{x['pull_seconds']:>8.3f}{x['central_seconds']:>10.3f}{x['speedup_vs_central']:>9.2f}"
                  f"{x['ideal_speedup']:>7.2f}{r['fraction_of_ideal'][k][lay]:>9.2f}{x['pull_fraction_of_link_bound']:>19.2f}"
                  f"{x['link_utilisation']['pull']['busiest']:>13.2f}")
    print(f"\nweight sync seconds ({r['config']['weights_mib']} MiB, 2 trainer hosts):")
    print(f"{'N':>3}" + "".join(f"{m:>10}" for m in METHODS))
    for k in r["weights"]:
        print(f"{k:>3}" + "".join(f"{r['weight_sync_seconds'][m][k]:>10.3f}" for m in METHODS))
    w, b = r["worst_fraction_of_ideal"], r["best_fraction_of_ideal"]
    print(f"\nfraction of ideal: worst {w['fraction']:.2f} (N={w['hosts']}, {w['layout']}), best {b['fraction']:.2f} "
          f"(N={b['hosts']}, {b['layout']}); weight sync max/min over 2-8 hosts: "
          + ", ".join(f"{m} {v:.2f}x" for m, v in r["weight_sync_max_over_min_2_to_8_hosts"].items()))


def plot(r: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hosts = r["hosts"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, lay in enumerate(LAYOUT_NAMES):
        color = f"C{i}"
        ax1.plot(hosts, [r["speedup_vs_central"][str(n)][lay] for n in hosts], "o-", color=color, label=f"{lay} measured")
        ax1.plot(hosts, [r["ideal_speedup"][str(n)][lay] for n in hosts], ("--", ":", "-.")[i], color=color,
                 label=f"{lay} link-bound ideal")
    ax1.set(xlabel="hosts (half produce, half consume; + the controller's)", ylabel="speedup of pull over central",
            xscale="log", xticks=hosts, xticklabels=[str(n) for n in hosts], title="Experience: one step")
    ax1.legend(fontsize=7)
    for i, m in enumerate(METHODS):
        ax2.plot(hosts, [r["weight_sync_seconds"][m][str(n)] for n in hosts], "o-", color=f"C{i + 3}", label=m)
    ax2.set(xlabel="rollout hosts", ylabel="seconds to the last host", xscale="log", xticks=hosts,
            xticklabels=[str(n) for n in hosts], title=f"Weights: {r['config']['weights_mib']} MiB version")
    ax2.set_ylim(bottom=0)
    ax2.legend(fontsize=8)
    fig.suptitle(f"{r['link_rate_bits_per_s'] / 1e6:g} Mbit/s links standing in for 100 Gbit/s NICs "
                 f"(payloads / {r['payload_scale']:g})", fontsize=9)
    for ax in (ax1, ax2):
        ax.minorticks_off()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="N = 2 and 4 only, 32 MiB steps and weights, 2 repetitions")
    ap.add_argument("--json", type=Path, help="write the results here (and the plot next to it, .png)")
    ap.add_argument("--hosts", type=int, nargs="+", help="values of N (default 2 4 8 16; even, 2..64)")
    ap.add_argument("--rate-mbit", type=int, default=500,
                    help="each link's rate per direction, Mbit/s (500: at 1000 the 2 shared cores, not the links, limit large N here)")
    ap.add_argument("--delay-ms", type=float, default=0.1, help="each link's delay (netem), if the kernel has it")
    ap.add_argument("--queue-ms", type=int, default=50, help="each link's queue, in ms at its rate (tbf latency): "
                    "packets beyond it are dropped and TCP retransmits them (counted as tcp_losses)")
    ap.add_argument("--mib", type=int, help="MiB of experience per step (default 64, 32 with --quick)")
    ap.add_argument("--weights-mib", type=int, help="MiB of weights per version (default 64, 32 with --quick)")
    ap.add_argument("--chunk-kib", type=int, default=1024, help="relay chunk size, KiB")
    ap.add_argument("--reps", type=int, help="timed repetitions per configuration (default 3, 2 with --quick)")
    args = ap.parse_args()
    args.hosts = args.hosts or ([2, 4] if args.quick else [2, 4, 8, 16])
    args.mib = args.mib or (32 if args.quick else 64)
    args.weights_mib = args.weights_mib or (32 if args.quick else 64)
    args.reps = args.reps or (2 if args.quick else 3)
    if any(n < 2 or n % 2 or n > 64 for n in args.hosts):
        ap.error("every N must be even, from 2 to 64")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    missing = missing_prerequisites()
    if missing:
        print("dispatch_cluster: cannot simulate hosts here; missing:\n  - " + "\n  - ".join(missing), file=sys.stderr)
        return 2
    raise_on_signals()
    stale = sweep_stale()
    if stale:
        log.info("removed %d namespaces left by a run killed outright: %s", len(stale), " ".join(stale))
    ctx = mp.get_context("spawn")
    start = time.monotonic()
    per_n = {}
    try:
        for n in args.hosts:
            per_n[n] = run_n(ctx, n, args)
    except KeyboardInterrupt as exc:
        print(f"dispatch_cluster: interrupted ({exc}); every namespace made was removed", file=sys.stderr)
        return 130
    result = summarize(args, per_n)
    result["seconds"] = round(time.monotonic() - start, 1)
    result["when"] = time.strftime("%Y-%m-%d %H:%M:%S")
    print_table(result)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        write_result(args.json, result, indent=2)
        plot(result, args.json.with_suffix(".png"))
        print(f"\nwrote {args.json} and {args.json.with_suffix('.png')} in {result['seconds']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
