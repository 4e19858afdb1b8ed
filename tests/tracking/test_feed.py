"""TrackerFeed (earl_stream/tracking/feed.py): what `up` forwards from RUN_DIR/metrics.jsonl to the trackers:
each step once, a half-written line only when complete, `up --resume` from the next step with the same
tracker run ids, a fresh run nothing of an earlier run's file, and a failing tracker dropped, not the run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from earl_stream.config import load_config
from earl_stream.errors import ConfigError
from earl_stream.supervisor.metrics_log import MetricsLog
from earl_stream.tracking.base import TrackerRun
from earl_stream.tracking.feed import STATE_FILE, TrackerFeed


class Recording:
    """A tracker that keeps what it is given (and fails in `fail_on`, like a backend whose server is gone)."""

    def __init__(self, fail_on: str = "") -> None:
        self.calls: list[tuple[str, Any]] = []
        self.fail_on = fail_on

    def start(self, config: dict[str, Any]) -> None:
        if self.fail_on == "start":
            raise RuntimeError("not logged in")
        self.calls.append(("start", config["run_dir"]))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if self.fail_on == "log":
            raise RuntimeError("backend down")
        self.calls.append(("log", step))

    def artifact(self, path: Path) -> None:
        self.calls.append(("artifact", path.name))

    def finish(self) -> None:
        self.calls.append(("finish", None))

    def steps(self) -> list[int]:
        return [arg for what, arg in self.calls if what == "log"]


def _feed(run_dir: Path, tracker: Recording, *, resume: bool = False, fresh: bool = True) -> TrackerFeed:
    state = json.loads((run_dir / STATE_FILE).read_text()) if resume else {"ids": {"id": "abcd1234"}, "last_step": -1}
    run = TrackerRun(dir=run_dir, project="p", name="n", tags=(), ids=state["ids"], resume=resume)
    feed = TrackerFeed([tracker], run, state["last_step"])
    if fresh and not resume:
        feed._skip_existing()
    feed._start({"run_dir": str(run_dir)})
    feed._save_state()
    return feed


def test_each_step_once_and_half_lines_wait(tmp_path: Path) -> None:
    mlog = MetricsLog(tmp_path, run_id="r1")
    tracker = Recording()
    feed = _feed(tmp_path, tracker)
    mlog.append(1, {"loss": 1.0})
    mlog.append(2, {"loss": 0.5})
    assert feed.poll() == 2 and feed.poll() == 0
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "loss"')  # the supervisor mid-write
    assert feed.poll() == 0
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write(': 0.2}\n')
    assert feed.poll() == 1
    summary = tmp_path / "summary.json"
    summary.write_text("{}")
    feed.finish([summary, None, tmp_path / "missing.png"])
    assert tracker.steps() == [1, 2, 3]
    assert tracker.calls[-2:] == [("artifact", "summary.json"), ("finish", None)]
    feed.close()  # after finish: nothing more
    assert tracker.calls[-1] == ("finish", None) and len([c for c in tracker.calls if c[0] == "finish"]) == 1


def test_resume_continues_after_the_last_step_forwarded(tmp_path: Path) -> None:
    mlog = MetricsLog(tmp_path, run_id="r1")
    first = _feed(tmp_path, Recording())
    for step in (1, 2):
        mlog.append(step, {"loss": 1.0 / step})
    first.poll()
    first.close()  # up was stopped; the supervisor wrote one more step that this up never saw
    mlog.append(3, {"loss": 0.3})
    state = json.loads((tmp_path / STATE_FILE).read_text())
    assert state == {"ids": {"id": "abcd1234"}, "last_step": 2}
    resumed = Recording()
    feed = _feed(tmp_path, resumed, resume=True)
    assert feed.run.ids["id"] == "abcd1234"  # the same tracker run is continued
    MetricsLog(tmp_path, run_id="r1").append(4, {"loss": 0.2})
    feed.poll()
    assert resumed.steps() == [3, 4]


def test_fresh_run_skips_an_earlier_runs_file(tmp_path: Path) -> None:
    old = MetricsLog(tmp_path, run_id="old")
    for step in (1, 2, 3):
        old.append(step, {"loss": 1.0})
    tracker = Recording()
    feed = _feed(tmp_path, tracker)
    assert feed.poll() == 0
    new = MetricsLog(tmp_path, run_id="new")  # moves the old file aside; the new one starts at step 1
    new.append(1, {"loss": 0.9})
    feed.poll()
    assert tracker.steps() == [1]


def test_a_failing_tracker_is_dropped_and_the_others_go_on(tmp_path: Path) -> None:
    mlog = MetricsLog(tmp_path, run_id="r1")
    good, bad = Recording(), Recording(fail_on="log")
    run = TrackerRun(dir=tmp_path, project="p", name="n", tags=(), ids={"id": "x"})
    feed = TrackerFeed([bad, good], run)
    mlog.append(1, {"loss": 1.0})
    mlog.append(2, {"loss": 0.5})
    feed.poll()
    assert good.steps() == [1, 2] and feed.trackers == [good]
    assert bad.calls[-1] == ("finish", None)


def test_open_with_jsonl_only_has_no_tracker(tmp_path: Path) -> None:
    cfg = load_config(None, [f"run_dir={tmp_path}"])
    feed = TrackerFeed.open(cfg)
    assert feed.trackers == [] and feed.poll() == 0
    assert json.loads((tmp_path / STATE_FILE).read_text())["last_step"] == -1


def test_a_tracker_that_cannot_open_its_run_stops_up_first(tmp_path: Path) -> None:
    """wandb online without a login, say: a ConfigError naming it, the trackers already opened closed again."""
    opened, refused = Recording(), Recording(fail_on="start")
    run = TrackerRun(dir=tmp_path, project="p", name="n", tags=(), ids={"id": "x"})
    feed = TrackerFeed([opened, refused], run)
    with pytest.raises(ConfigError, match="Recording could not open its run: RuntimeError: not logged in"):
        feed._start({"run_dir": str(tmp_path)})
    assert opened.calls == [("start", str(tmp_path)), ("finish", None)] and refused.calls == []
