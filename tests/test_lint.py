"""The code is ruff clean and type-checks (configuration in pyproject.toml: [tool.ruff], [tool.mypy])."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(module: str, *args: str) -> subprocess.CompletedProcess[str]:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed (it comes with the test extra: pip install -e '.[test]')")
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)


def test_ruff_clean() -> None:
    out = _run("ruff", "check", "--no-cache", "earl_stream", "envs", "bench", "tests")
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.lint
def test_mypy_clean(tmp_path: Path) -> None:
    # the code to check is [tool.mypy] files; a fresh cache keeps the run independent of earlier ones
    out = _run("mypy", "--cache-dir", str(tmp_path / "mypy_cache"))
    assert out.returncode == 0, out.stdout + out.stderr
