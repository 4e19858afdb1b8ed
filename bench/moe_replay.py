"""Routing replay (R3) where only routing differs: engine and trainer log-probs of the same weights, in bf16.

Owns the equal-weights measurement of `bench/moe.py` and the summaries of its repeats (and of the learning
runs' repeats), so that a unit test can run the summary code on recorded repeats.

One repeat (`equal_weights_repeat`, one seed): a tiny Qwen3-MoE (8 experts, top-2, 4 layers, default init)
whose weights are rounded to bf16 once, so that the engine's bf16 copy and the trainer's fp32 master weights
under bf16 autocast hold the same numbers (the same policy version: no lag). The built-in engine (bf16
weights, continuous batching of `requests` requests of varied prompt and answer lengths into at most 8 rows,
KV-cache decode) samples the answers at temperature 1 and records each fed token's experts; the trainer's
forward (packed micro-batches of whole rows up to `micro_batch_tokens`, per-row attention, bf16 autocast,
as `train_step` runs it) scores the same tokens twice: with the routers replaying the recorded experts
(`algo.routing_replay=rollout`) and routing on their own (`none`). Both arms score the same samples (a
paired design); which arm runs first alternates with the seed.

Per arm:
- `routing_mismatch`: the fraction of recorded (token, layer) routing decisions whose top-k expert set the
  trainer's own router (its pre-replay choice) did not reproduce, over every fed token;
- `kl_k3`: KL(engine || trainer) per answer token, the k3 estimator on the engine's own samples:
  mean over tokens of (r - 1) - log r with r = p_trainer(token) / p_engine(token);
- `mean_abs_logprob_diff`: mean |log p_trainer - log p_engine| over the same tokens (nats).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from stats import mean_ci95, ratio_ci95

ARMS = {"replay": "rollout", "no_replay": "none"}  # result key -> algo.routing_replay
MODEL = {"family": "qwen3_moe", "experts": 8, "top_k": 2, "hidden_size": 64, "num_layers": 4, "expert_size": 96}
EQUAL_METRICS = ("routing_mismatch", "kl_k3", "mean_abs_logprob_diff")
GOAL_RATIO = 0.5  # KL at equal weights with replay <= 0.5x without
COLLAPSE_DROP = 0.5  # a learning run collapses when its final reward is this far below its best (rewards in [-1, 1])


def definitions() -> dict[str, str]:
    """What each figure of the result is, for its JSON."""
    return {
        "routing_mismatch": "fraction of recorded (token, layer) decisions whose top-k expert set the trainer's own "
                            "router did not choose (bf16, same weights), over every fed token",
        "kl": "k3 on the engine's sampled answer tokens: mean of (r - 1) - log r, r = p_trainer / p_engine (an "
              "unbiased, non-negative estimate of KL(engine || trainer), nats per token)",
        "abs_diff": "mean |log p_trainer - log p_engine| over the same answer tokens (nats)",
        "final_reward": "mean reward over the last games (supervisor.stats_window=256) at the run's last 3 status "
                        "points; Tic-Tac-Toe rewards in [-1, 1]",
        "collapse": f"final reward more than {COLLAPSE_DROP} below the run's best point, the run stopping on its "
                    "own, or no point at all"}


def bf16_exact_model(out: Path, seed: int) -> Path:
    """The tiny MoE of `MODEL` (init seed `seed`), its fp32 weights rounded to bf16 in place."""
    import torch

    from earl_stream.model import load_model
    from earl_stream.model.tiny_moe import init_moe_model

    model_dir = init_moe_model(out, seed=seed, **MODEL)  # type: ignore[arg-type]
    model, _ = load_model(model_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    model.save_pretrained(model_dir)
    return model_dir


def _samples(model_dir: Path, seed: int, requests: int) -> list[tuple[list[int], Any]]:
    """(prompt ids, GenerateResult) of `requests` requests through the built-in engine in bf16."""
    import numpy as np
    import torch

    from earl_stream.model import load_model
    from earl_stream.workers.engines.base import GenerateRequest
    from earl_stream.workers.engines.torch_engine import TorchEngine

    model, _ = load_model(model_dir, dtype=torch.bfloat16)
    engine = TorchEngine(model, seed=seed, max_batch_size=8)  # fewer rows than requests: rows join as others end
    rng = np.random.default_rng(seed)
    reqs = [GenerateRequest(prompt_ids=[int(t) for t in rng.integers(5, 500, int(rng.integers(8, 48)))],
                            max_new_tokens=int(rng.integers(16, 80)), seed=seed * 1000 + i) for i in range(requests)]
    return [(list(q.prompt_ids), r) for q, r in zip(reqs, engine.generate(reqs))]


def _micro_batches(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Whole rows in order, packed while the total stays within `budget` tokens (a longer row alone)."""
    out: list[list[int]] = [[]]
    total = 0
    for i, n in enumerate(lengths):
        if out[-1] and total + n > budget:
            out.append([])
            total = 0
        out[-1].append(i)
        total += n
    return out


def _score(model: Any, samples: list[tuple[list[int], Any]], mode: str, budget: int) -> dict[str, float]:
    """One arm: the trainer's forward of every sample under routing replay `mode`; the arm's metrics."""
    import numpy as np
    import torch

    from earl_stream.records import ROUTED_EXPERTS
    from earl_stream.workers.batches import packed_local_batch
    from earl_stream.workers.packed_attention import packed_segments
    from earl_stream.workers.routing_replay import RoutingReplay
    from earl_stream.workers.vocab_parallel import forward_logprobs

    replay = RoutingReplay.of(model, mode)
    assert replay is not None
    rows, routed = [], []
    for prompt, res in samples:
        p, g = len(prompt), len(res.token_ids)
        rows.append({"input_ids": np.asarray(prompt + res.token_ids, np.int32),
                     "loss_mask": np.r_[np.zeros(p), np.ones(g)].astype(np.uint8),
                     "behaviour_logprobs": np.r_[np.zeros(p), res.logprobs].astype(np.float32)})
        choices = torch.from_numpy(res.routed_experts.astype(np.int64))
        routed.append(torch.where(choices == 255, -1, choices))  # uint8 record: 255 = not recorded
    diffs, flips, decisions = [], 0, 0
    for mb in _micro_batches([len(r["input_ids"]) for r in rows], budget):
        lengths = [len(rows[i]["input_ids"]) for i in mb]
        batch = packed_local_batch([rows[i] for i in mb], lengths, (0, sum(lengths)), 1)
        rec = torch.cat([routed[i] for i in mb])  # [n, L, k], aligned with input_ids
        batch[ROUTED_EXPERTS] = rec[None]
        replay.hooks.record()
        with (torch.no_grad(), replay.around(packed_segments([model], batch.get("segments")), batch),
              torch.autocast("cpu", dtype=torch.bfloat16)):
            logp = forward_logprobs(model, batch)[1][0]
        own = torch.stack(replay.hooks.recorded[-replay.spec.layers:], dim=1)  # the routers' own choices [n, L, k]
        replay.hooks.recording, replay.hooks.recorded = False, []
        valid = (rec >= 0).all(-1)
        differs = (own.sort(-1).values != rec.sort(-1).values).any(-1)
        flips, decisions = flips + int(differs[valid].sum()), decisions + int(valid.sum())
        mask = batch["loss_mask"][0] > 0
        diffs.append((logp - batch["behaviour_logprobs"][0])[mask].double())
    replay.take_mismatch()  # the hooks' own counters: reset (this benchmark counts per decision above)
    d = torch.cat(diffs)
    k3 = (torch.exp(d) - 1 - d).mean()
    return {"routing_mismatch": flips / decisions, "kl_k3": float(k3), "mean_abs_logprob_diff": float(d.abs().mean()),
            "tokens": int(d.numel()), "decisions": decisions}


def equal_weights_repeat(tmp: Path, seed: int, requests: int = 32, micro_batch_tokens: int = 1024) -> dict[str, Any]:
    """One repeat (seed): both arms on the same engine samples, in the order the seed's parity says."""
    from earl_stream.model import load_model

    model_dir = bf16_exact_model(tmp / f"equal-{seed}", seed)
    samples = _samples(model_dir, seed, requests)
    trainer, _ = load_model(model_dir)  # fp32 master weights (bf16-exact), bf16 autocast as trainer.dtype=bf16
    trainer.train()
    order = list(ARMS) if seed % 2 == 0 else list(ARMS)[::-1]
    out = {arm: _score(trainer, samples, ARMS[arm], micro_batch_tokens) for arm in order}
    return {"seed": seed, "order": order, **{arm: out[arm] for arm in ARMS}}


def summarise_equal(repeats: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per metric and arm: the mean of the repeats with its 95% interval; the KL ratio replay / no_replay with
    its interval and whether the goal holds (the interval's upper end <= `GOAL_RATIO`)."""
    out: dict[str, Any] = {}
    for metric in EQUAL_METRICS:
        out[metric] = {arm: mean_ci95([r[arm][metric] for r in repeats]) for arm in ARMS}
    ratio = ratio_ci95([r["replay"]["kl_k3"] for r in repeats], [r["no_replay"]["kl_k3"] for r in repeats])
    out["kl_ratio_replay_over_no_replay"] = ratio
    out["goal_met"] = ratio["high"] <= GOAL_RATIO
    return out


def learning_summary(runs: dict[str, list[dict[str, Any]]], tail: int = 3) -> dict[str, Any]:
    """Per arm, over its runs (each {"seed", "curve": status points, "exit_code"}): the final reward (mean of
    the last `tail` points' rewards) as mean and 95% interval, its repeats, and the collapses: a run whose final
    reward ended more than `COLLAPSE_DROP` below its best point's, or that stopped on its own or left no point."""
    out: dict[str, Any] = {}
    for arm, arm_runs in runs.items():
        finals, collapses = [], 0
        for run in arm_runs:
            rewards = [p["reward"] for p in run["curve"] if p.get("reward") is not None]
            final = statistics.fmean(rewards[-tail:]) if rewards else None
            collapsed = final is None or run.get("exit_code") is not None or max(rewards) - final > COLLAPSE_DROP
            collapses += int(collapsed)
            if final is not None:
                finals.append(final)
        out[arm] = {"final_reward": mean_ci95(finals) if len(finals) >= 2 else None, "final_reward_repeats": finals,
                    "collapses": collapses, "runs": len(arm_runs)}
    return out
