"""The cost of evaluation during training (eval.every): trained tokens/s of the same workload with and
without it, side by side, and the held-out eval curve of the run with it.

    python bench/eval_overlap.py --quick                     # the embedded default model, 2 x 2 arms of 3 min
    python bench/eval_overlap.py --config configs/smollm2_arithmetic.yaml --minutes 30 --every 5 --problems 64

Arms: `off` (no evaluation) and `on` (eval.every=--every on the run's first environment, --problems held-out
items x --samples), each a fresh `earl-stream up` of --minutes, alternated --repeats times (off, on, off, on,
...) so that a machine whose load drifts weighs on both alike. Trained tokens/s of an arm: tokens of the
samples trained (episode tokens produced x consumed / produced, from the supervisor's counters, as
bench/real_model.py counts them) over the window from its first trained step to its end (start-up left
out). `ratio` = on / off of the summed trained tokens over the summed windows (goal >= 0.9). The eval curve:
every evaluation round of the `on` arms (policy version, wall seconds, success, pass@k, mean reward).

Without --config the workload is the embedded default model (`up`'s own) on the arithmetic task of
configs/smollm2_arithmetic.yaml (the model cannot do arithmetic: its curve measures the machinery, not
learning); with SmolLM2 imported (`make real-model`) pass that config for a run that learns.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from live_up import LiveUp  # noqa: E402
from provenance import write_result  # noqa: E402

from earl_stream.progress import progress  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ARITHMETIC = ROOT / "configs" / "smollm2_arithmetic.yaml"
QUICK = ["rollout.workers=1", "trainer.groups_per_step=4", "trainer.group_size=4", "rollout.groups_in_flight=4",
         "trainer.checkpoint_every=1000", "supervisor.heartbeat_s=0.5"]


def arithmetic_env() -> list[str]:
    """The arithmetic environment of configs/smollm2_arithmetic.yaml as overrides of the default config."""
    env = yaml.safe_load(ARITHMETIC.read_text())["envs"][0]
    # by file: the same class whichever checkout the installed entry point names
    return [f"envs.0.spec={ROOT / 'envs' / 'reasoning_gym_env.py'}:ReasoningGymEnv", f"envs.0.name={env['name']}",
            f"envs.0.params={json.dumps(env['params'])}"]


def run_arm(name: str, up_args: list[str], minutes: float, work: Path) -> dict[str, Any]:
    """One fresh `up` for `minutes`: trained tokens over its window and the eval rounds it finished."""
    run_dir = work / name
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    up = LiveUp(run_dir, "--steps", "0", *up_args, log=work / f"{name}.log")
    start, first, last, rounds = time.monotonic(), None, None, {}
    try:
        while time.monotonic() - start < minutes * 60:
            if up.proc.poll() is not None:
                raise SystemExit(f"earl-stream up exited ({up.proc.returncode}) in arm {name}: see {up.log}")
            s = up.status()
            if s and s.get("policy_version", 0) >= 1:
                produced = max(1, s["samples_produced"])
                point = {"t": time.monotonic() - start, "version": s["policy_version"],
                         "trained_tokens": s["tokens_produced"] * s["samples_consumed"] / produced,
                         "samples_trained": s["samples_consumed"]}
                first, last = first or point, point
                for env, e in (s.get("eval") or {}).items():
                    for p in e.get("history", []):
                        rounds.setdefault((env, p["version"]), {"env": env, "t": round(point["t"], 1), **p})
            time.sleep(2)
    finally:
        up.stop()
    if first is None or last is None or last["version"] - first["version"] < 2:
        # the estimate of trained tokens moves with every sample produced: a window of fewer than 2 steps is noise
        raise SystemExit(f"arm {name} trained fewer than 2 steps after its first in {minutes} min (a SmolLM2 step on a "
                         f"loaded 2-core machine takes minutes): give it more --minutes; see {up.log}")
    window = last["t"] - first["t"]
    tokens = last["trained_tokens"] - first["trained_tokens"]
    return {"arm": name, "window_s": round(window, 1), "trained_tokens": round(tokens),
            "trained_tokens_per_s": tokens / window, "steps": last["version"] - first["version"],
            "last_version": last["version"], "eval_rounds": sorted(rounds.values(), key=lambda r: r["version"])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="run config (default: the embedded default model on the arithmetic task)")
    ap.add_argument("--minutes", type=float, default=30.0, help="length of each arm")
    ap.add_argument("--repeats", type=int, default=1, help="off/on pairs, alternated")
    ap.add_argument("--every", type=int, default=5, help="eval.every of the `on` arm (versions)")
    ap.add_argument("--problems", type=int, default=64, help="eval.problems")
    ap.add_argument("--samples", type=int, default=1, help="eval.samples")
    ap.add_argument("--temperature", type=float, default=0.0, help="eval.temperature")
    ap.add_argument("--quick", action="store_true", help="3-minute arms, 2 pairs, 16 problems every 2 versions")
    ap.add_argument("--json", default=str(ROOT / "bench" / "results" / "eval_overlap.json"))
    ap.add_argument("overrides", nargs="*", help="more dotted config overrides for both arms")
    args = ap.parse_args()
    if args.quick:
        args.minutes, args.repeats, args.every, args.problems = 3.0, 2, 2, 16
    base = (["--config", args.config] if args.config else [*arithmetic_env(), *QUICK]) + list(args.overrides)
    evals = [f"eval.every={args.every}", f"eval.problems={args.problems}", f"eval.samples={args.samples}",
             f"eval.temperature={args.temperature}"]
    arms: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="eval-overlap-") as tmp, \
            progress("eval_overlap", 2 * args.repeats, "arms") as bar:
        for r in range(args.repeats):
            for name, extra in (("off", []), ("on", evals)):
                arm = run_arm(f"{name}{r}", base + extra, args.minutes, Path(tmp))
                arms.append(arm)  # every arm is in the result's "arms"; the bar shows the latest
                bar.advance(note=f"{arm['arm']}: {arm['trained_tokens_per_s']:.1f} trained tokens/s")
    total = {a: [x for x in arms if x["arm"].startswith(a)] for a in ("off", "on")}
    rate = {a: sum(x["trained_tokens"] for x in xs) / sum(x["window_s"] for x in xs) for a, xs in total.items()}
    result = {
        "workload": args.config or "embedded default model on configs/smollm2_arithmetic.yaml's task",
        "overrides": [o.replace(f"{ROOT}/", "") for o in base], "eval": evals, "minutes_per_arm": args.minutes, "repeats": args.repeats,
        "trained_tokens_per_s_off": rate["off"], "trained_tokens_per_s_on": rate["on"],
        "ratio": rate["on"] / rate["off"] if rate["off"] else None, "goal": ">= 0.9",
        "pair_ratios": [on["trained_tokens_per_s"] / off["trained_tokens_per_s"]
                        for off, on in zip(total["off"], total["on"])],
        "eval_curve": [r | {"arm": a["arm"]} for a in total["on"] for r in a["eval_rounds"]],
        "arms": [{k: v for k, v in a.items() if k != "eval_rounds"} for a in arms],
    }
    print(f"trained tokens/s: off {rate['off']:.1f}, on {rate['on']:.1f}, ratio {result['ratio']:.3f} (goal >= 0.9); "
          f"per pair {', '.join(f'{r:.3f}' for r in result['pair_ratios'])}; {len(result['eval_curve'])} evaluation rounds")
    curve = result["eval_curve"]
    for p in curve if len(curve) <= 12 else curve[:6] + curve[-6:]:  # the whole curve is in the JSON
        print(f"  eval {p['env']} v{p['version']} ({p['arm']}, {p['t']:.0f}s): success {p['value']:.3f} "
              f"pass@1 {p['pass_at_k']['1']:.3f} mean reward {p['mean_reward']:.3f}")
    write_result(args.json, result, depends_on=["earl_stream/supervisor/eval_rounds.py", "earl_stream/evaluation",
                                                "earl_stream/workers/rollout.py", "bench/eval_overlap.py"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
