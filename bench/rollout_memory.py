"""The rollout engine under a real memory cap while multi-turn contexts grow.

    python bench/rollout_memory.py [--device cuda] [--memory-mib 1024] [--quick] [--json PATH]
    python bench/rollout_memory.py --prefill [--repeats 3] [--json bench/results/rollout_prefill_chunks.json]

A SmolLM2-135M-shaped model (random weights: memory does not depend on them; bf16 on CUDA, fp32 on
CPU) in the built-in engine, EPISODES multi-turn episodes played together through the batcher, each
turn's prompt the whole context so far plus a long observation (contexts grow from ~300 to ~4,000
tokens; --quick: a small model and shorter contexts). The rollout selector sizes the engine's KV
budget from --memory-mib (less --reserve-mib) and the dtype; two engines run the same episodes:
- adaptive: that KV budget, admission by each row's KV (fewer rows as contexts grow);
- static: every episode's row at once (a capacity fixed for the first turn's short contexts).
On CUDA the process is capped at --memory-mib (`torch.cuda.set_per_process_memory_fraction`), so
past it an allocation really fails (the static engine's crash is a real CUDA OOM). Per turn: mean
context, most rows at once, the engine's peak KV positions, and on CUDA the measured peak bytes
against the memory model's prediction (weights + fused copies + the KV budget). JSON keys:
`device`, `memory_bytes`, `kv_budget_tokens`, `predicted_peak_bytes`, `adaptive` and `static` (each:
`crashed`, `error`, per turn `contexts` (tokens of a row at the turn's end), `most_rows` and
`decode_bytes` (CUDA memory allocated at its decode steps, at most), and over the run
`peak_kv_tokens` and `peak_bytes` (torch.cuda.max_memory_allocated)).

--prefill (chunked prefills; CPU): one prompt of 2,048 or 4,096 tokens prefilled by the built-in engine
(the 2-layer fp32 toy model of tests/workers/engines/test_engine_transient.py) in a fresh process per run, whole
and in chunks of 256, 512 and 1,024 positions (`rollout.prefill_chunk_tokens`), the arms interleaved (round robin
per repeat). Per run: the RSS high-water growth of the first long prefill over a short warm-up (KV included;
`workers.peak_memory.PeakMemory`). Times: per prompt length one process holds an engine per arm and prefills the
prompt with each in turn, 2 x repeats rounds (a shared host's load then hits every arm alike), with 1 and with 2
torch threads; wall and process CPU seconds (on a loaded host 2 threads wait on each other at every op, which
penalises the chunks' extra ops: the CPU seconds of 1 thread are the cleanest cost). JSON keys: `runs` (every
peak run: prompt, chunk, growth_bytes) and per (prompt, chunk) `arms` with the mean and 95% interval of the growth,
the memory model's prediction (transient peak + KV), and per thread count T `seconds_Tt` / `cpu_Tt` (mean, 95%
interval; `_runs`: every one) and their ratio to the whole prefill (`_vs_whole`); `host_load`: the load average
at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from bench.provenance import write_result  # noqa: E402
from bench.stats import mean_ci95, ratio_ci95  # noqa: E402
from earl_stream.config import load_config  # noqa: E402
from earl_stream.supervisor.memory_model import ModelShape, predict_kv_cache_bytes  # noqa: E402
from earl_stream.supervisor.rollout_memory import engine_transient  # noqa: E402
from earl_stream.supervisor.rollout_selector import rollout_selector_for  # noqa: E402
from earl_stream.workers.engines import AsyncBatcher, GenerateRequest, TorchEngine  # noqa: E402

MIB = 1 << 20
SMOLLM2 = {"model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
           "num_key_value_heads": 3, "intermediate_size": 1536, "vocab_size": 49152, "tie_word_embeddings": True,
           "max_position_embeddings": 8192}
QUICK = {**SMOLLM2, "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 128, "vocab_size": 512}


def episodes(engine: TorchEngine, n: int, turns: int, first: int, observation: int, reply: int) -> dict[str, Any]:
    """`n` episodes in lockstep turns through the batcher; per turn the most rows at once and peaks."""
    vocab = int(engine._vocab)  # noqa: SLF001 (a bench reads the engine's vocabulary size)
    cuda = engine._device.type == "cuda"  # noqa: SLF001
    rows_seen: list[int] = [0] * turns
    bytes_seen: list[int] = [0] * turns  # CUDA memory allocated at the turn's decode steps, at most
    out: dict[str, Any] = {"crashed": False, "error": None, "turns": []}

    def ids(k: int, seed: int) -> list[int]:
        return torch.randint(1, vocab, (k,), generator=torch.Generator().manual_seed(seed)).tolist()

    async def play(e: int, batcher: AsyncBatcher, turn_done: list[asyncio.Barrier]) -> None:
        context = ids(first, e)
        for t in range(turns):
            def seen(_tok: int, t: int = t) -> None:
                rows_seen[t] = max(rows_seen[t], engine.stats.running_rows)
                if cuda:
                    bytes_seen[t] = max(bytes_seen[t], torch.cuda.memory_allocated())

            try:
                res = await batcher.generate(GenerateRequest(context, reply, seed=e * 1000 + t, cache_key=f"e{e}",
                                                             on_token=seen))
                context = context + res.token_ids + ids(observation, e * 100 + t)
            finally:
                await turn_done[t].wait()

    async def go() -> None:
        batcher = AsyncBatcher(engine, max_batch_size=256)
        barriers = [asyncio.Barrier(n) for _ in range(turns)]
        try:
            await asyncio.gather(*[play(e, batcher, barriers) for e in range(n)])
        finally:
            await batcher.aclose()

    start = time.time()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    try:
        asyncio.run(go())
    except Exception as exc:  # the static engine's OOM surfaces as the batch's EngineError
        out["crashed"], out["error"] = True, f"{type(exc).__name__}: {str(exc)[:300]}"
    out["seconds"] = round(time.time() - start, 1)
    out["most_rows"] = rows_seen
    out["decode_bytes"] = bytes_seen if cuda else None
    out["contexts"] = [first + t * (reply + observation) + reply for t in range(turns)]
    out["peak_kv_tokens"] = engine.stats.peak_kv_tokens
    out["peak_bytes"] = torch.cuda.max_memory_allocated() if cuda else None
    return out


TOY = {"model_type": "qwen2", "hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 2,
       "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "tie_word_embeddings": True,
       "max_position_embeddings": 8192}
PREFILL_PROMPTS, PREFILL_CHUNKS, PREFILL_THREADS = (2048, 4096), (0, 256, 512, 1024), (1, 2)
_PREFILL_SETUP = """
import json, sys, time
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM
from earl_stream.workers.engines.base import GenerateRequest
from earl_stream.workers.engines.torch_engine import TorchEngine
from earl_stream.workers.peak_memory import PeakMemory
n, chunks, repeats, config, threads = (int(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3]),
                                      json.loads(sys.argv[4]), int(sys.argv[5]))
torch.set_num_threads(threads)
config.pop("model_type")
torch.manual_seed(0)
model = Qwen2ForCausalLM(Qwen2Config(**config)).eval()
engines = [TorchEngine(model, max_batch_size=4, kv_budget_tokens=n + 64, prefill_chunk_tokens=c) for c in chunks]
for engine in engines:
    engine.generate([GenerateRequest(prompt_ids=list(range(1, 17)), max_new_tokens=2, temperature=0.0)])
long = GenerateRequest(prompt_ids=[1 + i % 500 for i in range(n)], max_new_tokens=1, temperature=0.0)
"""
# one arm's first long prefill in a fresh process: RSS high-water growth over the warm-up (KV included)
_PEAK_PROBE = _PREFILL_SETUP + """
peak = PeakMemory(torch.device("cpu"))
peak.start()
engines[0].generate([long])
print(json.dumps({"growth": peak.step_peak(), "path": engines[0].decode_path.path.value}))
"""
# every arm in one process, round robin: the seconds of each long prefill
_TIME_PROBE = _PREFILL_SETUP + """
for engine in engines:
    engine.generate([long])  # first touch of its buffers
seconds, cpu = [[] for _ in engines], [[] for _ in engines]
for _ in range(repeats):
    for i, engine in enumerate(engines):
        start, used = time.perf_counter(), time.process_time()
        engine.generate([long])
        seconds[i].append(time.perf_counter() - start)
        cpu[i].append(time.process_time() - used)
print(json.dumps({"seconds": seconds, "cpu": cpu}))
"""


def _probe(code: str, *args: str, threads: int = 2) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=900, env=env,
                         check=True, cwd=Path(__file__).resolve().parents[1])
    got: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return got


def prefill_chunks(repeats: int) -> dict[str, Any]:
    """The --prefill measurement (module docstring): peaks in a fresh process per run, the arms interleaved; times
    of every arm interleaved in one process per prompt length."""
    runs, timed = [], {}
    for r in range(repeats):
        for n in PREFILL_PROMPTS:
            for chunk in PREFILL_CHUNKS:
                got = _probe(_PEAK_PROBE, str(n), json.dumps([chunk]), "0", json.dumps(TOY), "2")
                runs.append({"repeat": r, "prompt": n, "chunk": chunk, "growth_bytes": got["growth"],
                             "path": got["path"]})
                print(f"repeat {r} prompt {n:5} chunk {chunk:5}: growth {got['growth'] / MIB:7.1f} MiB", flush=True)
    for threads in PREFILL_THREADS:
        for n in PREFILL_PROMPTS:
            got = _probe(_TIME_PROBE, str(n), json.dumps(PREFILL_CHUNKS), str(max(3, 2 * repeats)), json.dumps(TOY),
                         str(threads), threads=threads)
            timed[threads, n] = {"seconds": dict(zip(PREFILL_CHUNKS, got["seconds"])),
                                 "cpu": dict(zip(PREFILL_CHUNKS, got["cpu"]))}
    shape = ModelShape.from_hf(TOY)
    arms = []
    for n in PREFILL_PROMPTS:
        for chunk in PREFILL_CHUNKS:
            predicted = (engine_transient(shape, design_seq_len=n, rows=1, dtype_bytes=4, prefill_chunk_tokens=chunk)
                         .peak_bytes + predict_kv_cache_bytes(shape, n + 1, dtype_bytes=4))
            arm: dict[str, Any] = {"prompt": n, "chunk": chunk, "predicted_bytes": predicted,
                                   "growth_bytes": mean_ci95([x["growth_bytes"] for x in runs
                                                              if x["prompt"] == n and x["chunk"] == chunk])}
            for threads in PREFILL_THREADS:
                t = timed[threads, n]
                for kind in ("seconds", "cpu"):
                    arm[f"{kind}_{threads}t_runs"] = t[kind][chunk]
                    arm[f"{kind}_{threads}t"] = mean_ci95(t[kind][chunk])
                    arm[f"{kind}_{threads}t_vs_whole"] = ratio_ci95(t[kind][chunk], t[kind][0])
            arms.append(arm)
    print(f"{'prompt':>6} {'chunk':>5} {'growth MiB (95% CI)':>24} {'model MiB':>9}  time vs whole, mean ratio [95% CI]: "
          + "  ".join(f"{k} {t}t" for t in PREFILL_THREADS for k in ("wall", "cpu")))
    for a in arms:
        g = a["growth_bytes"]
        ratios = "  ".join(f"{a[f'{k}_{t}t_vs_whole']['ratio']:5.2f} [{a[f'{k}_{t}t_vs_whole']['low']:4.2f}, "
                           f"{a[f'{k}_{t}t_vs_whole']['high']:4.2f}]" for t in PREFILL_THREADS for k in ("seconds", "cpu"))
        print(f"{a['prompt']:>6} {a['chunk']:>5} {g['mean'] / MIB:8.1f} [{g['low'] / MIB:6.1f}, {g['high'] / MIB:6.1f}] "
              f"{a['predicted_bytes'] / MIB:9.1f}  {ratios}")
    return {"device": "cpu", "dtype": "fp32", "model": "qwen2 toy (h 256, I 1024, 2 layers, 4/2 heads, V 512)",
            "peak_threads": 2, "time_threads": list(PREFILL_THREADS), "repeats": repeats, "runs": runs, "arms": arms,
            "host_load": os.getloadavg()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--memory-mib", type=int, default=1024)
    ap.add_argument("--reserve-mib", type=int, default=256)
    ap.add_argument("--episodes", type=int, default=32)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--prefill", action="store_true", help="measure chunked against whole prefills (CPU)")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    if a.prefill:
        measured = prefill_chunks(a.repeats)
        if a.json:
            write_result(a.json, measured, depends_on=["earl_stream/workers/engines", "earl_stream/supervisor/rollout_memory.py",
                                                     "bench/rollout_memory.py"], indent=1)
        return 0
    device = torch.device(a.device)
    dtype = "bf16" if device.type == "cuda" else "fp32"
    config = QUICK if a.quick else SMOLLM2
    turns, first, observation, reply = (4, 40, 100, 8) if a.quick else (6, 256, 700, 32)
    cfg = load_config(None, [f"rollout.dtype={dtype}", f"rollout.memory_bytes={a.memory_mib * MIB}",
                             f"selector.reserve_bytes={a.reserve_mib * MIB}", "rollout.max_batch_size=256"])
    shape = ModelShape.from_hf(config)
    sel = rollout_selector_for(cfg, shape, a.memory_mib * MIB, "--memory-mib")
    kv_tokens = sel.kv_capacity_tokens()
    per_token = predict_kv_cache_bytes(shape, 1, dtype_bytes=2 if dtype == "bf16" else 4)
    predicted = sel.weight_bytes() + kv_tokens * per_token
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                              "dtype": dtype, "model": "SmolLM2-135M shape" if not a.quick else "quick",
                              "memory_bytes": a.memory_mib * MIB, "reserve_bytes": a.reserve_mib * MIB,
                              "kv_budget_tokens": kv_tokens, "kv_bytes_per_token": per_token,
                              "predicted_peak_bytes": predicted, "episodes": a.episodes}
    if device.type == "cuda":  # a real cap: past it the caching allocator's allocation fails
        torch.cuda.set_per_process_memory_fraction(a.memory_mib * MIB / torch.cuda.get_device_properties(device).total_memory)
    for name, budget, rows in (("adaptive", kv_tokens, 256), ("static", 1 << 26, a.episodes)):
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**config)).to(device=device, dtype=torch.bfloat16 if dtype == "bf16"
                                                                                else torch.float32).eval()
        engine = TorchEngine(model, max_batch_size=rows, kv_budget_tokens=budget)
        result[name] = episodes(engine, a.episodes, turns, first, observation, reply)
        del engine, model
        gc.collect()  # the batcher's loop objects hold the engine in reference cycles
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
    print(f"{result['device']} {dtype}: memory {a.memory_mib} MiB, KV budget {kv_tokens} tokens "
          f"({per_token} B/token), predicted peak {predicted / MIB:.0f} MiB")
    print(f"{'run':9} {'crashed':8} {'most rows per turn (context tokens)':60} {'peak KV tok':>11} {'peak MiB':>9}")
    for name in ("adaptive", "static"):
        r = result[name]
        turns_text = " ".join(f"{m}({c})" for m, c in zip(r["most_rows"], r["contexts"]))
        peak = f"{r['peak_bytes'] / MIB:.0f}" if r["peak_bytes"] else "-"
        print(f"{name:9} {str(r['crashed']):8} {turns_text:60} {r['peak_kv_tokens']:>11} {peak:>9}")
        if r["error"]:
            print(f"          {r['error'][:200]}")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        write_result(a.json, result, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
