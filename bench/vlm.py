"""Vision-language agents (issue 50, item 6): the built-in engine's KV reuse across image turns, and the trainer's
layout-exact pull of the pictures.

    python bench/vlm.py [--repeats 3] [--seconds 60] [--up-steps 4] --json bench/results/vlm.json

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

Not measured here: the learning curve (`final_win_rate`, `seconds_to_0_8`): it needs a vision-language model
warm-started on rendered boards (`model.path=default:tictactoe_image`), which is not built yet; a random tiny
VLM plays illegal moves and learns nothing in 15 minutes. Those keys are null with the reason.
"""

from __future__ import annotations

import argparse
import asyncio
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3, help="runs per arm of the KV-reuse part, interleaved")
    ap.add_argument("--seconds", type=float, default=60.0, help="seconds per KV-reuse run (0 skips that part)")
    ap.add_argument("--episodes", type=int, default=8, help="episodes played at once in a KV-reuse run")
    ap.add_argument("--up-steps", type=int, default=4, help="training steps per plan of the pull part (0 skips it)")
    ap.add_argument("--plans", default="dp2,sp2", help="trainer plans of the pull part")
    ap.add_argument("--json", default=str(HERE / "results" / "vlm.json"))
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    import torch

    torch.set_num_threads(2)
    result: dict[str, Any] = {"model": {k: v for k, v in MODEL.items()}, "repeats": args.repeats,
                              "seconds_per_run": args.seconds, "episodes_at_once": args.episodes}
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
    why = ("not measured: needs the default:tictactoe_image warm start (a vision-language model that plays legal "
           "moves from pictures), not built yet")
    result["final_win_rate"] = None
    result["seconds_to_0_8"] = None
    result["not_measured"] = {"final_win_rate": why, "seconds_to_0_8": why}
    from provenance import write_result

    path = write_result(args.json, result, depends_on=["bench/vlm.py", "earl_stream/workers/engines",
                                                       "earl_stream/model/vision.py", "earl_stream/workers/train_step.py",
                                                       "earl_stream/workers/vision_inputs.py"])
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
