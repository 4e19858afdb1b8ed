"""Weight sync: every trainer rank publishes its own shard vs rank 0 publishing the gathered full copy.

    python bench/weight_sync.py --json bench/results/weight_sync.json [--quick]

Two gloo trainer ranks hold a Qwen2 laid out by `workers.sharding.shard_model` under fsdp2 and tp2,
at two sizes (~1M and ~35M parameters, fp32). Sharded: each rank publishes `shard_pieces` of its
own state dict into its own `ShardNode` (`publish_weights(..., peers=...)`: rank 0's manifest names
the other rank), and a separate process pulls with `pull_weights` from rank 0, which follows the
peers and assembles the blocks. Full copy (the pool's behaviour before sharded publishing): rank 0
gathers `get_model_state_dict(full_state_dict=True)` (a collective) and publishes it whole; the
puller pulls it from rank 0. Publish seconds: from a barrier until every rank's publish returned
(the gather included); pull seconds: `pull_weights` in the puller, connections already open.
Medians over the repetitions; the assembled tensors are checked against the full state dict.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.provenance import write_result  # noqa: E402

SIZES = {  # Qwen2 configs; vocabulary, heads, kv heads and intermediate size divisible by tp = 2
    "1M": {"hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
           "intermediate_size": 352, "vocab_size": 512, "tie_word_embeddings": True, "max_position_embeddings": 1024},
    "35M": {"hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 2,
            "intermediate_size": 1408, "vocab_size": 16384, "tie_word_embeddings": False,
            "max_position_embeddings": 1024},
}
PLANS = ("fsdp2", "tp2")
METHODS = ("sharded", "full")


def _checksums(state: dict[str, Any]) -> dict[str, float]:
    return {k: float(v.double().sum()) for k, v in state.items()}


def puller() -> None:
    """The rollout side: one `ShardClient`; per request line `ADDRESS VERSION`, pull and time it."""
    from earl_stream.store.client import ShardClient
    from earl_stream.store.weights import pull_weights

    with ShardClient(timeout_s=60.0) as client:
        for line in sys.stdin:
            if not line.strip():
                break
            address, version = line.split()
            start = time.monotonic()
            got = pull_weights(client, address, int(version), timeout_s=60.0)
            seconds = time.monotonic() - start
            print(json.dumps({"pull_seconds": seconds, "bytes": sum(t.nbytes for t in got.values()),
                              "tensors": len(got), "checksums": _checksums(got), "transport": client.transport(address)}),
                  flush=True)


def rank_child(spec: dict[str, Any], rank: int, world: int, port: int) -> dict[str, Any]:
    """One trainer rank: lay the model out, then publish (and, on rank 0, have the puller pull) each rep."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from bench.ranks import join, laid_out_model
    from earl_stream.store.node import ShardNode
    from earl_stream.store.weights import distinct_tensors, drop_weights, publish_weights
    from earl_stream.workers.sharding import shard_pieces

    join(rank, world, port)
    model, placement = laid_out_model(SIZES[spec["size"]], "sdpa", spec["plan"], rank, world)
    full = {k: v.detach() for k, v in get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)).items()}
    expected = _checksums(full) if rank == 0 else {}
    once = set(distinct_tensors(model.state_dict()))  # a sharded version carries a tied LM head once, by its first name
    del full
    node = ShardNode()
    addresses: list[Any] = [None] * world
    dist.all_gather_object(addresses, node.address)
    proc = (subprocess.Popen([sys.executable, __file__, "--puller"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True) if rank == 0 else None)
    reps: list[dict[str, Any]] = []
    for version in range(1, spec["reps"] + 1):
        dist.barrier()
        start = time.monotonic()
        if spec["method"] == "sharded":
            pieces = shard_pieces(model.state_dict(), placement)
            holders: list[Any] = [None] * world
            dist.all_gather_object(holders, bool(pieces))
            peers = [a for r, a in enumerate(addresses) if holders[r] and r != rank]
            publish_weights(node, version, pieces, peers=peers if rank == 0 else [])
        else:
            state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
            if rank == 0:
                publish_weights(node, version, state)
            del state
        dist.barrier()  # every rank's pieces are in its node before the version is announced
        publish = time.monotonic() - start
        if proc is not None:
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write(f"{node.address} {version}\n")
            proc.stdin.flush()
            got = json.loads(proc.stdout.readline())
            bad = [k for k, v in expected.items() if abs(got["checksums"].get(k, float("nan")) - v) > 1e-6 * (1 + abs(v))]
            missing = sorted(set(expected) - set(got["checksums"]) - (set(expected) - once))
            extra = sorted(set(got["checksums"]) - set(expected))
            if bad or missing or extra:
                raise SystemExit(f"{spec}: assembled weights differ from the full state dict: values of {bad[:5]}, "
                                 f"missing {missing[:5]}, extra {extra[:5]}")
            reps.append({"publish_seconds": publish, "pull_seconds": got["pull_seconds"], "bytes": got["bytes"],
                         "tensors": got["tensors"], "transport": got["transport"]})
        dist.barrier()  # the puller is done with this version
        drop_weights(node, version)
    if proc is not None:
        assert proc.stdin is not None
        proc.stdin.write("\n")
        proc.stdin.close()
        proc.wait(timeout=60)
    node.close()
    dist.destroy_process_group()
    return {"rank": rank, "reps": reps, "published_bytes_this_rank": sum(p.tensor.nbytes for p in
                                                                          shard_pieces(model.state_dict(), placement))}


def run(sizes: list[str], reps: int) -> dict[str, Any]:
    from bench.ranks import launch
    from earl_stream.supervisor.model_shape import ModelShape

    rows = []
    print(f"  {'size':4s} {'plan':6s} {'method':8s} {'MiB':>7s} {'publish s':>10s} {'pull s':>8s} {'total s':>8s}  transport")
    for size in sizes:
        for plan in PLANS:
            for method in METHODS:
                spec = {"size": size, "plan": plan, "method": method, "reps": reps}
                ranks = launch(__file__, ["--rank-child", json.dumps(spec)], 2)
                r0 = ranks[0]["reps"]
                row = {**spec, "bytes": r0[0]["bytes"], "tensors": r0[0]["tensors"], "transport": r0[0]["transport"],
                       "publish_seconds": statistics.median(r["publish_seconds"] for r in r0),
                       "pull_seconds": statistics.median(r["pull_seconds"] for r in r0),
                       "total_seconds": statistics.median(r["publish_seconds"] + r["pull_seconds"] for r in r0),
                       "published_bytes_per_rank": [r["published_bytes_this_rank"] for r in ranks], "all_reps": r0}
                rows.append(row)
                print(f"  {size:4s} {plan:6s} {method:8s} {row['bytes'] / 2**20:7.1f} {row['publish_seconds']:10.4f} "
                      f"{row['pull_seconds']:8.4f} {row['total_seconds']:8.4f}  {row['transport']}", flush=True)
    speedup = {}
    for size in sizes:
        for plan in PLANS:
            by = {r["method"]: r["total_seconds"] for r in rows if r["size"] == size and r["plan"] == plan}
            speedup[f"{size}_{plan}"] = by["full"] / by["sharded"]
    params = {k: ModelShape.from_hf({**v, "model_type": "qwen2"}).num_params() for k, v in SIZES.items()}
    return {"sizes": {k: {**SIZES[k], "params": params[k]} for k in sizes}, "ranks": 2, "dtype": "float32",
            "repetitions": reps, "configs": rows, "full_over_sharded_total_seconds": speedup}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default="bench/results/weight_sync.json", help="where to write the results")
    ap.add_argument("--quick", action="store_true", help="the ~1M model only, 3 repetitions")
    ap.add_argument("--reps", type=int, default=5, help="publish + pull repetitions per configuration")
    ap.add_argument("--puller", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank-child", help=argparse.SUPPRESS)
    for flag in ("--rank", "--world", "--port"):
        ap.add_argument(flag, type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.puller:
        puller()
        return 0
    if args.rank_child:
        print(json.dumps(rank_child(json.loads(args.rank_child), args.rank, args.world, args.port)))
        return 0
    start = time.monotonic()
    sizes = ["1M"] if args.quick else list(SIZES)
    print(f"weight sync on 2 gloo trainer ranks: sharded publish + pull vs rank-0 full copy ({'quick' if args.quick else 'full'})")
    result = run(sizes, 3 if args.quick else args.reps)
    for k, v in result["full_over_sharded_total_seconds"].items():
        print(f"  {k}: full copy / sharded (publish + pull) = {v:.2f}x")
    result.update(quick=args.quick, seconds=round(time.monotonic() - start, 1))
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_result(out, result, indent=2)
    print(f"wrote {out} in {result['seconds']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
