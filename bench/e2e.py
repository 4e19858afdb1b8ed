"""End-to-end benchmark: earl_stream asynchronous vs earl_stream synchronous vs TRL's GRPOTrainer,
on the same tiny model, the same game (Tic-Tac-Toe as X against a seeded random opponent), the same
GRPO hyper-parameters and the same machine.

    python bench/e2e.py [--quick] --json bench/results/e2e.json

- **async**: `earl-stream up` (real processes) at the default staleness bound (1);
- **sync**: the same command with `trainer.max_staleness=0`: generate, train, generate;
- **trl**: `trl.GRPOTrainer` in a child process (from `.venv-bench` if this interpreter lacks trl).

Cores: in both earl_stream modes the rollout pool is pinned to CPU 0 and the trainer pool to CPU 1
(`rollout.cpus=0 trainer.cpus=1`, one torch thread each: disaggregated pools); the supervisor is not
pinned (it is a light control plane). TRL is not pinned and gets one torch thread per CPU.

TRL is single-turn. Its episode here: the prompt is the game's first observation; the trained
completion is the model's first move; the reward function then plays the rest of the same game
against the same seeded opponent with the current policy (sampled, no gradient) and returns the
game's reward. A TRL "sample" is therefore one full game, of which only the first move is trained.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pipeline_rates import LOAD_LINE, MODE_OVERRIDES, PINNED_POOLS, STEP_LINE, Snapshot, Watch, log_window, overlap_ceiling, watch_up
from provenance import write_result

ROOT = Path(__file__).resolve().parent.parent
GROUP_SIZE, GROUPS_PER_STEP, LR, SEED, WINDOW = 8, 8, 1e-3, 0, 256
CORES: dict[str, dict[str, str]] = {
    "async": {"rollout": "CPU 0, 1 thread", "trainer": "CPU 1, 1 thread", "supervisor": "not pinned"},
    "sync": {"rollout": "CPU 0, 1 thread", "trainer": "CPU 1, 1 thread", "supervisor": "not pinned"},
    "trl": {"everything": "CPUs 0-1 (not pinned)"}}


# ----------------------------------------------------------------------------------- earl_stream

def run_earl(mode: str, model_dir: Path, seconds: float, target: float, work: Path) -> dict[str, Any]:
    """One `earl-stream up` run for `seconds` after its first step; returns throughput, curve, profile."""
    run_dir = work / f"earl_{mode}"
    overrides = [f"model.path={model_dir}", f"run_dir={run_dir}", f"seed={SEED}", *PINNED_POOLS,
                 f"trainer.group_size={GROUP_SIZE}", f"trainer.groups_per_step={GROUPS_PER_STEP}", f"trainer.lr={LR}",
                 f"supervisor.stats_window={WINDOW}",
                 # TRL GRPOTrainer's objective: no entropy bonus, constant lr, one opponent per group (defaults moved)
                 "algo.entropy_coef=0", "algo.lr_schedule=constant", "envs.0.group_seed=shared", *MODE_OVERRIDES[mode]]
    watch = watch_up(["--summary", str(run_dir / "summary.json"), *overrides], run_dir,
                     lambda now, first: first is not None and now.t - first.t >= seconds, what=mode)
    return _earl_result(mode, watch, run_dir, target)


def _earl_point(snap: Snapshot) -> dict[str, Any]:
    s = snap.status
    gen = sum(int(w.get("stats", {}).get("tokens", 0)) for w in s.get("workers", []) if w["role"] == "rollout")
    return {"t": snap.t, "step": snap.step, "samples_trained": s["samples_consumed"],
            "samples_produced": s["samples_produced"], "generated_tokens": gen, "win": s.get("win_rate_last"),
            "draw": s.get("draw_rate_last"), "stale": s.get("samples_stale", 0)}


def _earl_result(mode: str, watch: Watch, run_dir: Path, target: float) -> dict[str, Any]:
    assert watch.first is not None
    first, last = watch.first, watch.snapshots[-1]
    curve = [_earl_point(snap) for snap in watch.snapshots]
    t0, t1 = _earl_point(first), _earl_point(last)
    dt = t1["t"] - t0["t"]
    steps = log_window(run_dir / "logs" / "trainer.log", STEP_LINE, first.wall, last.wall)
    loads = log_window(run_dir / "logs" / "rollout-0.log", LOAD_LINE, first.wall, last.wall)
    step_s = sum(float(r[3]) for r in steps)
    pull_s = sum(float(r[4]) for r in steps)
    trained_tokens = sum(int(r[2]) for r in steps)
    cpu = {role: round((last.cpu.get(role, 0.0) - first.cpu.get(role, 0.0)) / dt, 3) for role in last.cpu}
    reached = next((p for p in curve if p["win"] is not None and p["win"] >= target), None)
    return {
        "system": f"earl_stream {mode}", "window_s": round(dt, 1), "steps": t1["step"] - t0["step"],
        "samples_per_s": sum(int(r[1]) for r in steps) / dt,  # from the trainer's log: what it really trained
        "produced_samples_per_s": (t1["samples_produced"] - t0["samples_produced"]) / dt,
        "generated_tokens_per_s": (t1["generated_tokens"] - t0["generated_tokens"]) / dt,
        "trained_tokens_per_s": trained_tokens / dt,
        "steps_per_s": (t1["step"] - t0["step"]) / dt,
        "startup_s": t0["t"], "time_to_target_s": reached["t"] if reached else None,
        "start_win_rate": next((p["win"] for p in curve if p["win"] is not None), None),
        "final_win_rate": curve[-1]["win"] if curve else None,
        "samples_stale": t1["stale"] - t0["stale"],
        "cpu_seconds_per_sample": sum(cpu.values()) * dt / max(1, sum(int(r[1]) for r in steps)),
        "cpu_seconds_per_step": {role: round(u * dt / max(1, len(steps)), 3) for role, u in cpu.items()},
        "profile": {
            "cpu_utilisation": cpu,
            "trainer_train_fraction": round((step_s - pull_s) / dt, 3),
            "trainer_pull_fraction": round(pull_s / dt, 3),
            "trainer_waiting_fraction": round(1 - step_s / dt, 3),
            "trainer_step_s_mean": round(step_s / max(1, len(steps)), 3),
            "rollout_weight_load_fraction": round(sum(float(r[0]) for r in loads) / dt, 3),
            "rollout_idle_fraction": round(1 - cpu.get("rollout", 0.0), 3),
            "note": "fractions of the measured window; trainer waiting = claiming (waiting for samples) + "
                    "publishing weights; rollout idle = 1 - its CPU utilisation (waiting for weights or prompts)",
        },
        "curve": curve,
    }


# ------------------------------------------------------------------------------------------ TRL

def run_trl(model_dir: Path, seconds: float, target: float, work: Path, threads: int) -> dict[str, Any]:
    """TRL in a child process (its own interpreter: `.venv-bench` when this one has no trl)."""
    python = sys.executable
    probe = subprocess.run([python, "-c", "import trl"], capture_output=True, cwd=work)
    if probe.returncode != 0 and (ROOT / ".venv-bench" / "bin" / "python").exists():
        python = str(ROOT / ".venv-bench" / "bin" / "python")
    out = work / "trl.json"
    cmd = [python, str(Path(__file__).resolve()), "--trl-child", "--model", str(model_dir), "--seconds", str(seconds),
           "--target", str(target), "--json", str(out), "--trl-threads", str(threads)]
    # cwd=work: a folder named `vllm` in the working directory breaks `import trl`
    proc = subprocess.run(cmd, cwd=work, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"system": "trl", "error": proc.stderr[-3000:]}
    return json.loads(out.read_text())


def trl_child(args: argparse.Namespace) -> int:
    launched = time.monotonic()
    import torch

    threads = args.trl_threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    import trl
    from datasets import Dataset
    from earl_stream_envs.tictactoe import TicTacToe
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PrinterCallback

    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model)
    system = TicTacToe.system_prompt
    board = TicTacToe().render()
    n = 20_000  # prompts (8 per step): more than a run uses; a larger dataset only slows TRL's start
    seeds = [(SEED * 1_000_003 + i * 7919) & 0x3FFFFFFF for i in range(n)]  # the ledger's prompt seeds (env/seeds.py)
    data = Dataset.from_list([{"prompt": [{"role": "system", "content": system}, {"role": "user", "content": board}],
                              "seed": s} for s in seeds])
    # the playout gets its own tokenizer and stop tokens: TRL adjusts the ones it is given
    games = Playout(model, AutoTokenizer.from_pretrained(args.model), system, launched,
                    GenerationConfig.from_pretrained(args.model).eos_token_id)

    def reward(prompts: list, completions: list, seed: list[int], **_: Any) -> list[float]:
        return games.play([c[0]["content"] for c in completions], seed)

    cfg = trl.GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-e2e-"), use_cpu=True, report_to="none", seed=SEED,
        num_generations=GROUP_SIZE, per_device_train_batch_size=GROUP_SIZE * GROUPS_PER_STEP, learning_rate=LR,
        lr_scheduler_type="constant", optim="adamw_torch", max_grad_norm=1.0, beta=0.0, epsilon=0.2,
        loss_type="dapo", scale_rewards="group", temperature=1.0, top_k=0, top_p=1.0,
        max_completion_length=TicTacToe.max_turn_tokens, logging_steps=1, save_strategy="no", max_steps=1_000_000,
        shuffle_dataset=False, disable_tqdm=True, gradient_checkpointing=False)
    gen = {"seconds": 0.0}
    clock = StepClock(args.seconds, launched,
                      lambda: (gen["seconds"], games.seconds, games.generated_tokens, time.process_time()))
    trainer = trl.GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=data, processing_class=tok,
                              callbacks=[clock])
    trainer.remove_callback(PrinterCallback)  # it prints every step's logs; StepClock keeps them
    games.model = trainer.model
    _time_generate(trainer.model, games, gen)
    trainer.train()
    Path(args.json).write_text(json.dumps(trl_result(clock, games, args.target, threads, trl.__version__)))
    return 0


class Playout:
    """The reward function's body: finish every game with the current policy; keep the outcomes."""

    def __init__(self, model: Any, tok: Any, system: str, launched: float, eos: int | list[int]) -> None:
        self.model, self.tok, self.system, self.launched, self.eos = model, tok, system, launched, eos
        self.loop = asyncio.new_event_loop()
        self.outcomes: list[tuple[float, str]] = []
        self.seconds = 0.0
        self.generated_tokens = 0
        self.active = False

    def play(self, first_moves: list[str], seeds: list[int]) -> list[float]:
        from earl_stream_envs.tictactoe import TicTacToe

        start = time.monotonic()
        envs = [TicTacToe() for _ in seeds]
        chats = [[{"role": "system", "content": self.system},
                  {"role": "user", "content": self.loop.run_until_complete(e.reset(s))}] for e, s in zip(envs, seeds)]
        rewards = [0.0] * len(envs)
        replies = dict(enumerate(first_moves))
        while replies:
            pending = []
            for i, reply in replies.items():
                step = self.loop.run_until_complete(envs[i].step(reply))
                chats[i].append({"role": "assistant", "content": reply.strip()})
                if step.done:
                    rewards[i] = float(step.reward)
                    self.outcomes.append((time.monotonic() - self.launched, str(step.info.get("outcome", ""))))
                else:
                    chats[i].append({"role": "user", "content": step.observation})
                    pending.append(i)
            replies = dict(zip(pending, self._generate([chats[i] for i in pending]))) if pending else {}
        self.seconds += time.monotonic() - start
        return rewards

    def _generate(self, chats: list[list[dict[str, str]]]) -> list[str]:
        import torch

        texts = [self.tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]
        batch = self.tok(texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
        self.active, training = True, self.model.training
        self.model.eval()  # under gradient checkpointing (TRL's default) train-mode generate samples garbage
        try:
            with torch.no_grad():
                out = self.model.generate(**batch, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                          max_new_tokens=4, pad_token_id=self.tok.pad_token_id,
                                          eos_token_id=self.eos, use_cache=True)
        finally:
            self.active = False
            self.model.train(training)
        new = out[:, batch["input_ids"].shape[1]:]
        self.generated_tokens += int((new != self.tok.pad_token_id).sum())
        return self.tok.batch_decode(new, skip_special_tokens=True)


def _time_generate(model: Any, games: Playout, acc: dict[str, float]) -> None:
    """Wrap `model.generate` to time TRL's own generation of the trained completions."""
    inner = model.generate

    def timed(*a: Any, **kw: Any) -> Any:
        if games.active:
            return inner(*a, **kw)
        start = time.monotonic()
        try:
            return inner(*a, **kw)
        finally:
            acc["seconds"] += time.monotonic() - start

    model.generate = timed


def _callback_base() -> type:
    from transformers import TrainerCallback

    return TrainerCallback


class StepClock(_callback_base()):  # type: ignore[misc]
    """Stops training `seconds` after the first step; records step ends and the logged metrics."""

    def __init__(self, seconds: float, launched: float, counters: Any) -> None:
        self.seconds, self.launched, self.counters = seconds, launched, counters
        self.ends: list[float] = []
        self.snapshots: list[tuple[float, float, int, float]] = []  # (TRL generate s, playout s, tokens, CPU s)
        self.logs: list[dict[str, float]] = []

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
        self.ends.append(time.monotonic() - self.launched)
        self.snapshots.append(self.counters())
        if self.ends[-1] - self.ends[0] >= self.seconds:
            control.should_training_stop = True
        return control

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **kw: Any) -> None:
        if logs:
            self.logs.append(dict(logs))


def trl_result(clock: StepClock, games: Playout, target: float, threads: int, version: str) -> dict[str, Any]:
    """Throughput over the window from the end of the first step to the end of the last."""
    per_step = GROUP_SIZE * GROUPS_PER_STEP
    dt = clock.ends[-1] - clock.ends[0]
    steps = len(clock.ends) - 1
    lengths = [x["completions/mean_length"] for x in clock.logs if "completions/mean_length" in x]
    first_tokens = sum(lengths[1:steps + 1]) * per_step  # the trained first moves of the window's steps
    (g0, p0, t0, c0), (g1, p1, t1, c1) = clock.snapshots[0], clock.snapshots[-1]
    curve, reached = [], None
    for k in range(WINDOW, len(games.outcomes) + 1, per_step):
        last = [o for _, o in games.outcomes[k - WINDOW:k]]
        point = {"t": round(games.outcomes[k - 1][0], 2), "games": k, "win": last.count("win") / WINDOW,
                 "draw": last.count("draw") / WINDOW}
        curve.append(point)
        if reached is None and point["win"] >= target:
            reached = point
    return {
        "system": f"trl {version} GRPOTrainer", "window_s": round(dt, 1), "steps": steps, "torch_threads": threads,
        "samples_per_s": steps * per_step / dt, "generated_tokens_per_s": (first_tokens + t1 - t0) / dt,
        "trained_tokens_per_s": first_tokens / dt, "steps_per_s": steps / dt, "startup_s": round(clock.ends[0], 1),
        "time_to_target_s": reached["t"] if reached else None,
        "start_win_rate": curve[0]["win"] if curve else None, "final_win_rate": curve[-1]["win"] if curve else None,
        "episode": "one full game per sample; the trained completion is the first move, the rest of the game is "
                   "played by the current policy inside the reward function (sampled, not trained)",
        "cpu_seconds_per_sample": (c1 - c0) / (steps * per_step),
        "profile": {
            "cpu_utilisation": {"trl": round((c1 - c0) / dt, 3)},
            "trl_generation_fraction": round((g1 - g0) / dt, 3),
            "reward_playout_fraction": round((p1 - p0) / dt, 3),
            "train_and_overhead_fraction": round(1 - (g1 - g0 + p1 - p0) / dt, 3),
            "note": "fractions of the measured window; generation = TRL generating the trained completions; "
                    "playout = the reward function finishing the games (env + policy sampling); the rest is "
                    "forward/backward/optimizer and TRL's per-step bookkeeping",
        },
        "curve": curve,
    }


# ----------------------------------------------------------------------------------------- main

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="60 s per system instead of 200 s")
    ap.add_argument("--json", default="bench/results/e2e.json", help="where to write the results")
    ap.add_argument("--seconds", type=float, default=None, help="measured seconds per system (after its first step)")
    ap.add_argument("--target", type=float, default=0.8, help="win rate (last 256 games) to report the time to")
    ap.add_argument("--model", default="", help="model directory; default: the embedded default model")
    ap.add_argument("--only", default="async,sync,trl", help="comma-separated subset of systems to run")
    ap.add_argument("--trl-threads", type=int, default=1,
                    help="TRL's torch threads (0 = one per CPU). Default 1: on this shared, loaded machine 2 threads "
                         "made its generation 4-5x slower (a 64-game playout: 7-11 s vs 1.8-2.3 s)")
    ap.add_argument("--trl-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.trl_child:
        return trl_child(args)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(ROOT))
    from earl_stream.model import ensure_default_model
    from earl_stream.progress import progress

    model_dir = Path(args.model) if args.model else ensure_default_model()
    seconds = args.seconds or (60.0 if args.quick else 200.0)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="earl-e2e-"))
    load_before = os.getloadavg()
    started = time.time()
    systems: dict[str, dict[str, Any]] = {}
    names = args.only.split(",")
    with progress(f"e2e ({seconds:.0f} s a system)", len(names), "systems") as bar:
        for name in names:
            bar.update(bar.done, note=f"running {name}")
            if name == "trl":
                systems[name] = run_trl(model_dir, seconds, args.target, work, args.trl_threads)
                CORES["trl"]["everything"] = f"CPUs 0-1 (not pinned), {args.trl_threads or os.cpu_count()} torch thread(s)"
            else:
                systems[name] = run_earl(name, model_dir, seconds, args.target, work)
            print(json.dumps({k: v for k, v in systems[name].items() if k not in ("curve",)}, default=str)[:1500],
                  flush=True)
            bar.advance(note=f"{name} done")
    result = summarize(systems, args, seconds, model_dir, load_before, time.time() - started)
    write_result(out, result)
    plot(systems, out.with_suffix(".png"), args.target)
    print_table(result)
    return 0


def _rate(systems: dict[str, dict[str, Any]], name: str) -> float | None:
    return systems.get(name, {}).get("samples_per_s")


def summarize(systems: dict[str, dict[str, Any]], args: argparse.Namespace, seconds: float, model_dir: Path,
              load_before: tuple[float, ...], wall: float) -> dict[str, Any]:
    a, s, t = _rate(systems, "async"), _rate(systems, "sync"), _rate(systems, "trl")
    result: dict[str, Any] = {
        "async_samples_per_s": a, "sync_samples_per_s": s, "trl_samples_per_s": t,
        "async_vs_sync": a / s if a and s else None, "async_vs_trl": a / t if a and t else None,
        "time_to_target_s": {k: v.get("time_to_target_s") for k, v in systems.items()},
        "target_win_rate": args.target, "targets": {"async_vs_sync": 2.0, "async_vs_trl": 3.0},
        "quick": args.quick, "seconds_per_system": seconds, "wall_seconds": round(wall, 1),
        "model": str(model_dir), "group_size": GROUP_SIZE, "groups_per_step": GROUPS_PER_STEP, "lr": LR,
        "samples_per_step": GROUP_SIZE * GROUPS_PER_STEP, "stats_window_games": WINDOW,
        "core_assignment": CORES,
        "machine": {"cpus": os.cpu_count(), "load_avg_before": load_before, "load_avg_after": os.getloadavg(),
                    "note": "shared machine: other jobs were running; numbers are noisy (+-35%)"},
        "sample_definition": {"earl_stream": "one full multi-turn game; every model token is trained",
                              "trl": "one full game; only the first move is trained (TRL is single-turn)"},
        "systems": systems,
    }
    result.update(overlap_ceiling(systems.get("sync", {}).get("cpu_seconds_per_step") or {}))
    result["findings"] = findings(systems, result)
    missed = [k for k, goal in result["targets"].items() if result[k] is None or result[k] < goal]
    result["targets_missed"] = missed
    if missed:
        result["profile"] = {k: v.get("profile") for k, v in systems.items()}
    return result


def findings(systems: dict[str, dict[str, Any]], result: dict[str, Any]) -> list[str]:
    """What the profile says, in sentences built from the measured numbers (rendered into the docs)."""
    out = []
    for name in ("async", "sync"):
        r = systems.get(name, {})
        p, per_step = r.get("profile"), r.get("cpu_seconds_per_step", {})
        if not p or not per_step.get("trainer"):
            continue
        share = per_step["trainer"] / p["trainer_step_s_mean"] if p["trainer_step_s_mean"] else 0.0
        out.append(f"{name}: the trainer is in a step {100 * p['trainer_train_fraction']:.0f}% of the time and waits "
                   f"for data {100 * p['trainer_waiting_fraction']:.0f}%; a step needs {per_step['trainer']:.2f} "
                   f"CPU-s but takes {p['trainer_step_s_mean']:.2f} s (it gets ~{share:.2f} of its core; the "
                   f"machine is shared); the rollout worker is idle {100 * p['rollout_idle_fraction']:.0f}% "
                   f"(generation needs {per_step.get('rollout', 0):.2f} CPU-s per step).")
    if result.get("async_vs_sync_ceiling"):
        out.append(f"With one core per pool, overlap can at best give async/sync = {result['async_vs_sync_ceiling']:.2f}"
                   " (generation and training CPU time per step); 2x needs the two to cost the same.")
    a, t = systems.get("async", {}), systems.get("trl", {})
    if a.get("trained_tokens_per_s") and t.get("trained_tokens_per_s"):
        out.append(f"TRL trains only the first move of each game: per trained token async is "
                   f"{a['trained_tokens_per_s'] / t['trained_tokens_per_s']:.0f}x TRL; TRL reached the target: "
                   f"{'yes' if t.get('time_to_target_s') else 'no'} (win rate {t.get('start_win_rate')} -> "
                   f"{t.get('final_win_rate')}).")
    return out


def print_table(result: dict[str, Any]) -> None:
    print(f"\n{'system':<32} {'samples/s':>10} {'gen tok/s':>10} {'train tok/s':>11} {'steps/s':>8} "
          f"{'to target':>10}  cores")
    for name, r in result["systems"].items():
        if "error" in r:
            print(f"{name:<32} failed: {r['error'][-300:]}")
            continue
        ttt = r.get("time_to_target_s")
        print(f"{r['system']:<32} {r['samples_per_s']:>10.1f} {r['generated_tokens_per_s']:>10.0f} "
              f"{r['trained_tokens_per_s']:>11.0f} {r['steps_per_s']:>8.3f} {f'{ttt:.0f} s' if ttt else 'not reached':>10}"
              f"  {CORES[name]}")
    print(f"async/sync {_fmt(result['async_vs_sync'])} (ceiling for this core split "
          f"{_fmt(result.get('async_vs_sync_ceiling'))}), async/trl {_fmt(result['async_vs_trl'])}; targets missed: "
          f"{result['targets_missed'] or 'none'}")


def _fmt(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}"


def plot(systems: dict[str, dict[str, Any]], path: Path, target: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in systems.items():
        pts = [p for p in r.get("curve", []) if p.get("win") is not None]
        if pts:
            ax.plot([p["t"] for p in pts], [p["win"] for p in pts], label=r.get("system", name))
    ax.axhline(target, ls="--", c="green", label=f"target {target}")
    ax.set_xlabel("seconds since launch")
    ax.set_ylabel(f"win rate (last {WINDOW} games)")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    ax.set_title("Tic-Tac-Toe vs random: earl_stream async / sync vs TRL")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    raise SystemExit(main())
