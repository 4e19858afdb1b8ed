"""Weights & Biases: one W&B run per earl_stream run, its local files under RUN_DIR/wandb/. It runs in the
user's mode (WANDB_MODE: online, offline, disabled; W&B's own settings and login otherwise); `up --resume`
continues the same W&B run (its id is RUN_DIR/tracking.json's `id`). summary.json and learning_curve.png go
as one artifact of type `run-files`; the summary's numbers also go to the run's summary.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from earl_stream.tracking.base import TrackerRun, flatten

log = logging.getLogger(__name__)


class WandbTracker:
    def __init__(self, run: TrackerRun) -> None:
        self.run = run
        self._wandb: Any = None
        self._files: list[Path] = []

    def start(self, config: dict[str, Any]) -> None:
        import wandb

        self.run.dir.mkdir(parents=True, exist_ok=True)
        # console="off": W&B would otherwise capture this process's output (the live view) into the run
        self._wandb = wandb.init(project=self.run.project, name=self.run.name, tags=list(self.run.tags),
                                 config=config, dir=str(self.run.dir), id=self.run.ids["id"], resume="allow",
                                 settings=wandb.Settings(console="off", silent=True))
        if not (self._wandb.offline or self._wandb.disabled):  # an offline run has no URL (asking warns)
            log.info("W&B run: %s", self._wandb.url)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._wandb.log(metrics, step=step)

    def artifact(self, path: Path) -> None:
        self._files.append(path)  # one artifact of the run's files, logged at finish
        if path.suffix == ".json":
            self._wandb.summary.update(flatten({"summary": json.loads(path.read_text())}))

    def finish(self) -> None:
        if self._wandb is None:
            return
        if self._files:
            import wandb

            art = wandb.Artifact(f"run-files-{self.run.ids['id']}", type="run-files")
            for path in self._files:
                art.add_file(str(path))
            self._wandb.log_artifact(art)
        self._wandb.finish()
