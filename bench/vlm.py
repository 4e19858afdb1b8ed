"""Vision-language agents: the embedded vision-language model's learning curve, the built-in engine's KV reuse
across image turns, and the trainer's layout-exact pull of the pictures.

    python bench/vlm.py [--repeats 3] [--seconds 60] [--up-steps 4] [--learn-seeds 3] [--learn-seconds 900] \
        --json bench/results/vlm.json

`kv_reuse` (engine only, `--seconds` per run, arms interleaved `--repeats` times): a tiny Idefics3 model
(`model.tiny_vlm.init_vlm_model`: hidden 256, 4 layers, a 2-layer tower of width 128, 96 x 96 pictures = 9
image tokens, one per board cell) plays `--episodes` image Tic-Tac-Toe episodes at once behind the rollout
worker's batcher, rendered by `VisionChat` exactly as the agent loop does. The model is random, so the board
side plays a random legal move whatever it replied (its reply stays in the context, as the agent loop keeps
it): every episode runs to the end of a game, a picture per turn. Arm `reuse` names each episode's KV
(`GenerateRequest.cache_key`: a turn prefills only its new tokens and encodes only its new picture), arm
`no_reuse` does not (every turn prefills the whole episode and encodes every picture again). Reported per
run: generated tokens/s, turns/s, prefilled tokens and the wall time; `kv_reuse_speedup` is reuse's turns/s
over no_reuse's (ratio of means with its 95% interval, `bench/stats.py`).

`pull` (`--up-steps` steps of `earl-stream up` per plan, two trainer ranks, the same tiny model on
`tictactoe_image`): per rank and step, the PNG bytes the rank pulled against the bytes of every picture of the
step's claim (the trainer's log line `N images pulled (B bytes of PNG, of the step's T)`). Under dp2 a rank
pulls its own samples' pictures; under sp2 each rank pulls the pictures its half of every sample meets (a
picture cut by the slice boundary goes to both). `pull_bytes_fraction` is the mean per plan.

`learning` (`--learn-seeds` runs of `--learn-seconds` each, a seed apiece): `earl-stream up
model.path=default:tictactoe_image envs.0.spec=tictactoe_image` as a user starts it (the embedded vision-language
model: a tiny Idefics3 warm-started on rendered boards with random legal play, `model.default`), every other
setting at its default. Per seed: seconds from launch to the first poll whose win rate over the last
`--window` games reaches `--target` (`seconds_to_0_8`; null when not reached), the win rate at the end
(`final_win_rate`) and at the first poll that saw one (`start_win_rate`), and the curve (a poll every few seconds).

A part skipped (`--seconds 0`, `--up-steps 0`, `--learn-seeds 0`) keeps its keys from the file `--json` names, with
the provenance it was measured at (`part_provenance`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ARMS = ("reuse", "no_reuse")
LEARN_KEYS = ("learning", "final_win_rate", "seconds_to_0_8", "start_win_rate", "learn_seconds", "target_win_rate",
              "stats_window", "learn_machine", "not_measured")
KV_KEYS = ("kv_reuse", "kv_reuse_speedup", "repeats", "seconds_per_run", "episodes_at_once", "model")
PULL_KEYS = ("pull", "pull_bytes_fraction")
PULL_LINE = re.compile(r"step (\d+): (\d+) images pulled \((\d+) bytes of PNG, of the step's (\d+)\)")
MODEL = dict(family="idefics3", hidden_size=256, num_layers=4, intermediate_size=512, vision_hidden_size=128,
             image_size=96)


def build_model(where: Path) -> Path:
    from earl_stream.model.tiny_vlm import init_vlm_model

    return init_vlm_model(where / "vlm", **MODEL)  # type: ignore[arg-type]


def kv_run(model_dir: Path, arm: str, seconds: float, episodes: int, seed: int) -> dict[str, Any]:
    """One engine-only run of arm `arm` (see the module docstring)."""
    import torch

    from earl_stream.env import resolve_env
    from earl_stream.env.images import observation_text
    from earl_stream.model import load_policy
    from earl_stream.model.vision import VisionChat
    from earl_stream.workers.engines import AsyncBatcher, GenerateRequest, TorchEngine

    torch.manual_seed(seed)
    policy = load_policy(model_dir)
    chat = VisionChat(policy.processor)
    engine = TorchEngine(policy.model.eval(), seed=seed)
    factory = resolve_env("tictactoe_image")
    rng = random.Random(seed)
    totals = {"tokens": 0, "turns": 0, "episodes": 0}

    async def play(batcher: AsyncBatcher, slot: int, end: float) -> None:
        while time.monotonic() < end:
            env = factory()
            ids, images = chat.first_turn(env.system_prompt, await env.reset(rng.getrandbits(31)))
            key = f"{slot}-{totals['episodes']}" if arm == "reuse" else None
            while time.monotonic() < end:
                req = GenerateRequest(ids, 3, stop_token_ids=frozenset(chat.stop_token_ids), temperature=1.0,
                                      cache_key=key, images=tuple(chat.prompt_image(i) for i in images))
                res = await batcher.generate(req)
                reply = list(res.token_ids)
                if not reply or reply[-1] not in chat.stop_token_ids:
                    reply.append(chat.end_token_id)
                ids = ids + reply
                totals["tokens"] += len(res.token_ids)
                totals["turns"] += 1
                result = await env.step(str(rng.choice(env.legal_moves())))
                if result.done:
                    break
                nxt, more = chat.next_turn(result.observation if result.observation else observation_text(""))
                images = images + [type(i)(i.start + len(ids), i.tokens, i.image) for i in more]
                ids = ids + nxt
            totals["episodes"] += 1

    async def go() -> float:
        batcher = AsyncBatcher(engine)
        start = time.monotonic()
        await asyncio.gather(*[play(batcher, s, start + seconds) for s in range(episodes)])
        wall = time.monotonic() - start
        await batcher.aclose()
        return wall

    wall = asyncio.run(go())
    stats = engine.stats
    return {"arm": arm, "seed": seed, "tokens_per_s": round(totals["tokens"] / wall, 2),
            "turns_per_s": round(totals["turns"] / wall, 3), "turns": totals["turns"], "episodes": totals["episodes"],
            "prefill_tokens": int(stats.prefill_tokens), "reused_tokens": int(stats.reused_tokens),
            "wall_s": round(wall, 2)}


def summarise_kv(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per arm its runs and turns/s with a 95% interval; `kv_reuse_speedup` reuse over no_reuse (ratio of means).
    ValueError when an arm's runs are not its own or both arms ran the same configuration."""
    sys.path.insert(0, str(HERE))
    from stats import mean_ci95, ratio_ci95

    by_arm = {arm: [r for r in runs if r["arm"] == arm] for arm in ARMS}
    if any(r["arm"] not in ARMS for r in runs):
        raise ValueError(f"runs of unknown arms: {sorted({r['arm'] for r in runs} - set(ARMS))}")
    rates = {arm: [r["turns_per_s"] for r in rs] for arm, rs in by_arm.items()}
    out: dict[str, Any] = {"runs": by_arm}
    if all(len(v) >= 2 for v in rates.values()):
        out["turns_per_s"] = {arm: mean_ci95(v) for arm, v in rates.items()}
        out["kv_reuse_speedup"] = ratio_ci95(rates["reuse"], rates["no_reuse"])
    elif all(rates.values()):
        out["kv_reuse_speedup"] = {"ratio": (sum(rates["reuse"]) / len(rates["reuse"]))
                                   / (sum(rates["no_reuse"]) / len(rates["no_reuse"]))}
    return out


def pull_run(model_dir: Path, plan: str, steps: int, work: Path) -> dict[str, Any]:
    """`earl-stream up --steps STEPS` with two trainer ranks under `plan`; the per rank and step pull shares."""
    run_dir = work / plan
    cmd = [sys.executable, "-m", "earl_stream", "up", "--steps", str(steps), f"model.path={model_dir}",
           f"run_dir={run_dir}", "envs.0.spec=tictactoe_image", "trainer.nproc=2", "trainer.groups_per_step=2",
           "trainer.group_size=4", f"selector.plans={plan}", "supervisor.heartbeat_s=0.2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        raise SystemExit(f"up under {plan} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    shares = []
    for log in sorted((run_dir / "logs").glob("trainer*.log")):
        for m in PULL_LINE.finditer(log.read_text()):
            step, _, mine, total = map(int, m.groups())
            shares.append({"log": log.name, "step": step, "bytes": mine, "step_bytes": total,
                           "fraction": round(mine / total, 4) if total else None})
    if not shares:
        raise SystemExit(f"up under {plan}: no pull lines in {run_dir}/logs")
    fractions = [s["fraction"] for s in shares if s["fraction"] is not None]
    return {"plan": plan, "steps": steps, "per_rank_step": shares,
            "mean_fraction": round(sum(fractions) / len(fractions), 4)}


def learn_run(seconds: float, target: float, window: int, seed: int, work: Path) -> dict[str, Any]:
    """One `earl-stream up` on the embedded image Tic-Tac-Toe model for `seconds` from launch (see the docstring)."""
    sys.path.insert(0, str(HERE))
    from pipeline_rates import watch_up

    run_dir = work / f"learn{seed}"
    args = ["model.path=default:tictactoe_image", "envs.0.spec=tictactoe_image", f"run_dir={run_dir}", f"seed={seed}",
            f"supervisor.stats_window={window}"]
    watch = watch_up(args, run_dir, lambda now, first: now.t >= seconds, what=f"learning seed {seed}", poll_s=2.0)
    curve = [{"t": snap.t, "step": snap.step, "win": snap.status.get("win_rate_last"),
              "games": snap.status.get("samples_produced")} for snap in watch.snapshots]
    seen = [p for p in curve if p["win"] is not None]
    reached = next((p["t"] for p in seen if p["win"] >= target), None)
    return {"seed": seed, "seconds_to_target": reached, "final_win_rate": seen[-1]["win"] if seen else None,
            "start_win_rate": seen[0]["win"] if seen else None, "steps": curve[-1]["step"] if curve else 0,
            "wall_s": curve[-1]["t"] if curve else 0.0, "curve": curve[::5] + curve[-1:]}


def summarise_learning(runs: list[dict[str, Any]], target: float) -> dict[str, Any]:
    """`final_win_rate`, `seconds_to_0_8`, `start_win_rate`: a list per seed; with the runs and means."""
    sys.path.insert(0, str(HERE))
    from stats import mean_ci95

    finals = [r["final_win_rate"] for r in runs]
    to_target = [r["seconds_to_target"] for r in runs]
    out: dict[str, Any] = {"learning": {"runs": runs}, "final_win_rate": finals, "seconds_to_0_8": to_target,
                           "start_win_rate": [r["start_win_rate"] for r in runs], "target_win_rate": target}
    if len(runs) >= 2 and all(f is not None for f in finals):
        out["learning"]["final_win_rate"] = mean_ci95(finals)
    if len(runs) >= 2 and all(t is not None for t in to_target):
        out["learning"]["seconds_to_target"] = mean_ci95(to_target)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3, help="runs per arm of the KV-reuse part, interleaved")
    ap.add_argument("--seconds", type=float, default=60.0, help="seconds per KV-reuse run (0 skips that part)")
    ap.add_argument("--episodes", type=int, default=8, help="episodes played at once in a KV-reuse run")
    ap.add_argument("--up-steps", type=int, default=4, help="training steps per plan of the pull part (0 skips it)")
    ap.add_argument("--plans", default="dp2,sp2", help="trainer plans of the pull part")
    ap.add_argument("--learn-seeds", type=int, default=3, help="learning runs, one per seed (0 skips that part)")
    ap.add_argument("--learn-seconds", type=float, default=900.0, help="seconds from launch per learning run")
    ap.add_argument("--target", type=float, default=0.8, help="win rate the learning runs report the time to")
    ap.add_argument("--window", type=int, default=256, help="games in the win-rate window (supervisor.stats_window)")
    ap.add_argument("--conditions", default="", help="what else ran on the machine, recorded with the result")
    ap.add_argument("--json", default=str(HERE / "results" / "vlm.json"))
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    import torch

    torch.set_num_threads(2)
    result: dict[str, Any] = {}
    if args.seconds > 0:
        result.update({"model": {k: v for k, v in MODEL.items()}, "repeats": args.repeats,
                       "seconds_per_run": args.seconds, "episodes_at_once": args.episodes})
    with tempfile.TemporaryDirectory(prefix="earl-vlm-") as tmp:
        model_dir = build_model(Path(tmp))
        runs: list[dict[str, Any]] = []
        for rep in range(args.repeats if args.seconds > 0 else 0):
            for arm in ARMS:
                runs.append(kv_run(model_dir, arm, args.seconds, args.episodes, seed=rep))
                print(f"kv {rep} {runs[-1]}", flush=True)
        if runs:
            kv = summarise_kv(runs)
            result["kv_reuse"] = kv
            result["kv_reuse_speedup"] = kv.get("kv_reuse_speedup")
        pulls = {}
        for plan in args.plans.split(",") if args.up_steps > 0 else []:
            pulls[plan] = pull_run(model_dir, plan, args.up_steps, Path(tmp))
            print(f"pull {plan}: mean fraction {pulls[plan]['mean_fraction']}", flush=True)
        if pulls:
            result["pull"] = pulls
            result["pull_bytes_fraction"] = {plan: p["mean_fraction"] for plan, p in pulls.items()}
        learned = []
        load_before = os.getloadavg()
        for seed in range(args.learn_seeds):
            learned.append(learn_run(args.learn_seconds, args.target, args.window, seed, Path(tmp)))
            print(f"learning seed {seed}: {({k: v for k, v in learned[-1].items() if k != 'curve'})}", flush=True)
        if learned:
            result.update(summarise_learning(learned, args.target), learn_seconds=args.learn_seconds,
                          stats_window=args.window,
                          learn_machine={"load_avg_before": load_before, "load_avg_after": os.getloadavg(),
                                         "conditions": args.conditions or "nothing else started by this script"})
    skipped = {part: keys for part, keys, ran in (("kv_reuse", KV_KEYS, args.seconds > 0),
                                                  ("pull", PULL_KEYS, args.up_steps > 0),
                                                  ("learning", LEARN_KEYS, args.learn_seeds > 0)) if not ran}
    from provenance import keep_parts, write_result

    out = Path(args.json)
    if skipped and out.is_file():
        result = keep_parts(json.loads(out.read_text()), result, skipped, shared=("model", "repeats"))

    path = write_result(out, result, depends_on=["bench/vlm.py", "earl_stream/workers/engines",
                                                 "earl_stream/model/vision.py", "earl_stream/workers/train_step.py",
                                                 "earl_stream/workers/vision_inputs.py",
                                                 "earl_stream/model/warmstart.py", "earl_stream/model/default.py"])
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
