"""Every benchmark of the project: what it is called, which script makes it, which results files it writes,
how its table is drawn, and which code it measures (`depends_on`: a result is stale once any of these
paths differs from the commit the result was measured at). `bench/report.py` renders the page from it.

A result written through `bench/provenance.py` names its own commit and `depends_on`; for older results
(no `provenance`) the commit is the one that last wrote the file and `depends_on` comes from here.
"""

from __future__ import annotations

from typing import Any

from bench.report_tables import (
    render_algorithms,
    render_context_growth,
    render_dispatch,
    render_dispatch_cluster,
    render_e2e,
    render_generic,
    render_learning,
    render_memory_model,
    render_openai_endpoint,
    render_policy_audit,
    render_selector,
    render_weight_sync,
)

BENCHMARKS: list[dict[str, Any]] = [
    {"name": "dispatch", "depends_on": ["earl_stream/store", "bench/dispatch.py", "bench/dispatch_common.py"],
     "title": "Dispatch: layout-aware pull vs central vs Ray", "script": "bench/dispatch.py",
     "command": "python bench/dispatch.py --json bench/results/dispatch.json", "files": ["dispatch.json", "dispatch_ucx.json"],
     "render": render_dispatch},
    {"name": "dispatch_cluster", "depends_on": ["earl_stream/store", "bench/dispatch_cluster.py", "bench/dispatch_common.py"],
     "title": "Dispatch at cluster shape: rate-limited hosts, experience and weights",
     "script": "bench/dispatch_cluster.py",
     "command": "sudo python bench/dispatch_cluster.py --json bench/results/dispatch_cluster.json",
     "files": ["dispatch_cluster.json", "dispatch_cluster_*.json"], "render": render_dispatch_cluster},
    {"name": "memory_model", "depends_on": ["earl_stream/supervisor/memory_model.py", "earl_stream/workers", "bench/memory_model.py"],
     "title": "Memory model: predicted vs measured peak memory",
     "script": "bench/memory_model.py", "command": "python bench/memory_model.py --json bench/results/memory_model.json",
     "files": ["memory_model.json"], "render": render_memory_model},
    {"name": "weight_sync", "depends_on": ["earl_stream/store/weights.py", "earl_stream/workers/sharding.py", "bench/weight_sync.py"],
     "title": "Weight sync: sharded publish + pull vs the rank-0 full copy",
     "script": "bench/weight_sync.py", "command": "python bench/weight_sync.py --json bench/results/weight_sync.json",
     "files": ["weight_sync.json"], "render": render_weight_sync},
    {"name": "selector", "depends_on": ["earl_stream/supervisor", "earl_stream/workers", "bench/selector.py"],
     "title": "Parallelism selector: static plans vs the adaptive selector",
     "script": "bench/selector.py", "command": "python bench/selector.py --json bench/results/selector.json",
     "files": ["selector.json"], "render": render_selector},
    {"name": "engine", "depends_on": ["earl_stream/workers/engines", "bench/engine.py"],
     "title": "Engine: built-in engine vs `model.generate` on multi-turn episodes",
     "script": "bench/engine.py", "command": "python bench/engine.py --json bench/results/engine.json",
     "files": ["engine.json"], "render": render_generic},
    {"name": "learning", "depends_on": ["earl_stream", "envs/tictactoe.py", "bench/learning.py"],
     "title": "Learning: win rate against the random opponent over time",
     "script": "bench/learning.py", "command": "python bench/learning.py --minutes 15 --json bench/results/learning.json",
     "files": ["learning.json", "learning_*.json"], "render": render_learning},
    {"name": "real_model", "depends_on": ["earl_stream", "configs/smollm2_arithmetic.yaml", "bench/real_model.py"],
     "title": "A real pretrained model: SmolLM2-135M-Instruct learns arithmetic",
     "script": "bench/real_model.py", "command": "python bench/real_model.py --minutes 60 --json bench/results/real_model.json",
     "files": ["real_model.json", "real_model_*.json"], "render": render_generic},
    {"name": "algorithms", "depends_on": ["earl_stream/algo", "earl_stream/workers/train_step.py", "bench/algorithms.py"],
     "title": "Algorithms: estimators and loss options on the same budget and seeds",
     "script": "bench/algorithms.py", "command": "python bench/algorithms.py --minutes 5 --seeds 0 1",
     "files": ["algorithms.json"], "render": render_algorithms},
    {"name": "policy_audit", "depends_on": ["bench/policy_audit.py", "envs/tictactoe.py"],
     "title": "Exact audits of Tic-Tac-Toe policies: where the win rate stops",
     "script": "bench/policy_audit.py",
     "command": "python bench/policy_audit.py RUN_DIR/checkpoints/step_N ... --json bench/results/policy_audit.json",
     "files": ["policy_audit.json"], "render": render_policy_audit},
    {"name": "context_growth", "depends_on": ["earl_stream/supervisor", "earl_stream/workers", "bench/context_growth.py"],
     "title": "Growing contexts: a static context limit vs the selector (EARL's Figure 1)",
     "script": "bench/context_growth.py",
     "command": "python bench/context_growth.py --unbounded --json bench/results/context_growth.json",
     "files": ["context_growth.json", "context_growth_*.json"],
     "render": render_context_growth},
    {"name": "openai_endpoint", "depends_on": ["earl_stream/openai_api", "earl_stream/workers/agent_runner.py", "bench/openai_endpoint.py"],
     "title": "OpenAI endpoint: agents through the API vs the built-in agent loop",
     "script": "bench/openai_endpoint.py",
     "command": "python bench/openai_endpoint.py --json bench/results/openai_endpoint.json",
     "files": ["openai_endpoint.json", "openai_endpoint_*.json"], "render": render_openai_endpoint},
    {"name": "data_mac", "depends_on": ["earl_stream/store/frame_mac.py", "earl_stream/store/wire.py", "bench/data_mac.py"],
     "title": "Authenticated data-plane frames: the cost of the MAC on TCP pulls",
     "script": "bench/data_mac.py", "command": "python bench/data_mac.py --json bench/results/data_mac.json",
     "files": ["data_mac.json"], "render": render_generic},
    {"name": "supervisor_load", "depends_on": ["earl_stream/supervisor", "earl_stream/protocol.py", "bench/supervisor_load.py"],
     "title": "The control plane under load: one supervisor, thousands of workers",
     "script": "bench/supervisor_load.py",
     "command": "python bench/supervisor_load.py --json bench/results/supervisor_load.json",
     "files": ["supervisor_load.json"], "render": render_generic},
    {"name": "fuzz", "depends_on": ["earl_stream", "bench/fuzz.py"],
     "title": "Fuzzing every port of a live run", "script": "bench/fuzz.py",
     "command": "python bench/fuzz.py --json bench/results/fuzz.json", "files": ["fuzz.json"], "render": render_generic},
    {"name": "chaos", "depends_on": ["earl_stream", "bench/chaos.py"],
     "title": "Chaos: kill -9 of workers, trainer ranks and the supervisor during a run",
     "script": "bench/chaos.py", "command": "python bench/chaos.py --minutes 10 --json bench/results/chaos.json",
     "files": ["chaos.json"], "render": render_generic},
    {"name": "e2e", "depends_on": ["earl_stream", "bench/e2e.py"],
     "title": "End-to-end: asynchronous vs synchronous vs TRL", "script": "bench/e2e.py",
     "command": "python bench/e2e.py --json bench/results/e2e.json", "files": ["e2e.json"], "render": render_e2e},
    {"name": "real_scale", "depends_on": ["earl_stream/supervisor", "earl_stream/workers", "envs/long_recall.py", "bench/real_scale.py"],
     "title": "Real scale: SmolLM2-135M under a per-rank memory cap as contexts grow 8x",
     "script": "bench/real_scale.py", "command": "python bench/real_scale.py --json bench/results/real_scale.json",
     "files": ["real_scale.json", "real_scale_long.json", "real_scale_gpu.json"], "render": render_generic},
    {"name": "lora", "depends_on": ["earl_stream/model/lora.py", "earl_stream/store/weights.py", "bench/lora.py"],
     "title": "LoRA: adapter-only weight sync and the trainer's peak vs the full fine-tune",
     "script": "bench/lora.py", "command": "python bench/lora.py --json bench/results/lora.json",
     "files": ["lora.json"], "render": render_generic},
    {"name": "rollout_memory", "depends_on": ["earl_stream/workers/engines", "bench/rollout_memory.py"],
     "title": "Rollout memory: the engine's KV budget and admission under a memory cap",
     "script": "bench/rollout_memory.py", "command": "python bench/rollout_memory.py --json bench/results/rollout_memory.json",
     "files": ["rollout_memory.json", "rollout_memory_gpu.json"], "render": render_generic},
    {"name": "gpu_check", "depends_on": ["earl_stream", "scripts/test-gpu.sh"],
     "title": "GPU check: the GPU-marked tests and a short run on a lent GPU",
     "script": "scripts/gpu-session.sh", "command": "bash scripts/gpu-session.sh (on a GPU host)",
     "files": ["gpu_check.json"], "render": render_generic},
]


# ---------------------------------------------------------------------------- the README's results table

def _r(x: float, digits: int = 2) -> str:
    return f"{x:.{digits}f}".rstrip("0").rstrip(".") if isinstance(x, float) else str(x)


def _minmax(values: Any) -> tuple[float, float]:
    vals = [float(v) for v in (values.values() if isinstance(values, dict) else values) if v is not None]
    return min(vals), max(vals)


def _real_scale(d: dict[str, Any]) -> str:
    per_phase = [p["ratio"] for p in d.get("vs_best_static_per_phase") or [] if p.get("ratio") is not None]
    best = f"-{_r(max(per_phase))}x" if per_phase else "x"
    crashed = sum(1 for s in d["static"].values() if isinstance(s, dict) and s.get("crashed"))
    return (f"selector: {int(d['adaptive_crashed'])} crashes, {d['adaptive_truncated']} truncations; "
            f"{_r(d['vs_best_static_min'])}{best} the best surviving static plan per phase; {crashed} static plans "
            f"crashed; contexts grew {_r(d['context_growth'], 1)}x")


def _gpu_scale(d: dict[str, Any]) -> str:
    lo, hi = _minmax(d["vs_static"])
    return (f"one GPU, 1K-16K tokens: static OOM at {d['static_crashed_at']:,}, selector survived; "
            f"{_r(lo)}-{_r(hi)}x static's tokens/s")


def _weight_sync(d: dict[str, Any]) -> str:
    lo, hi = _minmax(d["full_over_sharded_total_seconds"])
    return f"sharded publish + pull {_r(lo, 1)}-{_r(hi, 1)}x faster than the rank-0 full copy"


# (what, results file, headline of the figure with the worst beside the best)
HEADLINES: list[tuple[str, str, Any]] = [
    ("Layout-aware pull vs a central controller", "dispatch.json",
     lambda d: f"{_r(d['speedup_vs_central'], 1)}x central, {_r(d['speedup_vs_ray'], 1)}x Ray (one host, "
               f"{d['bytes_per_step'] / 2**20:,.0f} MiB per step)"),
    ("Growing contexts, 1M model (EARL Fig. 1)", "context_growth.json",
     lambda d: f"final success: selector {_r(d['adaptive_final_success'])}, static {_r(d['static_final_success'])} "
               f"(static truncated {d['static_truncated_fraction']:.0%})"),
    ("Real scale, SmolLM2-135M, 2 CPU ranks", "real_scale_long.json", _real_scale),
    ("Real scale, SmolLM2-135M, one GPU", "real_scale_gpu.json", _gpu_scale),
    ("Memory model, SmolLM2-135M", "memory_model.json",
     lambda d: f"max relative error {_r(d['real_model']['max_relative_error_real_model'], 3)} (dp2, fsdp2, +rc; 1K-4K)"),
    ("Weight sync, sharded vs full", "weight_sync.json", _weight_sync),
    ("LoRA weight sync, SmolLM2-135M", "lora.json",
     lambda d: f"{d['sync_bytes_ratio']:.0f}x fewer bytes, {_r(d['sync_seconds_ratio'], 1)}x faster per version"),
    ("Built-in engine vs `generate`", "engine.json",
     lambda d: f"{_r(d['speedup_min_over_batch_sizes'], 1)}-{_r(d['speedup_vs_hf_generate'], 1)}x tokens/s"),
    ("Learning, embedded Tic-Tac-Toe", "learning.json",
     lambda d: f"win rate {_r(d['start_win_rate'])} -> {_r(d['final_win_rate'])} in {d['budget_minutes']:.0f} min "
               f"(second half: min {_r(d['min_win_rate_second_half'])}, mean {_r(d['mean_win_rate_second_half'])})"),
    ("Learning, SmolLM2-135M arithmetic", "real_model.json",
     lambda d: f"held-out success {_r(d['eval_success_before'])} -> {_r(d['eval_success_after'])} in "
               f"{d['minutes']:.0f} min"),
    ("Async vs sync vs TRL", "e2e.json",
     lambda d: f"samples/s: {_r(d['async_vs_sync'])}x sync, {_r(d['async_vs_trl'])}x TRL (TRL faster)"
     if d["async_vs_trl"] < 1 else f"samples/s: {_r(d['async_vs_sync'])}x sync, {_r(d['async_vs_trl'])}x TRL"),
    ("Frame MACs on TCP pulls", "data_mac.json",
     lambda d: f"{_r(d['best_mac_over_open'])}-{_r(d['worst_mac_over_open'])}x the open pull's time"),
    ("Chaos (kill -9 of every role)", "chaos.json",
     lambda d: f"{sum(d['kills_by_role'].values())} kills: {d['duplicates_detected']} duplicates, "
               f"{d['samples_lost']} samples lost and their prompts re-issued"),
    ("GPU check", "gpu_check.json",
     lambda d: f"GPU tests passed; a 6-step run at {d['up']['tokens_per_second']:,.0f} tokens/s"),
]
