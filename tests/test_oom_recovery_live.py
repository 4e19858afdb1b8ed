"""Never die of OOM (the trainer's part): a one-rank `up` whose trainer rank runs under an
address-space cap (`RLIMIT_AS`, set by the rank once its model and optimizer are built:
$EARL_TRAINER_AS_HEADROOM_BYTES) while the selector is told a budget far larger, so that its first plan
(a whole step of long prompts in one micro-batch) fails to allocate for real. The step is abandoned with
nothing applied, the supervisor corrects that plan's memory predictions and re-plans, and the same rows
train under the more frugal plan: the run completes every step, with at least one recovery, nothing lost,
nothing trained twice (metrics.jsonl and the trainer's log show each step once)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from earl_stream.workers.oom_step import AS_HEADROOM_ENV

pytestmark = pytest.mark.slow
STEPS = 4
# ~1.2k-token prompts, 8 episodes per step: ~10k tokens per step, ~0.7 GiB of activations in one micro-batch
# for the tiny model; the rank gets 300 MiB above what it maps with its model built
LONG_PROMPT_ENV = """
from earl_stream.env import StepResult


class LongPrompt:
    max_turn_tokens = 8
    system_prompt = "Reply."

    async def reset(self, seed: int) -> str:
        return " ".join(f"w{(seed + i) % 97}" for i in range(400))

    async def step(self, action_text: str) -> StepResult:
        return StepResult("", (len(action_text) % 5) / 4, True)
"""
HEADROOM = {1: 300 << 20, 2: 450 << 20}  # per rank; two ranks split the step's rows but each holds a replica


def _trained(log: str) -> list[int]:
    return [int(s) for s in re.findall(r"step (\d+): loss", log)]


@pytest.mark.live
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc to size the cap")
@pytest.mark.parametrize("ranks", [1, 2])
def test_a_step_that_fails_to_allocate_is_replanned_and_trained_once(tmp_path: Path, tiny_model_dir: Path,
                                                                     ranks: int) -> None:
    """ranks=2: each rank runs under its own cap; the pool leaves the failed step together, re-forms its
    process group and trains the same rows under the new plan (one `TrainerOom` per failure)."""
    run = tmp_path / "run"
    env_file = tmp_path / "long_prompt.py"
    env_file.write_text(LONG_PROMPT_ENV)
    proc = subprocess.run(
        [sys.executable, "-m", "earl_stream", "up", "--summary", str(tmp_path / "summary.json"), f"steps={STEPS}",
         f"model.path={tiny_model_dir}", f"run_dir={run}", f"envs.0.spec={env_file}:LongPrompt",
         "trainer.groups_per_step=2", "trainer.group_size=4", "rollout.groups_in_flight=2", "rollout.workers=1",
         "supervisor.heartbeat_s=0.2", "trainer.malloc_mmap_threshold=65536", "trainer.max_staleness=4",
         f"selector.trainer_memory_bytes={8 << 30}", "selector.reserve_bytes=0", "selector.initial_seq_len=2048",
         f"trainer.nproc={ranks}"],
        env={**os.environ, AS_HEADROOM_ENV: str(HEADROOM[ranks])}, capture_output=True, text=True, timeout=600)
    log = (run / "logs" / "trainer.log").read_text() if (run / "logs" / "trainer.log").exists() else ""
    assert proc.returncode == 0, (proc.stdout[-3000:], log[-4000:])
    summary = json.loads((tmp_path / "summary.json").read_text())
    recoveries = summary["oom_recoveries"]
    assert recoveries and all(r["plan_after"] for r in recoveries), (recoveries, log[-4000:])
    assert summary["samples_lost"] == 0 and summary["duplicates_detected"] == 0 and summary["steps"] == STEPS
    # each recovery's plan is more frugal than the one that failed: a smaller micro-batch, or recomputation
    for r in recoveries:
        assert (r["micro_batch_tokens_after"] < r["micro_batch_tokens_before"]
                or r["plan_after"].endswith("+rc") and not r["plan_before"].endswith("+rc")), r
    assert len(re.findall(r"recovered from the allocation failure", log)) >= 1, log[-4000:]
    # each step trained once (by every rank of the pool), in order
    assert _trained(log) == [s for s in range(1, STEPS + 1) for _ in range(ranks)], log[-4000:]
    if ranks > 1:  # every rank left each failed step and the supervisor got one report per failure
        left = re.findall(r"step (\d+): every rank left the step ([0-9.]+)s after it began", log)
        assert len(left) == ranks * len(recoveries), (left, recoveries)
        print("seconds from the step's start until each rank left it:", [float(s) for _, s in left])
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, STEPS + 1))
    lost = [float(s) for s in re.findall(r"trained under plan \S+, ([0-9.]+)s lost", log)]
    print("recoveries:", json.dumps(recoveries, indent=1), "seconds lost per recovery:", lost)
