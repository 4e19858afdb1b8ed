"""The `logging` section: which experiment trackers a run's step records, config and end-of-run files go to
(`earl_stream/tracking/`). A pure type; unknown backend names are refused in `earl_stream.config.validate`,
a backend whose package is missing by `earl-stream up` before it starts any process.
"""

from __future__ import annotations

import dataclasses

from earl_stream.config.fields import field as _f


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
    backends: list[str] = _f(["jsonl"], "experiment trackers that get each step's metrics, the config and the summary "
                             "and learning curve: any of jsonl (RUN_DIR/metrics.jsonl, always written), tensorboard, "
                             "wandb, mlflow, trackio (each but jsonl needs its extra, e.g. pip install earl-stream[wandb])")
    project: str = _f("earl_stream", "the trackers' project: W&B project, MLflow experiment, trackio project")
    run_name: str = _f("", "the run's name in the trackers; empty = the name of run_dir")
    tags: list[str] = _f([], "tags of the run in the trackers (W&B tags, MLflow tags, trackio config)")
