"""trackio (Hugging Face's local-first tracker): one trackio run, named `logging.run_name`, in the project
`logging.project`, stored where trackio keeps it (TRACKIO_DIR, default ~/.cache/huggingface/trackio, which
`trackio show` reads). `up --resume` continues the run of the same name. summary.json and
learning_curve.png go as run artifacts. trackio prints its progress to stdout: here it goes to the log.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from earl_stream.tracking.base import TrackerRun

log = logging.getLogger(__name__)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # trackio colours the command it suggests


class TrackioTracker:
    def __init__(self, run: TrackerRun) -> None:
        self.run = run
        self._trackio: Any = None

    def start(self, config: dict[str, Any]) -> None:
        import trackio

        with _quiet():
            trackio.init(project=self.run.project, name=self.run.name, config={**config, "tags": list(self.run.tags)},
                         resume="allow" if self.run.resume else "never", embed=False, auto_log_cpu=False,
                         auto_log_gpu=False)
        self._trackio = trackio

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._trackio.log(metrics, step=step)

    def artifact(self, path: Path) -> None:
        with _quiet():
            self._trackio.log_artifact(str(path), name=f"{self.run.name}-{path.stem}", type="run-files")

    def finish(self) -> None:
        if self._trackio is not None:
            with _quiet():
                self._trackio.finish()


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """trackio's print()s, to this module's log (they would write into `up`'s live view)."""
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            yield
    finally:
        for line in _ANSI.sub("", out.getvalue()).splitlines():
            if line.strip():
                log.info("trackio: %s", line.strip())
