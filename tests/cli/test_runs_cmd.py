"""`earl-stream runs show` and `runs compare` on a metrics.jsonl (supervisor/metrics_log.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from earl_stream.cli.main import main
from earl_stream.supervisor.metrics_log import MetricsLog


def _run(run_dir: Path, steps: int, scale: float) -> Path:
    m = MetricsLog(run_dir, "r")
    for s in range(1, steps + 1):
        m.append(s, {"time": 1e9 + s, "wall_seconds": float(s), "reward": scale * s, "loss": 1.0 / s, "kl": None,
                     "plan": "dp1", "peak_memory_bytes": 2.0**30})
    return run_dir


def test_runs_show_table_json_and_last(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = _run(tmp_path / "a", 3, 0.1)
    assert main(["runs", "show", str(run)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:2] == ["step", "wall_s"] and "kl" not in out[0].split()  # a column nothing has is left out
    assert len(out) == 4 and out[-1].split()[0] == "3" and "1.00" in out[-1]  # peak memory in GiB
    assert main(["runs", "show", str(run), "--json", "--last", "2"]) == 0
    records = json.loads(capsys.readouterr().out)
    assert [r["step"] for r in records] == [2, 3] and records[0]["kl"] is None


def test_runs_show_without_records_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["runs", "show", str(tmp_path)]) != 0
    assert "metrics.jsonl" in capsys.readouterr().err


def test_runs_compare_writes_one_png(tmp_path: Path) -> None:
    a, b = _run(tmp_path / "a", 3, 0.1), _run(tmp_path / "b", 2, 0.2)
    out = tmp_path / "cmp" / "runs.png"
    assert main(["runs", "compare", str(a), str(b), "--metric", "reward", "--metric", "loss", "--out", str(out)]) == 0
    assert out.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
