"""Mixture of experts: routing replay (R3) where only routing differs, in learning, and trainer plans' tokens/s.

    python bench/moe.py --minutes 3 --json bench/results/moe.json [--skip-plans] [--quick]

What it measures (a tiny Qwen3-MoE, 8 experts, top-2, hidden 64, 4 layers: `moe_replay.MODEL`):
- Equal weights (`moe_replay`): engine and trainer log-probs of tokens sampled by the same weights in bf16, with
  and without replay, `--equal-seeds` repeats: the routing decisions that differ and KL(engine || trainer).
  No policy lag, so what differs between the arms is routing alone.
- Learning: the MoE warm-started briefly on synthetic legal Tic-Tac-Toe play (`model.warm_start`), then trained
  by `earl-stream up` on 2 trainer ranks for `--minutes` per run, both sides bf16, `trainer.max_staleness=
  --staleness`, with `algo.routing_replay=rollout` and `none`, `--seeds` runs each (seeds outer, arms inner, the
  arm order alternating). Every `--every` seconds the supervisor's status gives the last step's trainer
  metrics and the mean reward and win rate over the last games (the curve); the summary is the final reward
  (mean of the last 3 points) and the collapses (`moe_replay.learning_summary`).
- Tokens/s of one training step (forward, backward, AdamW; packed micro-batches) of the same MoE under
  dp2, fsdp2 and ep2 (experts split over the 2 ranks, tokens dispatched by all-to-all) on 2 gloo ranks, at
  two context lengths (same tokens per step), median over the steps after the first of `--rounds` launches
  per plan taken in turn, and the parallelism selector's choice for a 2-rank pool at each length
  (`supervisor.planning`). `--skip-plans` keeps the previous result's figures, marked with the run they
  come from.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moe_replay import ARMS, MODEL, definitions, equal_weights_repeat, learning_summary, summarise_equal  # noqa: E402
from pipeline_rates import start_up  # noqa: E402
from provenance import write_result  # noqa: E402
from ranks import join, launch, rank_plan  # noqa: E402

log = logging.getLogger("bench.moe")
MOE = MODEL
PLAN_KEYS = ("plans_tokens_per_s", "selector_choice", "throughput")
PLANS = ("dp2", "fsdp2", "ep2")
DEPENDS_ON = ["earl_stream/model/moe.py", "earl_stream/model/moe_config.py", "earl_stream/model/tiny_moe.py",
              "earl_stream/workers/routing_replay.py", "earl_stream/workers/engines/routing.py",
              "earl_stream/workers/train_step.py", "earl_stream/workers/sharding.py", "earl_stream/supervisor",
              "earl_stream/workers/expert_parallel.py", "earl_stream/workers/engines", "bench/moe.py",
              "bench/moe_replay.py"]


def make_model(out: Path, warm_steps: int, warm_seconds: float) -> tuple[Path, int]:
    """The tiny MoE, warm-started on Tic-Tac-Toe for `warm_steps` steps (it then knows the format; at most
    `warm_seconds`: a count of steps, not a time, so the machine's load does not change the start)."""
    import torch

    from earl_stream.model import warm_start
    from earl_stream.model.tiny_moe import init_moe_model

    model_dir = init_moe_model(out, **MOE)  # type: ignore[arg-type]
    torch.set_num_threads(2)
    report = warm_start(model_dir, "tictactoe", seconds=warm_seconds, max_steps=warm_steps, eval_games=0)
    log.info("warm start: %s", report)
    return model_dir, report.steps


def learning_run(model_dir: Path, replay: str, minutes: float, every: float, run_dir: Path, seed: int,
                 staleness: int) -> dict[str, Any]:
    """`earl-stream up` on 2 trainer ranks for `minutes` (both sides bf16, `trainer.max_staleness=staleness`):
    {"seed", "curve": one point per `every` seconds with a new step, "exit_code": None unless the run
    stopped on its own}."""
    from earl_stream import protocol as P
    from earl_stream.errors import EarlError

    cmd = [sys.executable, "-m", "earl_stream", "up", f"run_dir={run_dir}", f"model.path={model_dir}", f"seed={seed}",
           "trainer.nproc=2", f"algo.routing_replay={replay}", "supervisor.stats_window=256", "rollout.dtype=bf16",
           "trainer.dtype=bf16", f"trainer.max_staleness={staleness}"]
    proc, client = start_up(cmd, run_dir, what=f"routing_replay={replay}", wait_s=0.5)
    curve: list[dict] = []
    exit_code = None
    try:
        start = time.monotonic()
        while time.monotonic() - start < minutes * 60 and proc.poll() is None:
            time.sleep(every)
            try:
                s = json.loads(client.call(P.StatusRequest()).status_json)
            except EarlError:
                continue
            trainer = s.get("trainer") or {}
            if "mismatch" not in trainer or (curve and curve[-1]["step"] == s["policy_version"]):
                continue
            point = {"t": round(time.monotonic() - start, 1), "step": s["policy_version"],
                     "logprob_mismatch": trainer["mismatch"], "routing_mismatch": trainer.get("routing_mismatch"),
                     "reward": s.get("mean_reward_last"), "win": s.get("win_rate_last"),
                     "episodes": s.get("samples_produced")}
            curve.append(point)
            log.info("%s: %s", replay, json.dumps(point))
        exit_code = proc.poll()
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
    return {"seed": seed, "curve": curve, "exit_code": exit_code}


# --- tokens/s of a plan (one process per rank, `--rank` mode) -----------------------------------------


def _claim(seq_len: int, sequences: int, vocab: int, step: int) -> tuple[list[Any], Any]:
    import numpy as np

    from earl_stream.store.schema import SCHEMA_VERSION, SampleMeta, sample_key

    rng = np.random.default_rng(step)
    rows, metas = {}, []
    for i in range(sequences):
        sid = f"s{step}-{i}"
        mask = (np.arange(seq_len) >= 16).astype(np.uint8)
        rows[sample_key(sid, "input_ids")] = rng.integers(5, vocab, seq_len).astype(np.int32)
        rows[sample_key(sid, "loss_mask")] = mask
        rows[sample_key(sid, "behaviour_logprobs")] = (mask * -np.log(vocab)).astype(np.float32)
        metas.append(SampleMeta(schema_version=SCHEMA_VERSION, sample_id=sid, prompt_ordinal=i // 4, episode_id=sid,
                                group_id=f"g{step}-{i // 4}", env="bench", turns=1, prompt_tokens=16,
                                response_tokens=seq_len - 16, total_tokens=seq_len, reward=float(rng.random()),
                                advantage=None, policy_version_min=step, policy_version_max=step, producer_id="p",
                                producer_address="local", checksum=0, created_at=0.0, info_json="{}"))
    return metas, _LocalPuller(rows)


class _LocalPuller:
    """The store's Puller interface over rows held in this process (the producers' network edge)."""

    def __init__(self, rows: dict[str, Any]) -> None:
        self.rows = rows

    def pull_many(self, requests: dict[str, list[tuple[str, int, int]]], **_: Any) -> dict[str, Any]:
        return {addr: [self.rows[k][s:e].copy() for k, s, e in pieces] for addr, pieces in requests.items()}


def rank_main(args: argparse.Namespace) -> None:
    """One rank: the MoE laid out under `--plan`, `--steps` train steps; prints its step wall times."""
    import torch

    from earl_stream.config import TrainerConfig
    from earl_stream.model import load_model
    from earl_stream.workers.mesh import TrainerMesh
    from earl_stream.workers.sharding import apply_plan, shard_model
    from earl_stream.workers.train_step import train_step

    join(args.rank, args.world, args.port)
    model, _ = load_model(args.model)
    model.train()
    placement = TrainerMesh(args.world, args.rank, torch.device("cpu")).placement(rank_plan(args.plan))
    shard_model(model, placement)
    apply_plan(model, placement)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    cfg = TrainerConfig(micro_batch_tokens=max(args.seq_len, 2048), packing=True)
    walls = []
    for step in range(args.steps):
        metas, puller = _claim(args.seq_len, args.sequences, int(model.config.vocab_size), step)
        t0 = time.monotonic()
        train_step(model, optimizer, metas, placement.layout, puller, cfg, rank=args.rank, placement=placement, step=step)
        walls.append(time.monotonic() - t0)
    print(json.dumps({"walls": walls, "tokens": args.seq_len * args.sequences}))


def plan_walls(model_dir: Path, plan: str, seq_len: int, tokens: int, steps: int) -> tuple[int, list[float]]:
    """(tokens per step, wall seconds of each step after the first) of `plan` on 2 fresh ranks."""
    outs = launch(__file__, ["--rank-mode", "--model", str(model_dir), "--plan", plan, "--seq-len", str(seq_len),
                             "--sequences", str(max(1, tokens // seq_len)), "--steps", str(steps)], 2, timeout_s=1200)
    walls = [max(w) for w in zip(*(o["walls"] for o in outs))][1:]  # a step ends when its slowest rank does
    return int(outs[0]["tokens"]), walls


def plans_tokens_per_s(model_dir: Path, seq_len: int, tokens: int, steps: int, rounds: int) -> dict[str, float]:
    """Tokens/s of each plan at `seq_len`: the plans run in turn, `rounds` times (the shared machine's load
    drifts), tokens per step over the median step wall time of all rounds."""
    walls: dict[str, list[float]] = {p: [] for p in PLANS}
    per_step = 0
    for _ in range(rounds):
        for plan in PLANS:
            per_step, w = plan_walls(model_dir, plan, seq_len, tokens, steps)
            walls[plan] += w
    return {p: round(per_step / statistics.median(w), 1) for p, w in walls.items()}


def selector_choice(model_dir: Path, seq_len: int, tmp: Path) -> dict[str, Any]:
    """The plan the supervisor's selector starts a 2-rank pool of this model on, designed for `seq_len`."""
    from earl_stream.config import RunConfig, replace
    from earl_stream.supervisor.planning import Planner
    from earl_stream.supervisor.selector import layout_name

    cfg = replace(RunConfig(), f"model.path={model_dir}", f"run_dir={tmp / f'sel{seq_len}'}", "trainer.nproc=2",
                  f"selector.initial_seq_len={seq_len}")
    planner = Planner(cfg)
    decision = planner.trainer_plan
    if decision is None:
        return {"plan": None, "reason": planner.last_infeasible}
    refused = [f"{r.plan}: {r.reason}" for r in planner.trainer.refused] if planner.trainer else []
    return {"plan": layout_name(decision.plan), "micro_batch_tokens": decision.micro_batch_tokens, "refused": refused}


def measure_plans(model_dir: Path, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """The plans' tokens/s at both lengths, and the selector's choice against the faster measured plan."""
    tokens: dict[str, dict[str, float]] = {
        str(n): plans_tokens_per_s(model_dir, n, args.step_tokens, args.steps, args.rounds) for n in args.lengths}
    choice = {str(n): selector_choice(model_dir, n, tmp) for n in args.lengths}
    for n in map(str, args.lengths):
        faster = max(PLANS, key=lambda p: tokens[n][p] or 0.0)
        choice[n]["faster_measured"] = faster
        choice[n]["matches_faster"] = (choice[n].get("plan") or "").split("+")[0] == faster
    return {"plans_tokens_per_s": tokens, "selector_choice": choice,
            "throughput": {"step_tokens": args.step_tokens, "steps": args.steps, "rounds": args.rounds,
                           "packing": True, "threads_per_rank": 1, "model": MOE}}


def carried_plans(path: Path) -> dict[str, Any]:
    """The plan figures of the result at `path` (`--skip-plans`), marked with the run that measured them."""
    old = json.loads(path.read_text()) if path.exists() else {}
    if not all(k in old for k in PLAN_KEYS):
        raise SystemExit(f"--skip-plans: {path} holds no plan figures to keep; run without it")
    prov = old.get("provenance", {})
    throughput = old["throughput"]
    throughput.setdefault("model", old.get("model"))
    throughput["measured_by"] = {"when": prov.get("when"), "commit": prov.get("commit")}
    return {k: old[k] for k in PLAN_KEYS}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default="bench/results/moe.json")
    ap.add_argument("--equal-seeds", type=int, default=5, help="repeats (seeds) of the equal-weights comparison")
    ap.add_argument("--requests", type=int, default=32, help="engine requests per equal-weights repeat")
    ap.add_argument("--seeds", type=int, default=3, help="learning runs per arm (replay, none)")
    ap.add_argument("--minutes", type=float, default=3.0, help="training minutes of each learning run")
    ap.add_argument("--staleness", type=int, default=2, help="trainer.max_staleness of the learning runs")
    ap.add_argument("--quick", action="store_true", help="2 repeats of each part, 1-minute runs, 3 throughput steps")
    ap.add_argument("--skip-plans", action="store_true", help="keep the plan figures of the previous --json")
    ap.add_argument("--warm-steps", type=int, default=300, help="supervised warm-start steps of the tiny MoE")
    ap.add_argument("--warm-seconds", type=float, default=600.0, help="at most this long for the warm start")
    ap.add_argument("--every", type=float, default=5.0, help="seconds between status polls")
    ap.add_argument("--lengths", type=int, nargs=2, default=[256, 2048], help="two context lengths (tokens/s)")
    ap.add_argument("--step-tokens", type=int, default=4096, help="tokens per throughput step (both lengths)")
    ap.add_argument("--steps", type=int, default=6, help="throughput steps per plan and length (the first is warm-up)")
    ap.add_argument("--rounds", type=int, default=2, help="times each plan's throughput is measured, in turn")
    ap.add_argument("--rank-mode", action="store_true", help=argparse.SUPPRESS)
    for name, kind in (("--rank", int), ("--world", int), ("--port", int), ("--model", str), ("--plan", str),
                       ("--seq-len", int), ("--sequences", int)):
        ap.add_argument(name, type=kind, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_mode:
        rank_main(args)
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.quick:
        args.equal_seeds, args.seeds, args.minutes, args.steps, args.rounds = 2, 2, min(args.minutes, 1.0), 3, 1
    import torch

    torch.set_num_threads(2)
    plans = carried_plans(Path(args.json)) if args.skip_plans else None
    with tempfile.TemporaryDirectory(prefix="earl-moe-bench-") as tmp_name:
        tmp = Path(tmp_name)
        equal = []
        for seed in range(args.equal_seeds):
            equal.append(equal_weights_repeat(tmp, seed, args.requests))
            log.info("equal weights: %s", json.dumps(equal[-1]))
        model_dir, warm_steps = make_model(tmp / "moe", args.warm_steps, args.warm_seconds)
        runs: dict[str, list[dict]] = {arm: [] for arm in ARMS}
        for seed in range(args.seeds):
            for arm in (list(ARMS) if seed % 2 == 0 else list(ARMS)[::-1]):
                runs[arm].append(learning_run(model_dir, ARMS[arm], args.minutes, args.every,
                                              tmp / f"run-{arm}-{seed}", seed, args.staleness))
        plans = plans or measure_plans(model_dir, args, tmp)
    summary = summarise_equal(equal)
    learning = learning_summary(runs)
    result = {
        "model": {**MOE, "warm_start_steps": warm_steps},
        "routing_mismatch_equal_weights": {arm: summary["routing_mismatch"][arm] for arm in ARMS},
        "logprob_kl_equal_weights": {arm: summary["kl_k3"][arm] for arm in ARMS},
        "logprob_abs_diff_equal_weights": {arm: summary["mean_abs_logprob_diff"][arm] for arm in ARMS},
        "kl_ratio_replay_over_no_replay": summary["kl_ratio_replay_over_no_replay"],
        "goal": "KL at equal weights with replay <= 0.5x without (upper end of the ratio's 95% interval)",
        "goal_met": summary["goal_met"],
        "learning": learning,
        "definitions": definitions(),
        "equal_weights": {"repeats": equal, "requests": args.requests, "engine": "torch, bf16 weights, continuous "
                          "batching (8 rows), KV-cache decode, temperature 1", "trainer": "fp32 master weights (the "
                          "same bf16-rounded values), bf16 autocast, packed micro-batches of <= 1024 tokens"},
        "learning_runs": {"minutes_per_run": args.minutes, "max_staleness": args.staleness, "trainer_ranks": 2,
                          "dtype": "bf16 (rollout and trainer)", "runs": runs},
        **plans,
    }
    write_result(Path(args.json), result, depends_on=DEPENDS_ON)
    print(json.dumps({k: v for k, v in result.items() if k not in ("equal_weights", "learning_runs")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
