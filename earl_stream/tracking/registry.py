"""The tracker backends by name: which module implements each, which package it needs and which extra of
earl_stream installs it. Checking names (`backend_problems`, at config load) and packages (`check_installed`,
before `up` starts any process) imports no tracker package; `make_trackers` imports the backends named.

`jsonl` is RUN_DIR/metrics.jsonl, which the supervisor always writes (the summary, the curve and the other
trackers are made from it): it has no tracker object.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from collections.abc import Sequence

from earl_stream.errors import ConfigError
from earl_stream.tracking.base import Tracker, TrackerRun


@dataclasses.dataclass(frozen=True)
class Backend:
    module: str  # earl_stream.tracking.<module>, its class `cls`
    cls: str
    package: str  # the import name the backend needs
    extra: str  # pip install earl-stream[<extra>]


BACKENDS: dict[str, Backend | None] = {
    "jsonl": None,
    "tensorboard": Backend("tensorboard", "TensorBoardTracker", "tensorboard", "tensorboard"),
    "wandb": Backend("wandb", "WandbTracker", "wandb", "wandb"),
    "mlflow": Backend("mlflow", "MlflowTracker", "mlflow", "mlflow"),
    "trackio": Backend("trackio", "TrackioTracker", "trackio", "trackio"),
}


def backend_problems(names: Sequence[str]) -> list[str]:
    """What is wrong with `logging.backends` (unknown or repeated names), one line each."""
    out = [f"logging.backends: {n!r} is not a tracker; choose from {', '.join(BACKENDS)}" for n in names
           if n not in BACKENDS]
    repeated = sorted({n for n in names if list(names).count(n) > 1})
    if repeated:
        out.append(f"logging.backends: {repeated} named more than once")
    return out


def check_installed(names: Sequence[str]) -> None:
    """Raise one ConfigError naming every backend in `names` whose package is not importable here, and the
    extra that installs it."""
    missing = [(n, b) for n in names if (b := BACKENDS.get(n)) is not None and not _importable(b.package)]
    if missing:
        lines = [f"logging.backends: {n} needs the package {b.package}, which is not installed: "
                 f"pip install earl-stream[{b.extra}]" for n, b in missing]
        raise ConfigError("\n  ".join(lines) + ("\n  (or pip install earl-stream[trackers] for all of them)"
                                                if len(missing) > 1 else ""))


def make_trackers(names: Sequence[str], run: TrackerRun) -> list[Tracker]:
    """A tracker object per backend named (jsonl has none), not yet started. Raises ConfigError."""
    problems = backend_problems(names)
    if problems:
        raise ConfigError("\n  ".join(problems))
    check_installed(names)
    out: list[Tracker] = []
    for name in names:
        backend = BACKENDS[name]
        if backend is not None:
            module = importlib.import_module(f"earl_stream.tracking.{backend.module}")
            out.append(getattr(module, backend.cls)(run))
    return out


def _importable(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # sys.modules[package] = None (a package blocked), or a broken spec
        return False
