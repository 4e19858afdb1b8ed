"""Experiment trackers (`logging.backends`): each training step's record, the run's config and its end-of-run
files (summary.json, learning_curve.png) sent to TensorBoard, Weights & Biases, MLflow and trackio besides
RUN_DIR/metrics.jsonl.

- `base`: the `Tracker` Protocol every backend implements, `TrackerRun`, `flatten` (`a/b` keys, numbers);
- `registry`: names -> backend modules and the extra that installs each (`check_installed`, `make_trackers`);
- `tensorboard`, `wandb`, `mlflow`, `trackio`: one backend each;
- `feed`: `TrackerFeed`, which `earl-stream up` runs: it tails metrics.jsonl and fans each new record out.
"""

from earl_stream.tracking.base import Tracker, TrackerRun, flatten
from earl_stream.tracking.registry import BACKENDS, backend_problems, check_installed, make_trackers

__all__ = ["BACKENDS", "Tracker", "TrackerRun", "backend_problems", "check_installed", "flatten", "make_trackers"]
