"""Golden-trajectory invariant: at `trainer.max_staleness=0` and a fixed seed, the asynchronous
pipeline (supervisor, rollout worker and trainer as real processes) trains on exactly the episodes
the in-process synchronous loop (`earl_stream.workers.sync_loop`) plays, and produces the same losses, for
every advantage estimator (each with one more loss option, so the options reach the trainer too).

Rollouts are deterministic because every episode samples with its own seed
(`episode_sample_seed(prompt seed, index)`) and the engine is batch-invariant at staleness 0
(`rollout.batch_invariant=auto`): a row's logits do not depend on which rows share its batch or when
they joined. The test makes timing vary on purpose: one busy process per core competes with the run,
and every control-plane call and engine request of the run's processes waits a random 0-20 ms first
(`EARL_STREAM_JITTER_MS`), so any remaining timing dependence fails here every time rather than on a
busy CI machine only. Each estimator runs under one weight-swap mode, the five runs covering all three.
The environment is a small multi-turn one whose reward depends on the sampled text, so that a randomly
initialised model gets non-zero advantages (Tic-Tac-Toe would give it -1 for every illegal first move).
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from cluster import Cluster, wait_for

from earl_stream import jitter
from earl_stream.config import load_config
from earl_stream.workers.sync_loop import run_sync_loop

STEPS = 3
SEED = 3
ENV_SOURCE = '''
from earl_stream.env import StepResult


class ByteParity:
    """Up to three turns; each reply earns the parity of its bytes and may end the game early, so
    random text gets varied rewards and lengths (GRPO's loss at ratio 1 is zero for equal lengths)."""

    system_prompt = "Say something."
    max_turn_tokens = 3

    def reset(self, seed):
        self.turn, self.seed = 0, seed
        return f"Round 1 of 3 (game {seed % 97})."

    def step(self, action_text):
        self.turn += 1
        reward = float(sum(action_text.encode()) % 2)
        if self.turn >= 3 or sum(action_text.encode()) % 3 == 0:
            return StepResult("Done.", reward, True, {"outcome": "win" if reward else "loss"})
        return StepResult(f"Round {self.turn + 1} of 3.", reward, False)
'''
LINE = re.compile(r"step (\d+): loss (-?[\d.]+) grad-norm ([\d.]+) reward (-?[\d.]+) \((\d+) samples, (\d+) tokens\)"
                  r".*clipped ([\d.]+) \|ratio-1\| ([\d.]+)")
STALE = re.compile(r"masked [\d.]+ \(stale ([\d.]+)\)")
# Several updates per step at lr 1e-2 move log-probs by ~1.4 nats, so the float rounding of another
# micro-batching (the selector's plan: 256 tokens; the sync loop: 8,192) flips clip decisions and then
# sampled tokens: those runs keep the configured micro-batching (no selector) on both sides.
SAME_MICRO_BATCHES = "selector.enabled=false"
# estimator -> (its steps, extra options, weight-swap mode): grpo is the reference run; the others run 2 steps to
# keep the cost down; the modes rotate so that every one of them runs
CASES = {
    "grpo": (3, [], "inplace"),
    "dr_grpo": (2, ["algo.loss_agg=seq-mean-token-sum"], "interrupt"),
    "rloo": (2, ["algo.ppo_epochs=2", "algo.clip_eps_high=0.28", SAME_MICRO_BATCHES], "drain"),
    "reinforce_pp": (2, ["algo.is_correction=mask", "algo.kl_coef=0.05", "algo.kl_estimator=k2"], "interrupt"),
    "reinforce_pp_baseline": (2, ["algo.mini_batches=2", "algo.dual_clip_c=3", SAME_MICRO_BATCHES], "inplace"),
}
JITTER_MS = "20"


@contextlib.contextmanager
def busy_cores() -> Iterator[None]:
    """One process spinning on each core while the pipeline runs: its processes compete for every core."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
    try:
        yield
    finally:
        for proc in spinners:
            proc.kill()
            proc.wait()


def _overrides(tmp: Path, steps: int = STEPS) -> list[str]:
    env_file = tmp / "byte_parity.py"
    env_file.write_text(ENV_SOURCE)
    return [f"envs.0.spec={env_file}:ByteParity", f"seed={SEED}", "trainer.max_staleness=0", f"steps={steps}",
            "trainer.groups_per_step=2", "trainer.group_size=4", "trainer.lr=1e-2", "rollout.groups_in_flight=2"]


# every weight-swap mode runs in `make test` (grpo: inplace, dr_grpo: interrupt, rloo: drain); the two further
# estimators in the live tier, for make test's time
IN_LIVE_TIER = {"reinforce_pp", "reinforce_pp_baseline"}


@pytest.mark.slow
@pytest.mark.parametrize("advantage", [pytest.param(a, marks=pytest.mark.live) if a in IN_LIVE_TIER else a
                                       for a in sorted(CASES)])
def test_async_at_staleness_zero_matches_the_sync_loop(tmp_path: Path, tiny_model_dir: Path, advantage: str) -> None:
    torch.set_num_threads(1)
    steps, options, swap = CASES[advantage]
    overrides = [*_overrides(tmp_path, steps), f"algo.advantage={advantage}", f"rollout.weight_swap={swap}", *options]
    cluster = Cluster(tmp_path, tiny_model_dir, *overrides)
    cluster.env[jitter.ENV] = JITTER_MS
    try:
        with busy_cores():  # the synchronous reference below runs in this process, on a quiet machine
            cluster.start_supervisor()
            cluster.worker("rollout", "rollout")
            trainer = cluster.worker("trainer", "trainer")
            wait_for(lambda: trainer.poll() is not None, 300, "the trainer to finish its steps")
        assert trainer.returncode == 0, (tmp_path / "trainer.log").read_text()[-2000:]
    finally:
        cluster.stop()
    trainer_log = (tmp_path / "trainer.log").read_text()
    logged = [m.groups() for m in LINE.finditer(trainer_log)]
    assert [int(g[0]) for g in logged] == list(range(1, steps + 1))
    # at staleness 0 no token may come from an older version (a stale heartbeat once rolled the rollout back)
    assert [float(x) for x in STALE.findall(trainer_log)] == [0.0] * steps, trainer_log[-2000:]

    cfg = load_config(None, [f"model.path={tiny_model_dir}", f"run_dir={tmp_path / 'sync'}", *overrides])
    sync = run_sync_loop(cfg)
    assert len(sync) == steps
    losses = [s.result.loss for s in sync]
    assert any(abs(x) > 1e-3 for x in losses), f"a degenerate run (all advantages zero?): {losses}"
    for s, (_, loss, grad_norm, reward, samples, tokens, clipped, ratio_dev) in zip(sync, logged):
        r = s.result
        # token counts equal: both played exactly the same episodes, token for token
        assert (r.samples, r.tokens) == (int(samples), int(tokens))
        assert r.mean_reward == pytest.approx(float(reward), abs=1e-3)
        # the trainer logs 4 decimals of the loss and 3 of the gradient norm
        assert r.loss == pytest.approx(float(loss), abs=2e-4), (losses, [g[1] for g in logged])
        assert r.grad_norm == pytest.approx(float(grad_norm), abs=2e-3)
        # after two updates at lr 1e-2 ratios reach ~2-3: float rounding moves their mean in the 5th digit
        # and may flip the clip of a token that sits on its bound (1/568 of the tokens)
        assert r.clip_frac == pytest.approx(float(clipped), abs=4e-3)
        assert r.ratio_dev == pytest.approx(float(ratio_dev), rel=1e-3, abs=1e-4)
        if r.updates > 1:  # the later updates of a step move away from its old log-probs: the clip is real
            assert r.ratio_dev > 1e-4 and r.clip_frac > 0, r
