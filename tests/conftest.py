"""Shared fixtures: a tiny model built once per test session, loaded like a user's model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from earl_stream.model import init_model

    return init_model(tmp_path_factory.mktemp("model") / "tiny", seed=0)


@pytest.fixture(autouse=True)
def _cpu_suite_processes_compute_on_cpu(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The processes a CPU-suite test starts (`up`, workers) compute on the CPU even on a host with a GPU: the
    suite's expectations are the CPU's (two trainer ranks on one host, exact CPU numerics). The `gpu`-marked
    tests (`make test-gpu`) are the CUDA tier and keep the host's devices."""
    if request.node.get_closest_marker("gpu") is None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """End-to-end tests (marked `slow`, `live` or `faults`) start real processes that share the machine's cores: one
    that fails is run once more (pytest-rerunfailures), so a timing race must strike twice to fail the
    suite. Unit tests get no second chance. The reruns are listed in the report (`R`)."""
    if not config.pluginmanager.hasplugin("rerunfailures"):
        return
    for item in items:
        if any(item.get_closest_marker(m) for m in ("slow", "live", "faults")) and not item.get_closest_marker("flaky"):
            item.add_marker(pytest.mark.flaky(reruns=1, reruns_delay=2))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """The first failure of a test that is run again (outcome `rerun`) is printed, its tail, so that a race
    that a rerun hid can still be diagnosed from the CI log (the summary lists only its name)."""
    if report.outcome == "rerun" and report.longrepr is not None:
        text = report.longreprtext
        print(f"\n--- first failure of {report.nodeid} ({report.when}), run again ---\n{text[-4000:]}", flush=True)
