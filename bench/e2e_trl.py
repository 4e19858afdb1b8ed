"""The TRL arm of bench/e2e.py: `trl.GRPOTrainer` on the embedded default model and Tic-Tac-Toe, run as a child
process (from `.venv-bench` where the parent's interpreter has no trl) so that TRL's imports and threads are its own.

    python bench/e2e_trl.py --model DIR --seconds S --target 0.9 --json OUT [--threads N] [--seed K]
        [--group-size 8] [--groups-per-step 8] [--lr 1e-3] [--window 256]

TRL is single-turn. Its episode here: the prompt is the game's first observation; the trained completion is the
model's first move; the reward function (`Playout`) then plays the rest of the same game against the same seeded
opponent with the current policy (sampled, no gradient) and returns the game's reward. A TRL "sample" is
therefore one full game, of which only the first move is trained. `StepClock` stops training `--seconds` after
the first step; `trl_result` reports the window from the end of the first step to the end of the last, in the
units bench/e2e.py reports earl_stream's runs in.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


@dataclasses.dataclass(frozen=True)
class Setting:
    """What both systems share: GRPO's group size and groups per step, and the games the win rate is over."""

    group_size: int
    groups_per_step: int
    window: int


def run(args: argparse.Namespace) -> int:
    """Train with `GRPOTrainer` for `args.seconds` after its first step; write `trl_result` to `args.json`."""
    launched = time.monotonic()
    import torch

    threads = args.threads or len(os.sched_getaffinity(0))
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
    seeds = [(args.seed * 1_000_003 + i * 7919) & 0x3FFFFFFF for i in range(n)]  # the ledger's prompt seeds (env/seeds.py)
    data = Dataset.from_list([{"prompt": [{"role": "system", "content": system}, {"role": "user", "content": board}],
                              "seed": s} for s in seeds])
    # the playout gets its own tokenizer and stop tokens: TRL adjusts the ones it is given
    games = Playout(model, AutoTokenizer.from_pretrained(args.model), system, launched,
                    GenerationConfig.from_pretrained(args.model).eos_token_id)

    def reward(prompts: list, completions: list, seed: list[int], **_: Any) -> list[float]:
        return games.play([c[0]["content"] for c in completions], seed)

    cfg = trl.GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-e2e-"), use_cpu=True, report_to="none", seed=args.seed,
        num_generations=args.group_size, per_device_train_batch_size=args.group_size * args.groups_per_step,
        learning_rate=args.lr,
        lr_scheduler_type="constant", optim="adamw_torch", max_grad_norm=1.0, beta=0.0, epsilon=0.2,
        loss_type="dapo", scale_rewards="group", temperature=1.0, top_k=0, top_p=1.0,
        max_completion_length=TicTacToe.max_turn_tokens, logging_steps=1, save_strategy="no", max_steps=1_000_000,
        shuffle_dataset=False, disable_tqdm=True, gradient_checkpointing=False,
        bf16=False, fp16=False)  # fp32 as earl_stream trains (GRPOConfig defaults to bf16 autocast, on CPU
        # the reference GEMM in backward: a 12-step run took over 30 min instead of ~12)
    gen = {"seconds": 0.0}
    clock = StepClock(args.seconds, launched,
                      lambda: (gen["seconds"], games.seconds, games.generated_tokens, time.process_time()))
    trainer = trl.GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=data, processing_class=tok,
                              callbacks=[clock])
    trainer.remove_callback(PrinterCallback)  # it prints every step's logs; StepClock keeps them
    games.model = trainer.model
    _time_generate(trainer.model, games, gen)
    trainer.train()
    setting = Setting(args.group_size, args.groups_per_step, args.window)
    Path(args.json).write_text(json.dumps(trl_result(clock, games, args.target, threads, trl.__version__, setting)))
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


def trl_result(clock: StepClock, games: Playout, target: float, threads: int, version: str,
               setting: Setting) -> dict[str, Any]:
    """Throughput over the window from the end of the first step to the end of the last; the win rate over the
    last `setting.window` games."""
    per_step = setting.group_size * setting.groups_per_step
    window = setting.window
    dt = clock.ends[-1] - clock.ends[0]
    steps = len(clock.ends) - 1
    lengths = [x["completions/mean_length"] for x in clock.logs if "completions/mean_length" in x]
    first_tokens = sum(lengths[1:steps + 1]) * per_step  # the trained first moves of the window's steps
    (g0, p0, t0, c0), (g1, p1, t1, c1) = clock.snapshots[0], clock.snapshots[-1]
    curve, reached = [], None
    for k in range(window, len(games.outcomes) + 1, per_step):
        last = [o for _, o in games.outcomes[k - window:k]]
        point = {"t": round(games.outcomes[k - 1][0], 2), "games": k, "win": last.count("win") / window,
                 "draw": last.count("draw") / window}
        curve.append(point)
        if reached is None and point["win"] >= target:
            reached = point
    return {
        "system": f"trl {version} GRPOTrainer", "window_s": round(dt, 1), "steps": steps, "torch_threads": threads,
        "samples_per_s": steps * per_step / dt, "generated_tokens_per_s": (first_tokens + t1 - t0) / dt,
        "trained_tokens_per_s": first_tokens / dt, "loss_tokens_per_s": first_tokens / dt, "steps_per_s": steps / dt,
        "startup_s": round(clock.ends[0], 1),
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="model directory")
    ap.add_argument("--seconds", type=float, required=True, help="seconds of training after the first step")
    ap.add_argument("--target", type=float, default=0.9, help="win rate to report the time to")
    ap.add_argument("--json", required=True, help="where to write the run's result")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = one per CPU this process may use)")
    ap.add_argument("--seed", type=int, default=0, help="TRL's seed and the prompts' seeds")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--groups-per-step", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--window", type=int, default=256, help="games in the win-rate window")
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
