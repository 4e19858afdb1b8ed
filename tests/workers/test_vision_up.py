"""End to end with a vision-language policy: `earl-stream up` on a tiny Idefics3 model (and a tiny Qwen2.5-VL, whose
3-D positions the built-in engine and the trainer lay out) and the image Tic-Tac-Toe runs rollout workers whose
episodes show board pictures, and a trainer pool of two ranks that pulls those pictures with their samples and
recomputes the vision tower (`workers.vision_inputs`)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


# Qwen2.5-VL's run is in the live tier (make test-live): ~47 s on 2 cores, kept out of make test for its time
@pytest.mark.parametrize("family", ["idefics3", pytest.param("qwen2_5_vl", marks=pytest.mark.live)])
def test_up_trains_a_vision_language_policy_on_image_tictactoe(tmp_path: Path, family: str) -> None:
    from earl_stream.model.tiny_vlm import init_vlm_model

    model_dir = init_vlm_model(tmp_path / "vlm", family=family, image_size=64 if family == "idefics3" else 56)
    summary = tmp_path / "s.json"
    cmd = [sys.executable, "-m", "earl_stream", "up", "--steps", "3", "--summary", str(summary),
           f"model.path={model_dir}", f"run_dir={tmp_path / 'run'}", "envs.0.spec=tictactoe_image",
           "trainer.nproc=2", "trainer.groups_per_step=2", "trainer.group_size=4", "model.freeze_vision=true",
           "supervisor.heartbeat_s=0.2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads(summary.read_text())
    assert got["samples_trained"] >= 3 * 8 and got["samples_lost"] == 0
    log = (tmp_path / "run" / "logs" / "trainer.log").read_text()
    pulled = [tuple(map(int, m)) for m in re.findall(r"(\d+) images pulled \((\d+) bytes of PNG, of the step's (\d+)\)",
                                                       log)]
    # every step, each rank pulls the pictures of its own samples (a board per turn the policy answered): a part of
    # the step's pictures, not all of them
    assert len(pulled) >= 3 and all(n >= 2 and 0 < mine < step for n, mine, step in pulled), log[-2000:]
    # the run's checkpoint, exported, is a vision-language policy again: its processor was saved beside the weights
    from earl_stream.model import load_policy

    out = tmp_path / "exported"
    export = subprocess.run([sys.executable, "-m", "earl_stream", "model", "export", str(tmp_path / "run"), str(out)],
                            capture_output=True, text=True, timeout=120)
    assert export.returncode == 0, export.stderr[-2000:]
    policy = load_policy(out)
    assert policy.processor is not None and type(policy.model).__name__ == type(load_policy(model_dir).model).__name__


def test_up_on_the_embedded_vision_language_model(tmp_path: Path) -> None:
    """`model.path=default:tictactoe_image`: the shipped warm-started VLM is copied from the package into the cache
    and `up` trains it on the picture game; its games are mostly legal moves (the warm start's), not the random
    model's illegal replies."""
    import os

    summary = tmp_path / "s.json"
    cmd = [sys.executable, "-m", "earl_stream", "up", "--steps", "2", "--summary", str(summary),
           "model.path=default:tictactoe_image", f"run_dir={tmp_path / 'run'}", "envs.0.spec=tictactoe_image",
           "trainer.groups_per_step=2", "trainer.group_size=8", "supervisor.heartbeat_s=0.2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "EARL_STREAM_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "cache" / "models" / "tictactoe_image-vlm-warm-v1" / "config.json").is_file()
    got = json.loads(summary.read_text())
    assert got["samples_trained"] >= 2 * 16 and got["samples_lost"] == 0
    config = (tmp_path / "run" / "config.yaml").read_text()
    assert "tictactoe_image-vlm-warm-v1" in config  # every worker loads the unpacked directory
    # the warm start plays legal moves and wins about half its games; a random model's replies are illegal (0 wins)
    assert got["win_rate_last"] is not None and got["win_rate_last"] >= 0.2, got
