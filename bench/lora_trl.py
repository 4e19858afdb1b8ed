"""TRL's GRPOTrainer on the SmolLM2 arithmetic task: bench/lora.py's peer run (with `peft_config`, on
configs/smollm2_arithmetic_lora.yaml) and bench/e2e_smollm2.py's (`--full`: every weight trained, on
configs/smollm2_arithmetic.yaml, a model checkpoint every `--save-every` steps).

    python bench/lora_trl.py --model DIR --steps 12 --seed 0 --out WORK_DIR     # in .venv-bench (TRL 1.16)
    python bench/lora_trl.py --model DIR --full --minutes 10 --save-every 2 --seed 0 --out WORK_DIR

`run_trl` (called by bench/lora.py in its own interpreter) launches this file as a child with the interpreter
that has `trl` (this one, else `.venv-bench`), in WORK_DIR (a folder named `vllm` in the working directory
breaks `import trl`). The child:
- trains LoRA adapters (the LoRA config's `LoraSpec`, as earl_stream's LoRA run, through its `peft_config()`) on
  the imported checkpoint (`--full`: every weight), with the config's hyper-parameters: learning rate, group size, groups per step,
  sampling temperature, reply length; no KL term (`beta=0`), PPO clip 0.2, per-group advantages;
- poses the questions of the training environment (`ReasoningGymEnv` with the config's params: the same
  1,000-item dataset) and scores each reply with that environment's own `step` (last number, exact);
- stops after `--steps` steps (or, with `--minutes` instead, at the first step end past that many minutes since
  launch, start-up counted), seeded by `--seed` (TRL's `seed`: sampling, shuffling), merges the adapter into
  the base (`merge_and_unload`) and saves the model to WORK_DIR/merged, which the parent then evaluates
  with bench/heldout.py's held-out set and scorer; with `--save-every N`, the model after every Nth step and
  after the last is saved to WORK_DIR/checkpoints/step_NNNNNN (trl.json's `checkpoints`: step, seconds from
  launch at that step's end), a model directory as the base's (its tokenizer and generation config);
- writes WORK_DIR/trl.json: steps, trained tokens/s (prompt + completion tokens of the trained samples, TRL's
  `num_tokens`, over the steps after the first, timed from the first step's end to the last's; over the only step
  when the budget allowed one), loss tokens/s (completion tokens, over the same steps), the reward curve.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
LORA_CONFIG = ROOT / "configs" / "smollm2_arithmetic_lora.yaml"
FULL_CONFIG = ROOT / "configs" / "smollm2_arithmetic.yaml"
BASE_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def run_trl(model_dir: str, work: Path, threads: int, steps: int = 0, seed: int = 0, minutes: float = 0.0, *,
            full: bool = False, save_every: int = 0) -> dict[str, Any]:
    """The child in the interpreter that has trl; its trl.json (plus `merged`: the merged model directory, LoRA)."""
    python, work = sys.executable, work.resolve()  # the child runs in `work`: relative paths would miss
    probe = subprocess.run([python, "-c", "import trl"], capture_output=True, cwd=work)
    if probe.returncode != 0 and (ROOT / ".venv-bench" / "bin" / "python").exists():
        python = str(ROOT / ".venv-bench" / "bin" / "python")
    cmd = [python, str(Path(__file__).resolve()), "--model", model_dir, "--steps", str(steps), "--minutes", str(minutes),
           "--seed", str(seed), "--out", str(work), "--threads", str(threads), "--save-every", str(save_every),
           *(["--full"] if full else [])]
    with open(work / "trl.log", "w") as log:
        proc = subprocess.run(cmd, cwd=work, env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"},
                              stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise RuntimeError(f"TRL child failed (exit {proc.returncode}); see {work / 'trl.log'}: "
                           + (work / "trl.log").read_text()[-2000:])
    return {**json.loads((work / "trl.json").read_text()), **({} if full else {"merged": str(work / "merged")}),
            "python": python}


class Scorer:
    """The training environment's reward: `ReasoningGymEnv.step` on a fresh episode of the item's seed."""

    def __init__(self, params: dict[str, Any]) -> None:
        from earl_stream_envs.reasoning_gym_env import ReasoningGymEnv

        self.make = lambda: ReasoningGymEnv(**params)
        self.loop = asyncio.new_event_loop()
        self.rewards: list[float] = []

    def question(self, seed: int) -> str:
        return str(self.loop.run_until_complete(self.make().reset(seed)))

    def __call__(self, prompts: list, completions: list, seed: list[int], **_: Any) -> list[float]:
        out = []
        for completion, s in zip(completions, seed):
            env = self.make()
            self.loop.run_until_complete(env.reset(s))
            out.append(float(self.loop.run_until_complete(env.step(completion[0]["content"])).reward))
        self.rewards.extend(out)
        return out


def _budget_callback(seconds: float, launched: float, save_every: int = 0, out: Path | None = None,
                     base: Path | None = None) -> Any:
    from transformers import TrainerCallback

    class Budget(TrainerCallback):  # type: ignore[misc]
        """Stops at the first step end past the budget; keeps each step's end and logged metrics; with
        `save_every`, saves the model after every such step and after the last (`checkpoints`)."""

        def __init__(self) -> None:
            self.begun = 0.0
            self.ends: list[float] = []
            self.logs: list[dict[str, float]] = []
            self.checkpoints: list[dict[str, Any]] = []

        def save(self, model: Any) -> None:
            """The model after the step just ended, as a model directory (the base's tokenizer and generation
            config: TRL's sampling settings are not the model's)."""
            assert out is not None and base is not None
            step = len(self.ends)
            if not self.checkpoints or self.checkpoints[-1]["step"] != step:
                where = out / "checkpoints" / f"step_{step:06d}"
                model.save_pretrained(where)
                for name in BASE_FILES:
                    if (base / name).exists():
                        shutil.copy(base / name, where / name)
                self.checkpoints.append({"step": step, "t": round(self.ends[-1], 1), "path": str(where)})

        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.begun = time.monotonic() - launched

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
            self.ends.append(time.monotonic() - launched)
            # or-ed, never assigned: transformers' flow callback has already stopped the run at max_steps
            control.should_training_stop = control.should_training_stop or self.ends[-1] >= seconds
            if save_every and (len(self.ends) % save_every == 0 or control.should_training_stop):
                self.save(kw["model"])
            return control

        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **kw: Any) -> None:
            if logs and "num_tokens" in logs:
                self.logs.append(dict(logs))
                print(json.dumps({"t": round(time.monotonic() - launched, 1), "step": len(self.ends),
                                  "reward": logs.get("reward"), "num_tokens": logs["num_tokens"]}), flush=True)

    return Budget()


def child(args: argparse.Namespace) -> int:
    launched = time.monotonic()
    import torch

    torch.set_num_threads(args.threads)
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback

    from earl_stream.model.lora import LoraSpec

    cfg = yaml.safe_load((FULL_CONFIG if args.full else LORA_CONFIG).read_text())
    env, trainer_cfg, lora = cfg["envs"][0]["params"], cfg["trainer"], cfg["model"].get("lora")
    spec = None if args.full else LoraSpec(rank=int(lora["rank"]), alpha=float(lora["alpha"]),
                                           dropout=float(lora["dropout"]), target_modules=tuple(lora["target_modules"]))
    scorer = Scorer(env)
    data = Dataset.from_list([{"prompt": [{"role": "system", "content": env["system_prompt"]},
                                          {"role": "user", "content": scorer.question(i)}], "seed": i}
                              for i in range(int(env["size"]))])
    group, groups = int(trainer_cfg["group_size"]), int(trainer_cfg["groups_per_step"])
    out = Path(args.out)
    grpo = trl.GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-", dir=out), use_cpu=True, report_to="none", seed=args.seed,
        num_generations=group, per_device_train_batch_size=group * groups, learning_rate=float(trainer_cfg["lr"]),
        lr_scheduler_type="constant", optim="adamw_torch", max_grad_norm=1.0, beta=0.0, epsilon=0.2,
        loss_type="dapo", scale_rewards="group", temperature=float(cfg["rollout"]["temperature"]), top_k=0, top_p=1.0,
        max_completion_length=int(env["max_turn_tokens"]), logging_steps=1, save_strategy="no", max_steps=args.steps or 1_000_000,
        disable_tqdm=True, gradient_checkpointing=False,
        bf16=False, fp16=False)  # fp32 as earl_stream trains (GRPOConfig defaults to bf16 autocast, on CPU
        # the reference GEMM in backward: a 12-step run took over 30 min instead of ~12)
    budget = _budget_callback(args.minutes * 60 if not args.steps else float("inf"), launched, args.save_every, out,
                              Path(args.model))
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)  # as earl_stream's load_model
    trainer = trl.GRPOTrainer(model=model, reward_funcs=scorer, args=grpo,
                              train_dataset=data, processing_class=AutoTokenizer.from_pretrained(args.model),
                              peft_config=spec.peft_config() if spec else None, callbacks=[budget])
    trainer.remove_callback(PrinterCallback)
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    trainer.train()
    if spec is not None:
        merged = trainer.model.merge_and_unload()
        merged.save_pretrained(out / "merged")
        trainer.processing_class.save_pretrained(out / "merged")
        shutil.copy(Path(args.model) / "generation_config.json", out / "merged")  # the base's stop tokens, not TRL's sampling
    (out / "trl.json").write_text(json.dumps(_result(budget, trainable, trl.__version__, args, group * groups)))
    return 0


def _result(budget: Any, trainable: int, version: str, args: argparse.Namespace, per_step: int) -> dict[str, Any]:
    tokens = [x["num_tokens"] for x in budget.logs]  # cumulative: prompt + completion tokens of trained samples
    # loss tokens: the completion tokens of every trained sample (TRL's loss averages over all of them)
    loss = [x["completions/mean_length"] * per_step for x in budget.logs if "completions/mean_length" in x]
    steps = len(budget.ends)
    window = budget.ends[-1] - budget.ends[0] if steps > 1 else 0.0
    rate, measured = ((tokens[-1] - tokens[0]) / window, "the steps after the first") if window else (
        (tokens[0] / (budget.ends[0] - budget.begun), "the only step, from train()'s start") if tokens else (None, ""))
    return {
        "system": f"trl {version} GRPOTrainer" + ("" if args.full else " + peft_config"), "steps": steps, "samples": steps * per_step,
        "wall_seconds": round(budget.ends[-1], 1), "startup_s": round(budget.ends[0], 1), "window_s": round(window, 1),
        "trained_tokens_per_s": rate if len(tokens) == steps else None, "trained_tokens_over": measured,
        "loss_tokens_per_s": sum(loss[1:]) / window if window and len(loss) == steps else None,
        "trainable_params": trainable, "torch_threads": args.threads, "checkpoints": budget.checkpoints,
        "curve": [{"t": round(t, 1), "step": i + 1, "reward": x.get("reward")}
                  for i, (t, x) in enumerate(zip(budget.ends, budget.logs))],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--steps", type=int, default=0, help="trainer steps to run (0: the --minutes budget instead)")
    ap.add_argument("--minutes", type=float, default=60.0, help="time budget, start-up included, when --steps is 0")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True, help="work directory: trl.json and merged/ are written here")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--full", action="store_true", help="train every weight (configs/smollm2_arithmetic.yaml), no adapter")
    ap.add_argument("--save-every", type=int, default=0,
                    help="save the model after every this many steps and after the last (0: LoRA's merged model only)")
    return child(ap.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
