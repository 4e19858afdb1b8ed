"""Benchmark: the built-in engine against plain `transformers` `model.generate` on multi-turn episodes.

Both generate for the same model, the same episodes and the same sampling settings (temperature 1,
no top-k/top-p, every reply exactly `--new-tokens` tokens, per-token log-probs returned), in one run:

- builtin:     `TorchEngine.generate`, one call per turn for all concurrent episodes; each episode's
               KV cache is kept between its turns (`cache_key`), so a turn pre-fills only the new
               observation tokens.
- hf_generate: what users do without an engine: every turn, the full context of every concurrent
               episode, left-padded into one batch, goes through `model.generate(...,
               output_scores=True)` (log-probs from the processed scores); the whole context is
               pre-filled again every turn.

An episode is a fixed multi-turn script (a Tic-Tac-Toe-like board as the observation of every turn):
turn k appends the model's reply, the end-of-turn token and the next observation, then generates
again, as the agent loop does. Wall time of the whole workload; median over repetitions, the two
engines alternating (the machine is shared).

GRPO-shaped rows (`grpo`; every model): groups of `--group-size` samples of one chat prompt each.
- batch:     every group at once, same prompts and sampling (temperature 1, exactly `--grpo-new-tokens`
             each): builtin (`TorchEngine`, the group's prompt prefilled once) vs hf_generate vs vLLM
             (`--vllm`, the project's `VllmEngine`; run the bench with .venv-vllm's python).
- staggered: groups arrive `--gap-s` apart and each sample stops after its own length (8 to
             `--grpo-new-tokens` tokens, as stop tokens would): the built-in engine with continuous
             batching + prefix sharing vs the same engine batch-to-completion without sharing (the
             behaviour before them). Makespan, tokens/s and mean request latency.

    python bench/engine.py [--quick] [--json PATH] [--model default|tiny|smollm2|DIR] [--batch-sizes 1,8,32]
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from transformers import GenerationConfig, PreTrainedModel  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.provenance import write_result  # noqa: E402
from earl_stream.model import ensure_default_model, init_model, load_model  # noqa: E402
from earl_stream.model.chat import ChatFormat  # noqa: E402
from earl_stream.workers.engines import GenerateRequest, TorchEngine  # noqa: E402
from earl_stream.workers.engines.running import Row  # noqa: E402

log = logging.getLogger("bench.engine")
SMOLLM2_DIR = Path(os.environ.get("EARL_STREAM_CACHE", Path.home() / ".cache" / "earl_stream")) / "models" / (
    "smollm2-135m-instruct")
SYSTEM = "Play Tic-Tac-Toe as X. Reply with the number of an empty cell."


@dataclass(frozen=True)
class Workload:
    episodes: int  # concurrent episodes (the batch size of both engines)
    turns: int
    new_tokens: int  # generated per turn
    seed: int = 0


def board(episode: int, turn: int) -> str:
    cells = [str(i + 1) for i in range(9)]
    for j in range(min(turn * 2, 8)):
        cells[(episode * 5 + j * 4) % 9] = "XO"[j % 2]
    return f"Board after move {turn}:\n" + "\n".join(" ".join(cells[r * 3 : r * 3 + 3]) for r in range(3)) + "\nYour move."


def script(chat: ChatFormat, w: Workload) -> tuple[list[list[int]], list[list[list[int]]]]:
    """First-turn tokens per episode, and the tokens appended after each reply (end token + next turn)."""
    first = [chat.first_turn(SYSTEM, board(e, 0)) for e in range(w.episodes)]
    after = [[[chat.end_token_id, *chat.next_turn(board(e, k + 1))] for k in range(w.turns)] for e in range(w.episodes)]
    return first, after


def run_builtin(model: PreTrainedModel, chat: ChatFormat, w: Workload) -> dict[str, Any]:
    engine = TorchEngine(model, max_batch_size=max(1, w.episodes), kv_budget_tokens=1 << 20, seed=w.seed)
    first, after = script(chat, w)
    contexts = [list(f) for f in first]
    generated = 0
    start = time.perf_counter()
    for k in range(w.turns):
        requests = [GenerateRequest(prompt_ids=ctx, max_new_tokens=w.new_tokens, temperature=1.0,
                                    seed=w.seed * 7919 + e * 101 + k, cache_key=f"episode-{e}")
                    for e, ctx in enumerate(contexts)]
        for e, result in enumerate(engine.generate(requests)):
            assert len(result.token_ids) == w.new_tokens == len(result.logprobs)
            generated += len(result.token_ids)
            contexts[e] = contexts[e] + result.token_ids + after[e][k]
    seconds = time.perf_counter() - start
    s = engine.stats
    return {"seconds": seconds, "generated_tokens": generated, "tokens_per_s": generated / seconds,
            "prefill_tokens": s.prefill_tokens, "reused_tokens": s.reused_tokens, "forward_calls": s.forward_calls,
            "final_context_tokens": max(len(c) for c in contexts)}


def run_hf(model: PreTrainedModel, chat: ChatFormat, w: Workload, pad_id: int) -> dict[str, Any]:
    first, after = script(chat, w)
    contexts = [list(f) for f in first]
    generated = prefill = forwards = 0
    start = time.perf_counter()
    for k in range(w.turns):
        new = hf_sample(model, contexts, w.new_tokens, pad_id, chat.end_token_id, w.seed * 7919 + k)
        prefill += sum(len(c) for c in contexts)
        forwards += w.new_tokens
        for e, tokens in enumerate(new.tolist()):
            generated += len(tokens)
            contexts[e] = contexts[e] + tokens + after[e][k]
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "generated_tokens": generated, "tokens_per_s": generated / seconds,
            "prefill_tokens": prefill, "forward_calls": forwards,
            "final_context_tokens": max(len(c) for c in contexts)}


def hf_sample(model: PreTrainedModel, contexts: list[list[int]], new_tokens: int, pad_id: int, eos_id: int,
              seed: int) -> torch.Tensor:
    """`model.generate` over left-padded contexts, exactly `new_tokens` sampled each, with their log-probs.
    Returns the new tokens [B, new_tokens]."""
    cfg = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, pad_token_id=pad_id, eos_token_id=eos_id,
                           output_scores=True, return_dict_in_generate=True)
    width = max(len(c) for c in contexts)
    ids = torch.full((len(contexts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(contexts), width), dtype=torch.long)
    for e, ctx in enumerate(contexts):
        ids[e, width - len(ctx) :] = torch.tensor(ctx)
        mask[e, width - len(ctx) :] = 1
    torch.manual_seed(seed)
    out = model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
    logprobs = model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
    assert logprobs.shape == (len(contexts), new_tokens)
    return out.sequences[:, width:]


def compare(model: PreTrainedModel, chat: ChatFormat, w: Workload, reps: int, pad_id: int) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {"builtin": [], "hf_generate": []}
    for r in range(reps):
        order = ["builtin", "hf_generate"] if r % 2 == 0 else ["hf_generate", "builtin"]
        for name in order:
            res = run_builtin(model, chat, w) if name == "builtin" else run_hf(model, chat, w, pad_id)
            runs[name].append(res)
    out: dict[str, Any] = {"batch_size": w.episodes, "episodes": w.episodes, "turns": w.turns,
                           "new_tokens_per_turn": w.new_tokens}
    for name, results in runs.items():
        seconds = statistics.median(x["seconds"] for x in results)
        summary = dict(results[0])
        summary["seconds"] = seconds
        summary["tokens_per_s"] = summary["generated_tokens"] / seconds
        summary["seconds_all_reps"] = [round(x["seconds"], 4) for x in results]
        out[name] = summary
    out["speedup"] = out["hf_generate"]["seconds"] / out["builtin"]["seconds"]
    # fastest repetition of each: the least disturbed by other load on a shared machine
    out["speedup_best_of_reps"] = (min(x["seconds"] for x in runs["hf_generate"])
                                   / min(x["seconds"] for x in runs["builtin"]))
    return out

GRPO_SYSTEM = "You are a helpful assistant. Answer with a number only."


@dataclass(frozen=True)
class Grpo:
    groups: int
    group_size: int
    new_tokens: int  # per sample (the most, in the staggered row)
    seed: int = 0


def grpo_requests(chat: ChatFormat, g: Grpo, varied: bool) -> list[list[GenerateRequest]]:
    """One list per group: `group_size` samples of the group's prompt, each with its own seed; `varied`
    gives each sample its own length in [8, new_tokens] (what stop tokens do), else exactly new_tokens."""
    out = []
    for k in range(g.groups):
        prompt = chat.first_turn(GRPO_SYSTEM, f"What is {17 + 13 * k} + {25 + 9 * k}? Then explain briefly.")
        lengths = [8 + (k * 31 + i * 17) % max(1, g.new_tokens - 7) if varied else g.new_tokens
                   for i in range(g.group_size)]
        out.append([GenerateRequest(prompt, n, temperature=1.0, seed=g.seed * 7919 + k * 101 + i)
                    for i, n in enumerate(lengths)])
    return out


def grpo_builtin(model: PreTrainedModel, groups: list[list[GenerateRequest]]) -> dict[str, Any]:
    engine = TorchEngine(model, max_batch_size=64, kv_budget_tokens=1 << 20)
    reqs = [r for group in groups for r in group]
    start = time.perf_counter()
    results = engine.generate(reqs)
    seconds = time.perf_counter() - start
    generated = sum(len(r.token_ids) for r in results)
    s = engine.stats
    return {"seconds": seconds, "generated_tokens": generated, "tokens_per_s": generated / seconds,
            "prefill_tokens": s.prefill_tokens, "shared_prefix_tokens": s.shared_prefix_tokens}


def grpo_hf(model: PreTrainedModel, groups: list[list[GenerateRequest]], pad_id: int, eos_id: int) -> dict[str, Any]:
    contexts = [list(r.prompt_ids) for group in groups for r in group]
    new_tokens = groups[0][0].max_new_tokens
    start = time.perf_counter()
    new = hf_sample(model, contexts, new_tokens, pad_id, eos_id, seed=0)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "generated_tokens": new.numel(), "tokens_per_s": new.numel() / seconds,
            "prefill_tokens": sum(len(c) for c in contexts)}


def grpo_vllm(model_dir: Path, groups: list[list[GenerateRequest]]) -> dict[str, Any]:
    """The project's vLLM backend on the same requests (engine start and a warm-up call not timed)."""
    from earl_stream.workers.engines.registry import make_engine

    reqs = [r for group in groups for r in group]
    engine = make_engine("vllm", model_dir, None, max_batch_size=len(reqs), kv_budget_tokens=1 << 16, seed=0)
    try:
        engine.generate(reqs[:2])
        start = time.perf_counter()
        results = engine.generate(reqs)
        seconds = time.perf_counter() - start
    finally:
        close = getattr(engine, "close", None)
        if close is not None:
            close()
    generated = sum(len(r.token_ids) for r in results)
    # vLLM's CPU worker binds its own OpenMP threads (VLLM_CPU_OMP_THREADS_BIND, default: every core it
    # sees); --threads applies only to the builtin and hf_generate rows.
    return {"seconds": seconds, "generated_tokens": generated, "tokens_per_s": generated / seconds,
            "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"), "cpus_seen": os.cpu_count()}


def grpo_staggered(model: PreTrainedModel, groups: list[list[GenerateRequest]], gap_s: float,
                   continuous: bool) -> dict[str, Any]:
    """Group k is submitted at k * gap_s; the engine is stepped (one thread) whenever it has work.
    `continuous=False` also turns prefix sharing off: the engine as it was before both."""
    engine = TorchEngine(model, max_batch_size=64, kv_budget_tokens=1 << 20, continuous=continuous,
                         prefix_sharing=continuous)
    submitted: list[tuple[float, Row]] = []
    finished: dict[int, float] = {}
    start = time.perf_counter()
    while len(submitted) < sum(len(g) for g in groups) or len(finished) < len(submitted):
        now = time.perf_counter() - start
        while len(submitted) // len(groups[0]) < len(groups) and len(submitted) // len(groups[0]) * gap_s <= now:
            k = len(submitted) // len(groups[0])
            submitted += [(k * gap_s, row) for row in engine.submit(groups[k])]
        if len(finished) == len(submitted):  # idle until the next group arrives
            time.sleep(max(0.0, len(submitted) // len(groups[0]) * gap_s - now))
            continue
        engine.step()
        for i, (_, row) in enumerate(submitted):
            if i not in finished and row.done.is_set():
                finished[i] = time.perf_counter() - start
    makespan = max(finished.values())
    generated = sum(len(row.tokens) for _, row in submitted)
    s = engine.stats
    return {"seconds": makespan, "generated_tokens": generated, "tokens_per_s": generated / makespan,
            "mean_latency_s": statistics.mean(finished[i] - arrival for i, (arrival, _) in enumerate(submitted)),
            "prefill_tokens": s.prefill_tokens, "shared_prefix_tokens": s.shared_prefix_tokens,
            "forward_calls": s.forward_calls, "admitted_while_running": s.admitted_while_running}


def grpo_rows(model: PreTrainedModel, model_dir: Path, chat: ChatFormat, g: Grpo, reps: int, pad_id: int,
              vllm: bool) -> dict[str, Any]:
    """The GRPO-shaped rows: `batch` (builtin vs hf_generate vs vLLM) and `staggered` (continuous vs before)."""
    fixed, varied = grpo_requests(chat, g, varied=False), grpo_requests(chat, g, varied=True)
    one_group = grpo_builtin(model, varied[:1])["seconds"]
    gap_s = one_group / 2  # a group arrives while the one before is halfway through
    runs: dict[str, list[dict[str, Any]]] = {"builtin": [], "hf_generate": [], "continuous": [], "before": []}
    for r in range(reps):
        for name in (["builtin", "hf_generate"] if r % 2 == 0 else ["hf_generate", "builtin"]):
            runs[name].append(grpo_builtin(model, fixed) if name == "builtin"
                              else grpo_hf(model, fixed, pad_id, chat.end_token_id))
        for name in (["continuous", "before"] if r % 2 == 0 else ["before", "continuous"]):
            runs[name].append(grpo_staggered(model, varied, gap_s, continuous=name == "continuous"))
    vllm_note = "not run (pass --vllm under .venv-vllm's python)"
    if vllm:
        try:
            runs["vllm"] = [grpo_vllm(model_dir, fixed)]
            vllm_note = "measured"
        except Exception as exc:  # a bench row, not the bench: record why and keep the others
            log.warning("vLLM row failed: %r", exc)
            vllm_note = f"failed: {exc!r}"

    def best(name: str) -> dict[str, Any]:  # the median repetition by wall time
        ordered = sorted(runs[name], key=lambda x: x["seconds"])
        return {**ordered[len(ordered) // 2], "seconds_all_reps": [round(x["seconds"], 3) for x in runs[name]]}

    batch: dict[str, Any] = {name: best(name) for name in ("builtin", "hf_generate", "vllm") if name in runs}
    batch["speedup_vs_hf_generate"] = batch["hf_generate"]["seconds"] / batch["builtin"]["seconds"]
    staggered = {"gap_s": gap_s, "continuous": best("continuous"), "before": best("before")}
    staggered["speedup"] = staggered["before"]["seconds"] / staggered["continuous"]["seconds"]
    staggered["latency_ratio"] = staggered["before"]["mean_latency_s"] / staggered["continuous"]["mean_latency_s"]
    return {"groups": g.groups, "group_size": g.group_size, "new_tokens": g.new_tokens,
            "sampling": {"temperature": 1.0, "top_k": 0, "top_p": 1.0}, "batch": batch, "staggered": staggered,
            "vllm": vllm_note}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small workload (a smoke run, ~1 min)")
    ap.add_argument("--json", default="bench/results/engine.json", help="where to write the results")
    ap.add_argument("--model", default="default",
                    help="default: the embedded run's model (ensure_default_model); tiny: a fresh init_model; "
                         "smollm2: SmolLM2-135M-Instruct from `make real-model` (skipped if not imported); "
                         "or a model directory")
    ap.add_argument("--batch-sizes", default=None, help="concurrent episodes, comma separated (default 1,8,32)")
    ap.add_argument("--turns", type=int, default=None, help="turns per episode (default 8)")
    ap.add_argument("--new-tokens", type=int, default=None, help="tokens generated per turn (default 16)")
    ap.add_argument("--reps", type=int, default=None, help="repetitions per engine (median; default 3)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--groups", type=int, default=None, help="GRPO rows: prompts (groups; default 4, quick 2)")
    ap.add_argument("--group-size", type=int, default=8, help="GRPO rows: samples per prompt")
    ap.add_argument("--grpo-new-tokens", type=int, default=None, help="GRPO rows: tokens per sample (default 48)")
    ap.add_argument("--vllm", action="store_true", help="GRPO batch row: add vLLM (run with .venv-vllm's python)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.set_num_threads(args.threads)
    batch_sizes = [int(x) for x in (args.batch_sizes or ("1,8" if args.quick else "1,8,32")).split(",")]
    turns = args.turns or (4 if args.quick else 8)
    new_tokens = args.new_tokens or (8 if args.quick else 16)
    reps = args.reps or (2 if args.quick else 3)

    if args.model == "default":
        model_dir = ensure_default_model()
    elif args.model == "tiny":
        import tempfile

        model_dir = init_model(Path(tempfile.mkdtemp(prefix="earl-bench-")) / "tiny", seed=0)
    else:
        model_dir = Path(args.model) if args.model != "smollm2" else SMOLLM2_DIR
        if not (model_dir / "config.json").is_file():
            log.warning("skipped: no model at %s (`make real-model` imports SmolLM2-135M-Instruct)", model_dir)
            return 0
    model, tokenizer = load_model(model_dir)
    model.eval()
    chat = ChatFormat(tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    params = sum(p.numel() for p in model.parameters())
    with torch.inference_mode():  # warm both paths once (allocator, lazy inits)
        warm = Workload(episodes=2, turns=2, new_tokens=2)
        run_builtin(model, chat, warm)
        run_hf(model, chat, warm, pad_id)

    load_before = os.getloadavg()[0]
    configs = []
    log.info("%5s %5s %6s | %12s %12s | %8s", "batch", "turns", "new", "builtin t/s", "hf t/s", "speedup")
    with torch.inference_mode():
        for b in batch_sizes:
            res = compare(model, chat, Workload(episodes=b, turns=turns, new_tokens=new_tokens), reps, pad_id)
            configs.append(res)
            log.info("%5d %5d %6d | %12.0f %12.0f | %7.2fx", b, turns, new_tokens, res["builtin"]["tokens_per_s"],
                     res["hf_generate"]["tokens_per_s"], res["speedup"])
        g = Grpo(args.groups or (2 if args.quick else 4), args.group_size, args.grpo_new_tokens or 48)
        grpo = grpo_rows(model, model_dir, chat, g, reps, pad_id, args.vllm)
    batch, stag = grpo["batch"], grpo["staggered"]
    log.info("GRPO batch (%d x %d, %d tokens): builtin %.1f t/s, hf_generate %.1f t/s%s", g.groups, g.group_size,
             g.new_tokens, batch["builtin"]["tokens_per_s"], batch["hf_generate"]["tokens_per_s"],
             f", vLLM {batch['vllm']['tokens_per_s']:.1f} t/s" if "vllm" in batch else "")
    log.info("GRPO staggered (gap %.2f s): continuous %.1f t/s (latency %.2f s) vs before %.1f t/s (latency %.2f s)",
             stag["gap_s"], stag["continuous"]["tokens_per_s"], stag["continuous"]["mean_latency_s"],
             stag["before"]["tokens_per_s"], stag["before"]["mean_latency_s"])
    total_hf = sum(c["hf_generate"]["seconds"] for c in configs)
    total_builtin = sum(c["builtin"]["seconds"] for c in configs)
    generated = sum(c["builtin"]["generated_tokens"] for c in configs)
    result = {
        "benchmark": "engine",
        "quick": args.quick,
        # the same whole workload (every batch size) through both engines: HF time / built-in time
        "speedup_vs_hf_generate": total_hf / total_builtin,
        "speedup_min_over_batch_sizes": min(c["speedup"] for c in configs),
        "tokens_per_s_builtin": generated / total_builtin,
        "tokens_per_s_hf_generate": generated / total_hf,
        "turns": turns,
        "new_tokens_per_turn": new_tokens,
        "batch_sizes": batch_sizes,
        "sampling": {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "logprobs": True},
        "model": {"dir": str(model_dir), "kind": args.model, "parameters": params,
                  "hidden_size": model.config.hidden_size, "layers": model.config.num_hidden_layers},
        "threads": args.threads,
        "reps": reps,
        "configs": configs,
        "grpo": grpo,
        "host": {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
                 # a shared machine: ratios hold better than absolute tokens/s when others load it
                 "loadavg_1m_before": load_before, "loadavg_1m_after": os.getloadavg()[0]},
    }
    log.info("speedup vs HF generate over the whole workload: %.2fx (min over batch sizes %.2fx)",
             result["speedup_vs_hf_generate"], result["speedup_min_over_batch_sizes"])
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_result(out, result, indent=2)
    log.info("wrote %s", out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
