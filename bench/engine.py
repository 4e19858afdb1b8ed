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

    python bench/engine.py [--quick] [--json PATH] [--model default|tiny] [--batch-sizes 1,8,32]
"""

from __future__ import annotations

import argparse
import json
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

from earl_stream.chat import ChatFormat  # noqa: E402
from earl_stream.modeling import ensure_default_model, init_model, load_model  # noqa: E402
from earl_stream.workers.engines import GenerateRequest, TorchEngine  # noqa: E402

log = logging.getLogger("bench.engine")
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
    cfg = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=w.new_tokens,
                           min_new_tokens=w.new_tokens, pad_token_id=pad_id, eos_token_id=chat.end_token_id,
                           output_scores=True, return_dict_in_generate=True)
    first, after = script(chat, w)
    contexts = [list(f) for f in first]
    generated = prefill = forwards = 0
    start = time.perf_counter()
    for k in range(w.turns):
        width = max(len(c) for c in contexts)
        ids = torch.full((len(contexts), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(contexts), width), dtype=torch.long)
        for e, ctx in enumerate(contexts):
            ids[e, width - len(ctx) :] = torch.tensor(ctx)
            mask[e, width - len(ctx) :] = 1
        torch.manual_seed(w.seed * 7919 + k)
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
        new = out.sequences[:, width:]
        logprobs = model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
        assert new.shape == logprobs.shape == (len(contexts), w.new_tokens)
        prefill += int(mask.sum())
        forwards += w.new_tokens
        for e, tokens in enumerate(new.tolist()):
            generated += len(tokens)
            contexts[e] = contexts[e] + tokens + after[e][k]
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "generated_tokens": generated, "tokens_per_s": generated / seconds,
            "prefill_tokens": prefill, "forward_calls": forwards,
            "final_context_tokens": max(len(c) for c in contexts)}


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small workload (a smoke run, ~1 min)")
    ap.add_argument("--json", default="bench/results/engine.json", help="where to write the results")
    ap.add_argument("--model", choices=("default", "tiny"), default="default",
                    help="default: the embedded run's model (ensure_default_model); tiny: a fresh init_model")
    ap.add_argument("--batch-sizes", default=None, help="concurrent episodes, comma separated (default 1,8,32)")
    ap.add_argument("--turns", type=int, default=None, help="turns per episode (default 8)")
    ap.add_argument("--new-tokens", type=int, default=None, help="tokens generated per turn (default 16)")
    ap.add_argument("--reps", type=int, default=None, help="repetitions per engine (median; default 3)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
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
    else:
        import tempfile

        model_dir = init_model(Path(tempfile.mkdtemp(prefix="earl-bench-")) / "tiny", seed=0)
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
        "host": {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
                 # a shared machine: ratios hold better than absolute tokens/s when others load it
                 "loadavg_1m_before": load_before, "loadavg_1m_after": os.getloadavg()[0]},
    }
    log.info("speedup vs HF generate over the whole workload: %.2fx (min over batch sizes %.2fx)",
             result["speedup_vs_hf_generate"], result["speedup_min_over_batch_sizes"])
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    log.info("wrote %s", out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
