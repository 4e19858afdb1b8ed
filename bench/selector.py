"""The parallelism selector under real memory pressure: static plans vs the adaptive selector.

    python bench/selector.py --json bench/results/selector.json [--quick]

Training where the episode context grows 4x during the run (three phases, rows uniform in
[0.5, 1] x 200, 400, 800 tokens; GRPO on synthetic episodes, AdamW, a ~2.9M-parameter Qwen2 with
eager attention, one thread) in a trainer process whose memory is capped for real: each run is a
fresh child process that builds the model, takes one warm-up step (weights, gradients and AdamW
states allocated), then sets `resource.setrlimit(RLIMIT_DATA, VmData + budget)`. Past the cap an
allocation fails (torch: `RuntimeError: DefaultCPUAllocator: can't allocate memory`; Python:
`MemoryError`), the child reports the crash and exits, and the bench records it.

Why RLIMIT_DATA: cgroup v2 controllers are not available here (no memory.max to write), and
RLIMIT_DATA counts what the process allocates (private writable mappings: heap and anonymous
mmaps, where torch's tensors live) but not shared libraries or PROT_NONE reservations (glibc arena
reserves, thread-stack guards), which RLIMIT_AS would charge although they hold no data. Children
run with MALLOC_MMAP_THRESHOLD_=65536 so that every freed tensor is unmapped and the mapped size
follows live tensors (the memory model's validation uses the same setting).

The runs drive the trainer's own code directly, not a live `earl-stream up`: `train_step` (the
store's partition into micro-batches, the Puller interface over rows held in the child, the GRPO
loss, AdamW) on synthetic batches, and for the adaptive run the supervisor's `Planner` (context
statistics from the batches' metadata, the selector with the memory model and a cost model) whose
plan is applied with `workers.parallel.apply_plan`, as `TrainerRank._apply_plan` does, at each
step boundary. The cost model is calibrated first from measured micro-batch step times of short
sequences (`StepCostModel.calibrate`), and stored in the JSON (`cost_model`).

Compared: every static plan (micro-batch token budget x recomputation on/off) that fits the
first phase under the cap, and the adaptive selector. Throughput is tokens per CPU-second of the
trainer process (one thread; the machine is shared, and CPU time is far less sensitive to the
neighbours than wall time; wall time is recorded too). The oracle of a phase is the best static
plan that completed that phase; `adaptive_vs_oracle_throughput` = the oracle's time for all
phases / the adaptive run's time, on the same tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODEL = {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 16, "num_key_value_heads": 4,
         "intermediate_size": 688, "vocab_size": 512, "tie_word_embeddings": True, "max_position_embeddings": 2048}
PHASE_MAX = (200, 400, 800)  # longest row of each phase: 4x growth
ROWS_PER_STEP = 8  # 2 prompt groups x 4 episodes
PROMPT = 16
MODEL_CAP = 300 << 20  # bytes the memory model may use (states + step peak): 512-token rows fit without
#                        recomputation, 800-token rows need it
STATIC_BUDGETS = (256, 512, 1024, 2048)
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}
CALIBRATION = [(s, b, rc) for s in (128, 256) for b in (1, 2) for rc in (False, True)]


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


class LocalPuller:
    """The store's Puller interface over rows held in this process (the producers' network edge)."""

    def __init__(self, rows: dict[str, Any]) -> None:
        self.rows = rows

    def pull_many(self, requests: dict[str, list[tuple[str, int, int]]], **_: Any) -> dict[str, Any]:
        return {addr: [self.rows[k][s:e].copy() for k, s, e in pieces] for addr, pieces in requests.items()}


def _batch(step: int, phase: int) -> tuple[list[Any], LocalPuller]:
    """The synthetic claim of `step` in `phase`: ROWS_PER_STEP rows uniform in [0.5, 1] x the phase's max."""
    import numpy as np

    rng = np.random.default_rng(1000 + step)
    top = PHASE_MAX[phase]
    return _claim(step, [int(rng.integers(top // 2, top + 1)) for _ in range(ROWS_PER_STEP)])


def _claim(step: int, lengths: list[int]) -> tuple[list[Any], LocalPuller]:
    """Metadata rows + token rows (random ids, loss on all but the prompt, uniform behaviour log-probs)."""
    import numpy as np

    from earl_stream.store.schema import SCHEMA_VERSION, SampleMeta, sample_key

    rng = np.random.default_rng(step)
    rows, metas = {}, []
    for i, n in enumerate(lengths):
        sid = f"s{step}-{i}"
        mask = np.zeros(n, np.uint8)
        mask[PROMPT:] = 1
        rows[sample_key(sid, "input_ids")] = rng.integers(5, MODEL["vocab_size"], n).astype(np.int32)
        rows[sample_key(sid, "loss_mask")] = mask
        rows[sample_key(sid, "behaviour_logprobs")] = (mask * -np.log(MODEL["vocab_size"])).astype(np.float32)
        metas.append(SampleMeta(schema_version=SCHEMA_VERSION, sample_id=sid, prompt_ordinal=step * 2 + i // 4,
                                episode_id=sid, group_id=f"g{step}-{i // 4}", env="bench", turns=1,
                                prompt_tokens=PROMPT, response_tokens=n - PROMPT, total_tokens=n,
                                reward=float(rng.random()), advantage=None, policy_version_min=step,
                                policy_version_max=step, producer_id="p", producer_address="local", checksum=0,
                                created_at=0.0, info_json="{}"))
    return metas, LocalPuller(rows)


def _setup() -> tuple[Any, Any, Any]:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from earl_stream.config import TrainerConfig

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**MODEL, attn_implementation="eager", use_cache=False))
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, opt, TrainerConfig(micro_batch_tokens=1 << 20, grad_clip=1.0)


def _emit(record: dict) -> None:
    os.write(1, (json.dumps(record) + "\n").encode())  # no buffering: the last line survives a crash


def child_calibrate() -> None:
    """Measured CPU seconds of one-micro-batch steps (GRPO forward + backward, AdamW) -> stdout."""
    from earl_stream.store.layout import Layout
    from earl_stream.workers.parallel import RankPlan, apply_plan
    from earl_stream.workers.train_step import train_step

    model, opt, cfg = _setup()
    for k, (s, b, rc) in enumerate(CALIBRATION * 2):  # the first round warms up
        apply_plan(model, RankPlan(micro_batch_tokens=1 << 20, recompute=rc))
        metas, puller = _claim(20_000 + k, [s] * b)
        t0 = time.process_time()
        train_step(model, opt, metas, Layout(), puller, cfg)
        _emit({"seq_len": s, "micro_batch": b, "recompute": rc, "cpu_seconds": time.process_time() - t0})


def child_run(spec: dict) -> None:
    """One training run under the cap: a static plan, or the adaptive selector. One JSON line per step."""
    from earl_stream.store.layout import Layout
    from earl_stream.workers.parallel import RankPlan, apply_plan
    from earl_stream.workers.train_step import train_step

    model, opt, cfg = _setup()
    metas, puller = _batch(10_000, 0)  # warm-up: gradients and AdamW states exist before the cap
    train_step(model, opt, metas[:2], Layout(), puller, cfg)
    base = _status("VmData:")
    limit = base + spec["activation_budget"]
    resource.setrlimit(resource.RLIMIT_DATA, (limit, resource.RLIM_INFINITY))
    planner = _planner(spec, limit, base) if spec["mode"] == "adaptive" else None
    if planner is None:
        plan = RankPlan(micro_batch_tokens=spec["micro_batch_tokens"], recompute=spec["recompute"])
        apply_plan(model, plan)
    version = 0
    _emit({"event": "start", "vm_data_bytes": base, "limit_bytes": limit})
    step = 0
    for phase, steps in enumerate(spec["steps_per_phase"]):
        for _ in range(steps):
            metas, puller = _batch(step, phase)
            reason = ""
            if planner is not None:  # the supervisor sees the rows' metadata before the claim, then re-plans
                planner.add(metas)
                planner.on_step(step)
                decision = planner.trainer_plan
                if decision.version != version:
                    version, reason = decision.version, decision.reason
                    plan = RankPlan.from_plan_dict(decision.to_dict())
                    apply_plan(model, plan)
            step_cfg = cfg.__class__(**{**cfg.__dict__, "micro_batch_tokens": plan.micro_batch_tokens})
            t0, w0 = time.process_time(), time.monotonic()
            try:
                train_step(model, opt, metas, Layout(), puller, step_cfg)
            except (RuntimeError, MemoryError) as exc:
                _emit({"event": "crash", "step": step, "phase": phase, "error": f"{type(exc).__name__}: {exc}"[:300]})
                os._exit(3)
            _emit({"event": "step", "step": step, "phase": phase, "tokens": sum(m.total_tokens for m in metas),
                   "max_len": max(m.total_tokens for m in metas), "cpu_seconds": time.process_time() - t0,
                   "wall_seconds": time.monotonic() - w0, "plan_version": version, "reason": reason,
                   "micro_batch_tokens": plan.micro_batch_tokens, "recompute": plan.recompute})
            step += 1


def _planner(spec: dict, limit: int, base: int) -> Any:
    from earl_stream.config import ModelConfig, RunConfig, SelectorConfig, TrainerConfig
    from earl_stream.supervisor.cost_model import StepCostModel
    from earl_stream.supervisor.memory_model import ModelShape
    from earl_stream.supervisor.planning import Planner

    shape = ModelShape.from_hf({**MODEL, "model_type": "qwen2"})
    static = 16 * shape.num_params()  # fp32 weights + grads + AdamW states: already inside `base`
    model_dir = Path(spec["tmp"]) / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps({**MODEL, "model_type": "qwen2"}))
    cfg = RunConfig(model=ModelConfig(path=str(model_dir)),
                    trainer=TrainerConfig(nproc=1, groups_per_step=2, group_size=4),
                    selector=SelectorConfig(context_window=32, initial_seq_len=256, trainer_memory_bytes=limit,
                                            reserve_bytes=base - static + spec["slack_bytes"]))
    return Planner(cfg, cost_model=StepCostModel.from_dict(spec["cost_model"]))


def _run_child(args: list[str]) -> tuple[int, list[dict], str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **MALLOC_ENV}
    res = subprocess.run([sys.executable, __file__, *args], env=env, capture_output=True, text=True, timeout=1800)
    lines = [json.loads(x) for x in res.stdout.splitlines() if x.startswith("{")]
    return res.returncode, lines, res.stderr[-2000:]


def calibrate() -> tuple[dict, list[dict]]:
    from earl_stream.supervisor.cost_model import StepCostModel
    from earl_stream.supervisor.memory_model import LOGIT_COPIES_EARL_GRPO, Attention, ModelShape, Recompute, TrainPlan

    code, lines, err = _run_child(["--child", json.dumps({"mode": "calibrate"})])
    if code != 0:
        raise SystemExit(f"calibration child failed:\n{err}")
    measured = lines[len(CALIBRATION):]
    shape = ModelShape.from_hf({**MODEL, "model_type": "qwen2"})
    samples = [(shape, TrainPlan(r["micro_batch"], r["seq_len"], attention=Attention.EAGER,
                                 recompute=Recompute.FULL if r["recompute"] else Recompute.NONE,
                                 logit_copies=LOGIT_COPIES_EARL_GRPO), r["cpu_seconds"]) for r in measured]
    model = StepCostModel.calibrate(samples)
    for r, (_, plan, _) in zip(measured, samples):
        r["predicted_seconds"] = model.step_seconds(shape, plan)
    return model.to_dict(), measured


def static_plans(budget_bytes: int, reserve: int) -> list[dict]:
    """Every (micro-batch budget, recompute) whose phase-1 micro-batch the memory model says fits."""
    from earl_stream.supervisor.memory_model import LOGIT_COPIES_EARL_GRPO, Attention, ModelShape, Recompute, TrainPlan, check_fit

    shape = ModelShape.from_hf({**MODEL, "model_type": "qwen2"})
    out = []
    for tokens in STATIC_BUDGETS:
        for rc in (False, True):
            rows = max(1, tokens // PHASE_MAX[0])
            plan = TrainPlan(rows, PHASE_MAX[0], attention=Attention.EAGER, logit_copies=LOGIT_COPIES_EARL_GRPO,
                             recompute=Recompute.FULL if rc else Recompute.NONE)
            if check_fit(shape, plan, budget_bytes, reserve_bytes=reserve).fits:
                out.append({"name": f"mb{tokens}{'_recompute' if rc else ''}", "micro_batch_tokens": tokens,
                            "recompute": rc})
    return out


def summarize(runs: dict[str, dict], phases: int) -> dict:
    per_phase: dict[str, list[float | None]] = {}
    for name, run in runs.items():
        tput = []
        for p in range(phases):
            steps = [r for r in run["steps"] if r["phase"] == p]
            done = len(steps) == run["steps_per_phase"][p]
            tput.append(sum(r["tokens"] for r in steps) / sum(r["cpu_seconds"] for r in steps) if done else None)
        per_phase[name] = tput
    static = [n for n in runs if n != "adaptive"]
    oracle = [max((per_phase[n][p] for n in static if per_phase[n][p] is not None), default=None)
              for p in range(phases)]
    adaptive = runs["adaptive"]
    tokens = [sum(r["tokens"] for r in adaptive["steps"] if r["phase"] == p) for p in range(phases)]
    ratio = None
    if not adaptive["crashed"] and all(o is not None for o in oracle):
        oracle_time = sum(t / o for t, o in zip(tokens, oracle))  # type: ignore[operator]
        ratio = oracle_time / sum(r["cpu_seconds"] for r in adaptive["steps"])
    return {"per_phase_tokens_per_cpu_second": per_phase, "oracle_per_phase": oracle,
            "adaptive_vs_oracle_per_phase": [(a / o if a and o else None) for a, o in zip(per_phase["adaptive"], oracle)],
            "adaptive_vs_oracle_throughput": ratio}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default="bench/results/selector.json", help="where to write the results")
    ap.add_argument("--quick", action="store_true", help="fewer steps per phase (~3 minutes)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        spec = json.loads(args.child)
        child_calibrate() if spec["mode"] == "calibrate" else child_run(spec)
        return 0
    start = time.monotonic()
    steps = [2, 2, 3] if args.quick else [4, 4, 5]
    print("calibrating the cost model from measured micro-batch steps ...", flush=True)
    cost_model, calibration = calibrate()
    for r in calibration:
        print(f"  s={r['seq_len']:4d} b={r['micro_batch']} recompute={int(r['recompute'])}: "
              f"{r['cpu_seconds'] * 1e3:7.1f} ms measured, {r['predicted_seconds'] * 1e3:7.1f} ms fitted")
    from earl_stream.supervisor.memory_model import ModelShape

    static_bytes = 16 * ModelShape.from_hf({**MODEL, "model_type": "qwen2"}).num_params()
    activation_budget = MODEL_CAP - static_bytes
    plans = static_plans(MODEL_CAP, 0)
    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        common = {"activation_budget": activation_budget, "steps_per_phase": steps, "tmp": tmp,
                  "cost_model": cost_model, "slack_bytes": 8 << 20}
        for spec in [*({**common, **p, "mode": "static"} for p in plans), {**common, "mode": "adaptive",
                                                                          "name": "adaptive"}]:
            code, lines, err = _run_child(["--child", json.dumps(spec)])
            crash = next((x for x in lines if x.get("event") == "crash"), None)
            if code != 0 and crash is None:
                crash = {"error": f"exit code {code}: {err.strip().splitlines()[-1] if err.strip() else ''}"}
            st = [x for x in lines if x.get("event") == "step"]
            runs[spec["name"]] = {"crashed": crash is not None, "crash": crash, "steps": st, "steps_per_phase": steps,
                                  "limit_bytes": next((x["limit_bytes"] for x in lines if x.get("event") == "start"), 0),
                                  **{k: spec[k] for k in ("micro_batch_tokens", "recompute") if k in spec}}
            where = (f"crashed in phase {crash.get('phase', -1) + 1}/{len(PHASE_MAX)} ({crash['error'][:90]})"
                     if crash else "completed")
            print(f"  {spec['name']:18s} {where}; {len(st)} steps, "
                  f"{sum(x['tokens'] for x in st) / max(1e-9, sum(x['cpu_seconds'] for x in st)):7.0f} tok/cpu-s",
                  flush=True)
    summary = summarize(runs, len(PHASE_MAX))
    adaptive_plans = [{k: x[k] for k in ("step", "plan_version", "micro_batch_tokens", "recompute", "reason")}
                      for x in runs["adaptive"]["steps"] if x["reason"]]
    result = {"model": MODEL, "phase_max_len": PHASE_MAX, "rows_per_step": ROWS_PER_STEP, "steps_per_phase": steps,
              "memory_cap": {"mechanism": "resource.setrlimit(RLIMIT_DATA) in the child after its warm-up step",
                             "model_cap_bytes": MODEL_CAP, "activation_budget_bytes": activation_budget,
                             "malloc_env": MALLOC_ENV},
              "throughput_unit": "tokens per CPU-second of the trainer process (1 thread)",
              "cost_model": cost_model, "calibration": calibration,
              "static_plans": [p["name"] for p in plans],
              "static_crashes": sum(runs[p["name"]]["crashed"] for p in plans),
              "adaptive_crashed": runs["adaptive"]["crashed"], "adaptive_plans": adaptive_plans,
              **summary, "runs": runs, "quick": args.quick, "seconds": round(time.monotonic() - start, 1)}
    print(f"static plans: {len(plans)}, crashed: {result['static_crashes']}; adaptive crashed: "
          f"{result['adaptive_crashed']}")
    print("per phase tokens/cpu-s: " + "; ".join(
        f"{n}: " + ", ".join(f"{v:.0f}" if v else "-" for v in vals)
        for n, vals in summary["per_phase_tokens_per_cpu_second"].items()))
    ratio = summary["adaptive_vs_oracle_throughput"]
    print(f"adaptive_vs_oracle_throughput = {ratio if ratio is None else round(ratio, 3)} (target >= 0.85)")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out} in {result['seconds']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
