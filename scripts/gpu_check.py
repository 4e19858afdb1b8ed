"""The GPU preset check (scripts/gpu-check.sh): a short `earl-stream up` of configs/gpu_single.yaml on a CUDA GPU,
its model replaced by random weights of Qwen3-1.7B's real shape built here (no download, no network), and a
JSON result: the card, steps and samples trained, wall time, the card's peak memory, the trainer plans adopted
and the engine's decode path.

It owns building that model and reading the run's summary and logs; the run itself is `earl-stream up`'s.
Exit codes: 0 = passed; 2 = no CUDA GPU here; 1 = the run failed, timed out or stopped short (the reason on stderr).
`--cpu-smoke` checks this script itself on a CPU (a tiny Qwen3, one step, the preset moved to the CPU); it
proves nothing about a GPU and writes its result under the run directory only.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PRESET = ROOT / "configs" / "gpu_single.yaml"
# Qwen/Qwen3-1.7B's config.json (the shape only: no weights are downloaded)
QWEN3_1_7B: dict[str, Any] = dict(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                  intermediate_size=6144, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=40960,
                  rope_theta=1_000_000.0, rms_norm_eps=1e-6)
TINY: dict[str, Any] = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128, vocab_size=512, tie_word_embeddings=True, max_position_embeddings=4096)
# the preset moved to the CPU and shrunk, for --cpu-smoke only
CPU_SMOKE = ["trainer.device=cpu", "rollout.device=cpu", "rollout.dtype=fp32", "trainer.dtype=fp32",
             "selector.trainer_memory_bytes=4294967296", "selector.reserve_bytes=268435456",
             "rollout.memory_bytes=2147483648", "trainer.groups_per_step=2", "trainer.group_size=2",
             "rollout.groups_in_flight=2", "rollout.max_batch_size=4", "envs.0.params.max_turn_tokens=8"]


def fail(code: int, message: str) -> None:
    print(f"gpu-check: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


def require_cuda(cpu_smoke: bool) -> None:
    """Exits 2 where torch sees no CUDA GPU (unless --cpu-smoke). No CUDA context is made in this process: the
    card's memory is the run's."""
    import torch

    if not torch.cuda.is_available() and not cpu_smoke:
        fail(2, f"torch {torch.__version__} sees no CUDA GPU here (torch.cuda.is_available() is False). This check "
                "needs one: run it on a machine with an NVIDIA GPU and a CUDA build of torch (docs/install.md)")


def build_model(out: Path, shape: dict[str, Any], device: str) -> dict[str, Any]:
    """Random weights of `shape` (a Qwen3 config) in bf16, with the tiny model's tokenizer (fewer tokens than
    the model's vocabulary, as real Qwen3 checkpoints have: ids past it decode to nothing). Run in a child
    process (`--build`), so that its CUDA context and tensors are gone before the run starts. Returns the
    parameter count and the card's name."""
    import torch
    import transformers

    from earl_stream.model.tiny import END, _train_tokenizer

    tok = _train_tokenizer(512)
    cfg = transformers.Qwen3Config(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                   pad_token_id=tok.pad_token_id, dtype="bfloat16", **shape)
    torch.manual_seed(0)
    with torch.device(device):  # initialised on the GPU: seconds instead of minutes for 1.7B parameters
        model = transformers.Qwen3ForCausalLM(cfg).to(torch.bfloat16)  # type: ignore[arg-type]  # (stubs: device only)
    model.generation_config.eos_token_id = [tok.convert_tokens_to_ids(END), tok.eos_token_id]
    model.save_pretrained(out)
    tok.save_pretrained(out)
    card = torch.cuda.get_device_name() if device == "cuda" else "cpu (--cpu-smoke: no GPU was used)"
    return {"parameters": int(model.num_parameters()), "card": card}


def build_in_child(out: Path, cpu_smoke: bool) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--build", str(out), *(["--cpu-smoke"] if cpu_smoke else [])]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        fail(1, f"building the model failed:\n{done.stderr[-3000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


class MemoryWatch:
    """The card's peak used memory (nvidia-smi, every process on it), sampled every second while running."""

    def __init__(self) -> None:
        self.peak_mib = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._done.wait(1.0):
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                                      "-i", "0"], capture_output=True, text=True, timeout=10).stdout
                self.peak_mib = max(self.peak_mib, int(out.split()[0]))
            except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
                return  # no nvidia-smi: the peak stays unknown (0)

    def __enter__(self) -> MemoryWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()


def log_facts(logs: Path) -> dict[str, list[str]]:
    """What the processes logged about where they ran, which decode path and which trainer plans."""
    lines = [line.strip() for f in sorted(logs.glob("*.log")) for line in f.read_text(errors="replace").splitlines()]
    pick = lambda pattern: sorted({m.group(1) for line in lines if (m := re.search(pattern, line))})  # noqa: E731
    return {"placement": pick(r"((?:trainer rank \d+ computes|built-in engine generates) on \S+ \(\w+\))"),
            "decode_path": pick(r"(engine: \S+ uses .+)$"),
            "trainer_plans": pick(r"(adopted trainer plan v\d+: .+)$"),
            "rollout_plans": pick(r"(rollout plan v\d+: \d+ concurrent sequences, KV budget \d+ tokens, design length .+)$")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=420.0, help="seconds `up` may run (model build excluded)")
    ap.add_argument("--run-dir", default="runs/gpu-preset-check")
    ap.add_argument("--out", default="build/gpu_preset_check.json")
    ap.add_argument("--cpu-smoke", action="store_true", help="check this script on a CPU (tiny model, 1 step)")
    ap.add_argument("--build", metavar="DIR", help=argparse.SUPPRESS)  # the child that builds the model
    args = ap.parse_args()
    if args.build:
        built = build_model(Path(args.build), TINY if args.cpu_smoke else QWEN3_1_7B, "cpu" if args.cpu_smoke else "cuda")
        print(json.dumps(built), flush=True)
        return
    require_cuda(args.cpu_smoke)
    run_dir = Path(args.run_dir).resolve()
    model_dir = run_dir / "model"
    steps = 1 if args.cpu_smoke else args.steps
    shutil.rmtree(run_dir, ignore_errors=True)  # no logs or checkpoints of an earlier check
    start = time.monotonic()
    built = build_in_child(model_dir, args.cpu_smoke)
    params, card, built_s = built["parameters"], built["card"], time.monotonic() - start
    print(f"gpu-check: built {params / 1e9:.2f}B random parameters of Qwen3 shape in {built_s:.0f} s; running "
          f"{steps} steps of {PRESET.relative_to(ROOT)} on {card}", flush=True)
    # Random weights answer (nearly) nothing right: every group has equal rewards, and the preset's dynamic sampling
    # would drop them all and never finish a step. eval.every=0: the held-out evaluation at version 0 would add
    # ~1.5 min of decoding on random weights. trainer.groups_per_step=8 (64 episodes a step, not 128): random weights
    # never stop a reply, so every episode decodes the whole 512 tokens; half the steps' episodes keeps the check
    # within minutes. Everything else (memory budgets, dtypes, engine) is the preset's.
    overrides = ["eval.every=0", "algo.dynamic_sampling=false", "trainer.groups_per_step=8"]
    cmd = [sys.executable, "-m", "earl_stream", "up", "--config", str(PRESET), "--steps", str(steps), "--summary",
           str(run_dir / "summary.json"), f"run_dir={run_dir}", f"model.path={model_dir.resolve()}", *overrides,
           *(CPU_SMOKE if args.cpu_smoke else [])]
    with MemoryWatch() as watch, open(run_dir / "up.log", "w") as log:
        try:
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout, cwd=ROOT)
        except subprocess.TimeoutExpired:
            fail(1, f"`earl-stream up` ran past {args.timeout:.0f} s (logs: {run_dir}/logs, {run_dir}/up.log)")
    summary_file = run_dir / "summary.json"
    if proc.returncode != 0 or not summary_file.is_file():
        fail(1, f"`earl-stream up` exited {proc.returncode} (logs: {run_dir}/logs, {run_dir}/up.log)")
    s = json.loads(summary_file.read_text())
    result = {"what": "scripts/gpu-check.sh: `earl-stream up --config configs/gpu_single.yaml` on random weights of "
                      "Qwen3-1.7B's shape (tiny tokenizer)", "overrides": overrides,
              "card": card, "cpu_smoke": args.cpu_smoke, "parameters": params, "model_build_seconds": round(built_s, 1),
              "steps_requested": steps, "peak_card_memory_mib": watch.peak_mib or None,
              "up": {k: s.get(k) for k in ("steps", "samples_trained", "samples_produced", "tokens_per_second",
                                            "wall_seconds", "samples_lost", "samples_too_long", "last_loss")},
              **log_facts(run_dir / "logs")}
    print(json.dumps(result, indent=1), flush=True)
    out = run_dir / "gpu_check_smoke.json" if args.cpu_smoke else Path(args.out)
    sys.path.insert(0, str(ROOT))
    from bench.provenance import write_result  # adds provenance and scrubs this machine's paths

    write_result(out, result, depends_on=["earl_stream", "configs/gpu_single.yaml", "scripts/gpu_check.py"])
    if s.get("steps") != steps:
        fail(1, f"the run stopped at step {s.get('steps')} of {steps}")
    if not args.cpu_smoke and not any("cuda" in p for p in result["placement"]):
        fail(1, "no process logged computing on cuda")
    print(f"gpu-check: passed; wrote {out}", flush=True)


if __name__ == "__main__":
    main()
