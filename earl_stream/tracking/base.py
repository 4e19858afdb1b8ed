"""What every experiment-tracker backend is (`Tracker`), what it is given to open its run (`TrackerRun`), and
the one shape of the metrics it logs (`flatten`: `a/b` keys, numbers only).

Backends (one module each: `tensorboard`, `wandb`, `mlflow`, `trackio`) implement the Protocol and inherit
nothing from each other; which names exist and what to install for each is `registry`'s; feeding them the
run's step records is `feed`'s.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Protocol

# record keys that are not metrics: the step is the x axis, `time` an epoch timestamp
_NOT_METRICS = frozenset({"step", "time"})


@dataclasses.dataclass
class TrackerRun:
    """The run a backend opens: where its local files go (`dir`, under RUN_DIR), the names it is known by, and
    `ids`, the identities kept in RUN_DIR/tracking.json so that `up --resume` continues the same tracker run
    (`id`: this run's own, made once per fresh run; a backend may add its own, e.g. `mlflow_run_id`)."""

    dir: Path
    project: str
    name: str
    tags: tuple[str, ...]
    ids: dict[str, str]
    resume: bool = False


class Tracker(Protocol):
    """One experiment tracker's run: opened with the run's config, one `log` per training step (steps
    increasing, each once), files attached at the end, then finished. Calls come from one thread."""

    def start(self, config: dict[str, Any]) -> None:
        """Open (or, `TrackerRun.resume`, continue) the run and record the effective config (nested dict)."""
        ...

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """The metrics of training step `step` (`flatten`ed: `a/b` keys, finite numbers)."""
        ...

    def artifact(self, path: Path) -> None:
        """Attach a file of the run (summary.json, learning_curve.png)."""
        ...

    def finish(self) -> None:
        """Flush and close the run; nothing is called after it."""
        ...


def flatten(record: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """The numbers of a step record as `a/b` keys: nested dicts joined with '/', a list by its newest (last)
    item, booleans as 0/1; strings, None, NaN and infinities left out, and so are `step` and `time`."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if not prefix and key in _NOT_METRICS:
            continue
        name = f"{prefix}{key}"
        if isinstance(value, list):
            value = value[-1] if value else None
        if isinstance(value, dict):
            out.update(flatten(value, name + "/"))
        elif isinstance(value, bool):
            out[name] = float(value)
        elif isinstance(value, (int, float)) and math.isfinite(value):
            out[name] = float(value)
    return out


def flatten_config(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """A nested config as dotted keys -> text (list items and dict values joined as JSON-like text), for
    trackers whose parameters are flat strings (MLflow)."""
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten_config(value, name + "."))
        else:
            out[name] = str(value)
    return out
