"""`earl-stream up` with `logging.backends=[jsonl,tensorboard]`: each trained step's record reaches TensorBoard
(read back with its EventAccumulator) with the values of metrics.jsonl, and the summary and learning curve
follow at the end; RUN_DIR/tracking.json holds the last step forwarded."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from earl_stream.supervisor.metrics_log import read_records
from earl_stream.tracking import flatten
from earl_stream.tracking.feed import STATE_FILE

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None,
                                 reason="tensorboard is not installed (pip install earl-stream[tensorboard])")]


def test_up_sends_each_step_to_tensorboard(tmp_path: Path, tiny_model_dir: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "earl_stream", "up", "--steps", "2", f"model.path={tiny_model_dir}", f"run_dir={run_dir}",
           "trainer.groups_per_step=2", "trainer.group_size=4", "rollout.groups_in_flight=2", "rollout.workers=1",
           "supervisor.heartbeat_s=0.2", "logging.backends=[jsonl,tensorboard]", "logging.tags=[smoke]"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = read_records(run_dir)
    assert [r["step"] for r in records] == [1, 2]
    state = json.loads((run_dir / STATE_FILE).read_text())
    assert state["last_step"] == 2
    (logdir,) = (run_dir / "tensorboard").iterdir()
    assert logdir.name == state["ids"]["id"]
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0, "images": 0})
    acc.Reload()
    for record in records:
        for key, value in flatten(record).items():
            (event,) = [e for e in acc.Scalars(key) if e.step == record["step"]]
            assert event.value == pytest.approx(value, rel=1e-6), key
    assert "loss" in acc.Tags()["scalars"] and "staleness/0" in acc.Tags()["scalars"]
    assert acc.Tags()["images"] == ["learning_curve"]
    texts = {t.removesuffix("/text_summary") for t in acc.Tags()["tensors"]}
    assert {"config", "tags", "summary"} <= texts
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2
