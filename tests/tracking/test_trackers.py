"""The tracker contract (earl_stream/tracking/): every backend gets a few steps of a real-shaped record, the
config and the end-of-run files, and each is read back with its own package's reader: TensorBoard's
EventAccumulator, the W&B offline run's transaction log (W&B's own protobuf records), MLflow's client on a
local file store, trackio's SQLite storage. A backend whose package is missing here is skipped, naming the
extra; a missing package makes `up` fail with the extra to install before it starts anything."""

from __future__ import annotations

import importlib.util
import json
import struct
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from earl_stream.config import config_to_dict, load_config
from earl_stream.errors import ConfigError
from earl_stream.supervisor.metrics_log import MetricsLog
from earl_stream.tracking import BACKENDS, TrackerRun, flatten, make_trackers

THIRD_PARTY = [name for name, backend in BACKENDS.items() if backend is not None]
STEPS = (1, 2, 3)


def _records(tmp_path: Path) -> list[dict[str, Any]]:
    """Step records as the supervisor makes them (MetricsLog.record), from a status and trainer metrics of the
    shape a run has."""
    mlog = MetricsLog(tmp_path / "records")
    out = []
    for step in STEPS:
        status = {"policy_version": step, "mean_reward_last": 0.1 * step, "win_rate_last": 0.5, "draw_rate_last": 0.25,
                  "envs": {"tictactoe": {"outcomes": {"win": step, "loss": 1}}}, "tokens_produced": 1000 * step,
                  "context_length": {"p50": 40, "p90": 60, "p99": 70, "max": 80}, "workers": [],
                  "plans": {"trainer": {"name": "dp1", "version": 1}},
                  "eval": {"tictactoe": {"version": step, "value": 0.3, "history": [{"version": step, "value": 0.3}]}}}
        trainer = {"loss": 1.0 / step, "kl": 0.01, "entropy": 2.0, "grad_norm": 0.5, "lr": 1e-4, "tokens": 512,
                   "samples": 8, "step_seconds": 0.5, "mean_reward": 0.2 * step}
        rec = mlog.record(status, trainer, replanned=False, staleness={"0": 6, "1": 2})
        out.append({"step": step, **rec})
    return out


def _require(name: str) -> None:
    backend = BACKENDS[name]
    assert backend is not None
    if importlib.util.find_spec(backend.package) is None:
        pytest.skip(f"{backend.package} is not installed (pip install earl-stream[{backend.extra}])")


# --- each package's own reader: (step -> {metric: value}, config, tags, names of the files attached) ---

def _read_tensorboard(run: TrackerRun) -> tuple[dict[int, dict[str, float]], str, list[str], list[str]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run.dir / "tensorboard" / run.ids["id"]), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    steps: dict[int, dict[str, float]] = {}
    for tag in acc.Tags()["scalars"]:
        for event in acc.Scalars(tag):
            steps.setdefault(event.step, {})[tag] = event.value
    texts = {tag.removesuffix("/text_summary"): acc.Tensors(tag)[0].tensor_proto.string_val[0].decode()
             for tag in acc.Tags()["tensors"]}
    files = sorted([t for t in texts if t not in ("config", "tags")] + acc.Tags()["images"])
    return steps, texts["config"], texts["tags"].split(", "), files


def _wandb_records(path: Path) -> list[Any]:
    """The protobuf records of a W&B transaction log (run-ID.wandb): a 7-byte header, then LevelDB-log blocks
    of 32 KiB, each chunk with a 7-byte header (CRC, length, type: 1 full, 2 first, 3 middle, 4 last). Read while
    W&B's service may still be writing: a record whose chunks are not all in the file yet is left out."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    records, pos, pending = [], 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if (length == 0 and kind == 0) or pos + 7 + length > len(data):
            break  # the zero padding of a block, or a chunk the service is still writing
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def _read_wandb(run: TrackerRun) -> tuple[dict[int, dict[str, float]], str, list[str], list[str]]:
    (log_file,) = (run.dir / "wandb").glob(f"offline-run-*-{run.ids['id']}/run-{run.ids['id']}.wandb")
    # W&B's service may still be writing the log when finish() returns: read it once its exit record is in
    deadline = time.monotonic() + 30
    while not any(r.WhichOneof("record_type") == "exit" for r in _wandb_records(log_file)):
        assert time.monotonic() < deadline, f"{log_file} has no exit record"
        time.sleep(0.2)
    steps: dict[int, dict[str, float]] = {}
    config, tags, files = "", [], []
    for record in _wandb_records(log_file):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            step = int(items.pop("_step"))
            steps.setdefault(step, {}).update({k: v for k, v in items.items() if not k.startswith("_")})
        elif kind == "run":
            tags = list(record.run.tags)
            config += json.dumps({i.key: json.loads(i.value_json) for i in record.run.config.update})
        elif kind == "artifact":
            files = sorted(entry.path for entry in record.artifact.manifest.contents)
    return steps, config, tags, files


def _read_mlflow(run: TrackerRun) -> tuple[dict[int, dict[str, float]], str, list[str], list[str]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(run.dir / "mlruns").resolve().as_uri())
    run_id = run.ids["mlflow_run_id"]
    got = client.get_run(run_id)
    assert got.info.status == "FINISHED" and got.info.run_name == run.name
    steps: dict[int, dict[str, float]] = {}
    for key in got.data.metrics:
        for m in client.get_metric_history(run_id, key):
            steps.setdefault(m.step, {})[key] = m.value
    files = sorted(f.path for f in client.list_artifacts(run_id))
    assert "config.json" in files  # the nested config, besides its dotted keys as parameters
    files.remove("config.json")
    return steps, json.dumps(got.data.params), sorted(got.data.tags.keys() & set(run.tags)), files


def _read_trackio(run: TrackerRun) -> tuple[dict[int, dict[str, float]], str, list[str], list[str]]:
    from trackio.sqlite_storage import SQLiteStorage

    steps: dict[int, dict[str, float]] = {}
    for row in SQLiteStorage.get_logs(run.project, run.name):
        steps.setdefault(int(row["step"]), {}).update({k: v for k, v in row.items() if isinstance(v, (int, float))
                                                        and k not in ("step", "timestamp") and not k.startswith("_")})
    config = SQLiteStorage.get_run_config(run.project, run.name) or {}
    (record,) = [r for r in SQLiteStorage.get_run_records(run.project) if r["name"] == run.name]
    links = SQLiteStorage.get_run_artifacts(run.project, run.name, record["id"])["output"]
    files = sorted(a["name"].removeprefix(f"{run.name}-") for a in links)
    return steps, json.dumps(config), list(config.get("tags") or []), files


READERS: dict[str, Callable[[TrackerRun], tuple[dict[int, dict[str, float]], str, list[str], list[str]]]] = {
    "tensorboard": _read_tensorboard, "wandb": _read_wandb, "mlflow": _read_mlflow, "trackio": _read_trackio}


@pytest.mark.parametrize("name", THIRD_PARTY)
def test_tracker_round_trip(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps, config, tags and the summary/curve files logged through the Tracker protocol come back from the
    backend's own files, every metric at its step with its value."""
    _require(name)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))  # read when trackio is first imported
    run = TrackerRun(dir=tmp_path / "run", project=f"earl-test-{uuid.uuid4().hex[:8]}", name="contract",
                     tags=("tictactoe", "grpo"), ids={"id": uuid.uuid4().hex[:8]})
    (tracker,) = make_trackers([name], run)
    cfg = load_config(None, ["trainer.lr=0.00025"])
    tracker.start(config_to_dict(cfg))
    records = _records(tmp_path)
    for record in records:
        tracker.log(record["step"], flatten(record))
    summary = tmp_path / "out" / "summary.json"
    summary.parent.mkdir()
    summary.write_text(json.dumps({"steps": 3, "last_loss": 0.33}))
    curve = tmp_path / "out" / "learning_curve.png"
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.figure(figsize=(2, 2))
    plt.plot([1, 2, 3])
    plt.savefig(curve)
    plt.close()
    tracker.artifact(summary)
    tracker.artifact(curve)
    tracker.finish()

    steps, config, tags, files = READERS[name](run)
    assert sorted(steps) == list(STEPS)
    for record in records:
        want = flatten(record)
        assert {"loss", "staleness/0", "env_outcomes/tictactoe/win", "eval/tictactoe/value", "context_p90"} <= set(want)
        got = steps[record["step"]]
        assert set(want) <= set(got), sorted(set(want) - set(got))
        assert all(got[k] == pytest.approx(v, rel=1e-6) for k, v in want.items()), (got, want)
    assert "0.00025" in config
    assert sorted(tags) == ["grpo", "tictactoe"]
    assert files == ["learning_curve", "summary"] or files == ["learning_curve.png", "summary.json"], files


def test_flatten_keeps_numbers_as_slash_keys() -> None:
    rec = {"step": 4, "time": 1.7e9, "loss": 0.5, "plan": "dp1", "reward": None, "replanned": True, "kl": float("nan"),
           "staleness": {"0": 6, "1": 2}, "eval": {"tictactoe": [{"version": 1, "value": 0.1}, {"version": 3, "value": 0.4}]}}
    assert flatten(rec) == {"loss": 0.5, "replanned": 1.0, "staleness/0": 6.0, "staleness/1": 2.0,
                            "eval/tictactoe/version": 3.0, "eval/tictactoe/value": 0.4}


def test_unknown_backend_is_a_config_error_listing_the_names() -> None:
    with pytest.raises(ConfigError, match="'tensorbord' is not a tracker; choose from jsonl, tensorboard, wandb"):
        load_config(None, ["logging.backends=[jsonl,tensorbord]"])
    assert load_config(None, []).logging.backends == ["jsonl"]


def test_missing_package_fails_up_before_any_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tracker whose package is not installed: `up` raises one ConfigError naming the extra, before it
    prepares the run directory or starts a process (sys.modules[name] = None makes the import fail)."""
    from earl_stream.cli import up as up_mod

    monkeypatch.setitem(sys.modules, "wandb", None)
    monkeypatch.setitem(sys.modules, "mlflow", None)
    monkeypatch.setattr(up_mod, "make_launcher", lambda *a: pytest.fail("a process was started"))
    cfg = load_config(None, [f"run_dir={tmp_path / 'run'}", "logging.backends=[jsonl,wandb,mlflow]"])
    with pytest.raises(ConfigError) as err:
        up_mod.up(cfg)
    text = str(err.value)
    assert "pip install earl-stream[wandb]" in text and "pip install earl-stream[mlflow]" in text, text
    assert "pip install earl-stream[trackers]" in text
    assert not (tmp_path / "run" / "config.yaml").exists()
