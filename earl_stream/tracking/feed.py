"""`TrackerFeed`: the configured trackers of a run, fed from RUN_DIR/metrics.jsonl by `earl-stream up`.

Why `up` and not the supervisor: the supervisor is the control plane and never waits on anything but its
peers; a tracker's SDK does network calls and starts processes of its own (W&B's service). `up` already
watches the run every half second, owns its end (summary.json, learning_curve.png: the artifacts) and sees
every record the supervisor writes, so one owner opens, feeds and closes each tracker run. A supervisor on
another host without a shared RUN_DIR keeps metrics.jsonl there: its trackers then get the config and the
end-of-run files only (up warns of it as it does for the learning curve).

Each record is logged once: the feed forwards only complete lines past the last step it forwarded, and that
step is kept, with the trackers' run identities, in RUN_DIR/tracking.json, so `up --resume` continues the
same tracker runs from the next step. A fresh run starts after what the file held when it began (the old
run's file is moved aside by the supervisor: a new file, read from its start). A tracker that fails is
logged and dropped; the run goes on (one that cannot open its run stops `up` before it starts a process).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from earl_stream.config import RunConfig, config_to_dict
from earl_stream.errors import ConfigError
from earl_stream.supervisor.metrics_log import FILE_NAME as METRICS_FILE
from earl_stream.tracking.base import Tracker, TrackerRun, flatten
from earl_stream.tracking.registry import make_trackers

log = logging.getLogger(__name__)
STATE_FILE = "tracking.json"


class TrackerFeed:
    """Started trackers plus where the feed stands in metrics.jsonl (byte offset, file identity, last step)."""

    def __init__(self, trackers: Sequence[Tracker], run: TrackerRun, last_step: int = -1) -> None:
        self.trackers = list(trackers)
        self.run = run
        self.metrics = run.dir / METRICS_FILE
        self.state_path = run.dir / STATE_FILE
        self.last_step = last_step
        self._inode: int | None = None
        self._offset = 0

    @classmethod
    def open(cls, cfg: RunConfig, *, resume: bool = False) -> TrackerFeed:
        """The feed of `cfg.logging.backends`, each tracker started with the config (raises ConfigError for an
        unknown or uninstalled backend). `resume`: continue the tracker runs of RUN_DIR/tracking.json."""
        run_dir = Path(cfg.run_dir)
        state = _read_state(run_dir / STATE_FILE) if resume else {}
        ids = {k: str(v) for k, v in (state.get("ids") or {}).items()} or {"id": secrets.token_hex(4)}
        run = TrackerRun(dir=run_dir, project=cfg.logging.project, name=cfg.logging.run_name or run_dir.resolve().name,
                         tags=tuple(cfg.logging.tags), ids=ids, resume=resume and bool(state))
        feed = cls(make_trackers(cfg.logging.backends, run), run, int(state.get("last_step", -1)))
        if not resume:
            feed._skip_existing()
        feed._start(config_to_dict(cfg))
        feed._save_state()
        return feed

    def _start(self, config: dict[str, Any]) -> None:
        """Open every tracker's run; one that cannot (not logged in, no server) stops `up` before it starts any
        process, the others closed again."""
        for i, tracker in enumerate(self.trackers):
            try:
                tracker.start(config)
            except Exception as exc:  # a third-party SDK's own error types
                self.trackers = self.trackers[:i]
                self.close()
                raise ConfigError(f"logging.backends: {type(tracker).__name__} could not open its run: "
                                  f"{type(exc).__name__}: {exc}") from exc

    def poll(self) -> int:
        """Forward the records written since the last poll; returns how many."""
        if not self.trackers:
            return 0
        sent = 0
        for record in self._new_records():
            step = int(record["step"])
            if step <= self.last_step:
                continue
            metrics = flatten(record)
            self._each("log", step, metrics)
            self.last_step, sent = step, sent + 1
        if sent:
            self._save_state()
        return sent

    def finish(self, artifacts: Sequence[Path | None] = ()) -> None:
        """Forward what is left, attach `artifacts` (those that exist) and close every tracker."""
        self.poll()
        for path in artifacts:
            if path is not None and path.is_file():
                self._each("artifact", path)
        self.close()

    def close(self) -> None:
        """Close every tracker (idempotent)."""
        self._each("finish")
        self.trackers = []

    def _skip_existing(self) -> None:
        """A fresh run: what metrics.jsonl holds now is an earlier run's."""
        try:
            st = self.metrics.stat()
        except FileNotFoundError:
            return
        self._inode, self._offset = st.st_ino, st.st_size

    def _new_records(self) -> list[dict[str, Any]]:
        """The complete lines appended since the last read (from the start when the file was replaced)."""
        try:
            st = self.metrics.stat()
        except FileNotFoundError:
            return []
        if st.st_ino != self._inode or st.st_size < self._offset:
            self._inode, self._offset = st.st_ino, 0
        if st.st_size == self._offset:
            return []
        with self.metrics.open("rb") as f:
            f.seek(self._offset)
            data = f.read()
        complete = data[:data.rfind(b"\n") + 1]  # a line still being written waits for the next poll
        self._offset += len(complete)
        out = []
        for line in complete.splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a crash (metrics_log.read_records skips it too)
            if isinstance(record, dict) and isinstance(record.get("step"), int):
                out.append(record)
        return out

    def _each(self, what: str, *args: Any) -> None:
        """Call the method `what` of every tracker with `args`."""
        for tracker in list(self.trackers):
            try:
                getattr(tracker, what)(*args)
            except Exception as exc:  # a third-party SDK's failure: the run goes on without that tracker
                log.warning("tracker %s failed in %s (%s: %s); the run goes on without it", type(tracker).__name__,
                            what, type(exc).__name__, exc)
                if what != "finish":
                    self.trackers.remove(tracker)
                    self._finish_quietly(tracker)

    @staticmethod
    def _finish_quietly(tracker: Tracker) -> None:
        try:
            tracker.finish()
        except Exception:  # already reported as failed
            log.debug("tracker %s did not finish cleanly", type(tracker).__name__, exc_info=True)

    def _save_state(self) -> None:
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"ids": self.run.ids, "last_step": self.last_step}))
        os.replace(tmp, self.state_path)


def _read_state(path: Path) -> dict[str, Any]:
    try:
        state = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return state if isinstance(state, dict) else {}
