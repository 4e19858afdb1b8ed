"""Mixture of experts: routing replay (R3) on a tiny MoE learning Tic-Tac-Toe, and trainer plans' tokens/s.

    python bench/moe.py --minutes 15 --json bench/results/moe.json [--quick]

What it measures:
- A tiny Qwen3-MoE (8 experts, top-2, hidden 64, 2 layers; `model.tiny_moe.init_moe_model`) warm-started
  briefly on synthetic legal Tic-Tac-Toe play (`model.warm_start`), then trained by `earl-stream up` on 2
  trainer ranks for `--minutes` each, with `algo.routing_replay=rollout` and with `none`. Every `--every`
  seconds the supervisor's status gives the last step's trainer metrics (rank 0's StepResult, the values of
  its `earl_trainer_logprob_mismatch` and `earl_trainer_routing_mismatch` gauges) and the win rate over the
  last games (the learning curve). `routing_mismatch` / `logprob_mismatch`: their means over the steps.
  The routing mismatch is the trainer's own routers against the rollout's recorded choices, so it is the
  same kind of number with and without replay (replay does not change what the router would choose; it
  makes the forward use the rollout's choices): the log-prob mismatch is what replay should shrink.
- Tokens/s of one training step (forward, backward, AdamW; packed micro-batches) of the same MoE under
  dp2, fsdp2 and ep2 (experts split over the 2 ranks, tokens dispatched by all-to-all) on 2 gloo ranks, at
  two context lengths (same tokens per step), median over the steps after
  the first of `--rounds` launches per plan taken in turn, and the parallelism selector's choice for a
  2-rank pool at each length (`supervisor.planning`).
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
from pipeline_rates import start_up  # noqa: E402
from provenance import write_result  # noqa: E402
from ranks import join, launch, rank_plan  # noqa: E402

log = logging.getLogger("bench.moe")
MOE = {"family": "qwen3_moe", "experts": 8, "top_k": 2, "hidden_size": 64, "num_layers": 2, "expert_size": 96}
PLANS = ("dp2", "fsdp2", "ep2")
DEPENDS_ON = ["earl_stream/model/moe.py", "earl_stream/model/moe_config.py", "earl_stream/model/tiny_moe.py",
              "earl_stream/workers/routing_replay.py", "earl_stream/workers/engines/routing.py",
              "earl_stream/workers/train_step.py", "earl_stream/workers/sharding.py", "earl_stream/supervisor",
              "earl_stream/workers/expert_parallel.py", "earl_stream/workers/engines", "bench/moe.py"]


def make_model(out: Path, warm_seconds: float) -> Path:
    """The tiny MoE, warm-started on Tic-Tac-Toe for `warm_seconds` (it then knows the format)."""
    import torch

    from earl_stream.model import warm_start
    from earl_stream.model.tiny_moe import init_moe_model

    model_dir = init_moe_model(out, **MOE)  # type: ignore[arg-type]
    torch.set_num_threads(2)
    report = warm_start(model_dir, "tictactoe", seconds=warm_seconds, eval_games=0)
    log.info("warm start: %s", report)
    return model_dir


def learning_run(model_dir: Path, replay: str, minutes: float, every: float, run_dir: Path) -> list[dict]:
    """`earl-stream up` on 2 trainer ranks for `minutes`: one point per `every` seconds with a new step."""
    from earl_stream import protocol as P
    from earl_stream.errors import EarlError

    cmd = [sys.executable, "-m", "earl_stream", "up", f"run_dir={run_dir}", f"model.path={model_dir}",
           "trainer.nproc=2", f"algo.routing_replay={replay}", "supervisor.stats_window=256"]
    proc, client = start_up(cmd, run_dir, what=f"routing_replay={replay}", wait_s=0.5)
    curve: list[dict] = []
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
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
    return curve


def _mean(curve: list[dict], key: str) -> float | None:
    vals = [p[key] for p in curve if p.get(key) is not None]
    return round(statistics.mean(vals), 6) if vals else None


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default="bench/results/moe.json")
    ap.add_argument("--minutes", type=float, default=15.0, help="training minutes of each learning run (replay, none)")
    ap.add_argument("--quick", action="store_true", help="2-minute learning runs, 3 throughput steps")
    ap.add_argument("--warm-seconds", type=float, default=60.0, help="supervised warm start of the tiny MoE")
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
        args.minutes, args.steps, args.rounds = min(args.minutes, 2.0), min(args.steps, 3), 1
    with tempfile.TemporaryDirectory(prefix="earl-moe-bench-") as tmp_name:
        tmp = Path(tmp_name)
        model_dir = make_model(tmp / "moe", args.warm_seconds)
        tokens: dict[str, dict[str, float | None]] = {
            str(n): dict(plans_tokens_per_s(model_dir, n, args.step_tokens, args.steps, args.rounds))
            for n in args.lengths}
        choice = {str(n): selector_choice(model_dir, n, tmp) for n in args.lengths}
        curves = {name: learning_run(model_dir, mode, args.minutes, args.every, tmp / f"run-{mode}")
                  for name, mode in (("replay", "rollout"), ("no_replay", "none"))}
    for n in map(str, args.lengths):
        faster = max(PLANS, key=lambda p: tokens[n][p] or 0.0)
        choice[n]["faster_measured"] = faster
        choice[n]["matches_faster"] = (choice[n].get("plan") or "").split("+")[0] == faster
    result = {
        "model": {**MOE, "warm_start_seconds": args.warm_seconds},
        "minutes_per_run": args.minutes, "trainer_ranks": 2,
        "routing_mismatch": {k: _mean(c, "routing_mismatch") for k, c in curves.items()},
        "logprob_mismatch": {k: _mean(c, "logprob_mismatch") for k, c in curves.items()},
        "final_win_rate": {k: (c[-1]["win"] if c else None) for k, c in curves.items()},
        "steps": {k: (c[-1]["step"] if c else 0) for k, c in curves.items()},
        "plans_tokens_per_s": tokens, "selector_choice": choice,
        "throughput": {"step_tokens": args.step_tokens, "steps": args.steps, "rounds": args.rounds, "packing": True,
                       "threads_per_rank": 1},
        "notes": "Mismatches are rank 0's per-step values (supervisor status), averaged over the steps seen.",
        "curves": curves,
    }
    write_result(Path(args.json), result, depends_on=DEPENDS_ON)
    print(json.dumps({k: v for k, v in result.items() if k != "curves"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
