"""MLflow: one MLflow run per earl_stream run in the experiment `logging.project`, through MLflow's client
(no global active run). The tracking store is MLFLOW_TRACKING_URI when set (a server, a database), else a
local file store in RUN_DIR/mlruns (`mlflow ui --backend-store-uri RUN_DIR/mlruns`; MLflow 3 keeps that
store in maintenance mode and asks for MLFLOW_ALLOW_FILE_STORE=true, set here for that case only). The
config goes as parameters (dotted keys) and as config.json; summary.json and learning_curve.png as artifacts.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from earl_stream.tracking.base import TrackerRun, flatten_config

_PARAMS_PER_BATCH = 100  # MLflow's limit of parameters per log_batch call
_PARAM_CHARS = 6000  # MLflow's limit of a parameter's value


class MlflowTracker:
    def __init__(self, run: TrackerRun) -> None:
        self.run = run
        self._client: Any = None
        self._run_id = ""

    def start(self, config: dict[str, Any]) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = (self.run.dir / "mlruns").resolve().as_uri()
        self._client = MlflowClient(tracking_uri=uri)
        self._run_id = self.run.ids.get("mlflow_run_id", "") if self.run.resume else ""
        if self._run_id:
            self._client.update_run(self._run_id, status="RUNNING")
            return
        experiment = self._client.get_experiment_by_name(self.run.project)
        experiment_id = experiment.experiment_id if experiment else self._client.create_experiment(self.run.project)
        created = self._client.create_run(experiment_id, run_name=self.run.name, tags={t: "" for t in self.run.tags})
        self._run_id = self.run.ids["mlflow_run_id"] = created.info.run_id
        params = [Param(k, v[:_PARAM_CHARS]) for k, v in flatten_config(config).items()]
        for i in range(0, len(params), _PARAMS_PER_BATCH):
            self._client.log_batch(self._run_id, params=params[i:i + _PARAMS_PER_BATCH])
        self._client.log_dict(self._run_id, config, "config.json")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._client.log_batch(self._run_id, metrics=[Metric(k, v, now, step) for k, v in metrics.items()])

    def artifact(self, path: Path) -> None:
        self._client.log_artifact(self._run_id, str(path))

    def finish(self) -> None:
        if self._run_id:
            self._client.set_terminated(self._run_id)
