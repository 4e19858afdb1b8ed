"""Progress (earl_stream/progress.py): periodic plain lines and a last one in a pipe, a rich bar on a terminal,
nothing with EARL_STREAM_PROGRESS=off; `model import` and `model export` report their stages and files, and a
command in a pipe writes its progress on stderr while stdout stays its JSON."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console

from earl_stream import progress as P

ROOT = Path(__file__).resolve().parents[2]


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    c = _Clock()
    monkeypatch.setattr(P.time, "monotonic", c)
    monkeypatch.delenv(P.PROGRESS_ENV, raising=False)
    return c


def test_a_pipe_gets_a_line_at_most_every_interval_and_a_last_one(clock: _Clock) -> None:
    out = io.StringIO()
    with P.progress("eval x", 4, "episodes", console=Console(file=out), interval_s=10) as bar:
        for t in (1.0, 11.0, 12.0, 25.0):
            clock.now = 100.0 + t
            bar.advance(note=f"loss {t:.0f}")
    assert out.getvalue().splitlines() == ["eval x: 2/4 episodes (50%) 11.0 s, loss 11",
                                           "eval x: 4/4 episodes (100%) 25.0 s, loss 25"]  # not written twice
    out = io.StringIO()
    with P.progress("eval x", 4, "episodes", console=Console(file=out), interval_s=10) as bar:
        bar.advance()
    assert out.getvalue() == "eval x: 1/4 episodes (25%) 0.0 s\n"


def test_the_total_may_come_later_and_a_failure_says_stopped(clock: _Clock) -> None:
    out = io.StringIO()
    with pytest.raises(RuntimeError), P.progress("model export", unit="steps", console=Console(file=out)) as bar:
        clock.now += 3
        bar.update(1)
        assert bar.line() == "model export: 1 steps 3.0 s"
        bar.update(2, 5, "config.json")
        raise RuntimeError("disk full")
    assert out.getvalue() == "model export: 2/5 steps (40%) 3.0 s, config.json (stopped)\n"


def test_a_terminal_gets_a_rich_bar(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(P.PROGRESS_ENV, raising=False)
    out = io.StringIO()
    with P.progress("sft", 3, "steps", console=Console(file=out, force_terminal=True, width=120)) as bar:
        for _ in range(3):
            bar.advance(note="loss 0.5")
    text = out.getvalue()
    assert "━" in text and "3/3" in text and "steps" in text and "loss 0.5" in text
    assert "sft: 3/3" not in text  # no plain line besides the bar


@pytest.mark.parametrize("value", ["off", "0"])
def test_off_prints_nothing(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(P.PROGRESS_ENV, value)
    for terminal in (True, False):
        out = io.StringIO()
        with P.progress("eval", 2, console=Console(file=out, force_terminal=terminal), interval_s=0) as bar:
            bar.advance(2)
        assert out.getvalue() == ""


def test_the_mode_can_be_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(P.PROGRESS_ENV, "lines")
    assert P.progress_mode(Console(file=io.StringIO(), force_terminal=True)) == "lines"
    monkeypatch.setenv(P.PROGRESS_ENV, "bar")
    assert P.progress_mode(Console(file=io.StringIO())) == "bar"
    monkeypatch.setenv(P.PROGRESS_ENV, "auto")
    assert P.progress_mode(Console(file=io.StringIO())) == "lines"


def test_import_reports_its_stages(tiny_model_dir: Path, tmp_path: Path) -> None:
    from earl_stream.model import import_model

    seen: list[tuple[int, int]] = []
    import_model(tiny_model_dir, tmp_path / "imported", progress=lambda done, total, note: seen.append((done, total)))
    assert seen == [(0, 3), (1, 3), (2, 3), (3, 3)]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """A run directory with one full-model checkpoint of the tiny model."""
    from earl_stream.model import load_model
    from earl_stream.workers.checkpoint import RunState, save_checkpoint

    model, tokenizer = load_model(tiny_model_dir)
    run = tmp_path_factory.mktemp("run")
    save_checkpoint(run, RunState(step=1, policy_version=1, rng=torch.get_rng_state(), unreleased=[]), model,
                    torch.optim.AdamW(model.parameters()), tokenizer, collective=False)
    return run


def _export(run_dir: Path, out: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "earl_stream", "model", "export", str(run_dir), str(out)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, env={**os.environ, **env})


def test_model_export_in_a_pipe_shows_progress_on_stderr_and_json_on_stdout(run_dir: Path, tmp_path: Path) -> None:
    proc = _export(run_dir, tmp_path / "out", EARL_STREAM_PROGRESS="auto")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout) == {"out_dir": str(tmp_path / "out"), "merged": False}
    files = sum(1 for p in (tmp_path / "out").rglob("*") if p.is_file())
    last = [line for line in proc.stderr.splitlines() if line.startswith("model export: ")][-1]
    assert last.startswith(f"model export: {files}/{files} steps (100%) ") and files >= 3, proc.stderr

    proc = _export(run_dir, tmp_path / "quiet", EARL_STREAM_PROGRESS="off")
    assert proc.returncode == 0 and "model export:" not in proc.stderr
    assert json.loads(proc.stdout)["out_dir"] == str(tmp_path / "quiet")


def test_sft_in_a_pipe_reports_its_steps_with_the_loss_instead_of_log_lines(tiny_model_dir: Path,
                                                                            tmp_path: Path) -> None:
    chat = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": chat}) + "\n" for _ in range(4)))
    proc = subprocess.run([sys.executable, "-m", "earl_stream", "sft", "--model", str(tiny_model_dir), "--data",
                           str(data), "--out", str(tmp_path / "out"), "steps=3", "batch_size=2", "log_every=1"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "EARL_STREAM_PROGRESS": "auto"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("sft: ")]
    assert lines and lines[-1].startswith("sft: 3/3 steps (100%) ") and ", loss " in lines[-1], proc.stderr
    assert "sft step" not in proc.stderr  # the progress replaces the periodic log line
    assert proc.stdout.startswith("sft: 4 transcripts, 3 steps")


def test_transformers_bars_are_off_while_ours_is_shown(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers.utils import logging as hf_logging

    monkeypatch.delenv(P.PROGRESS_ENV, raising=False)
    assert hf_logging.is_progress_bar_enabled()
    with P.progress("eval", 1, console=Console(file=io.StringIO())):
        assert not hf_logging.is_progress_bar_enabled()
    assert hf_logging.is_progress_bar_enabled()
    monkeypatch.setenv(P.PROGRESS_ENV, "off")
    with P.progress("eval", 1, console=Console(file=io.StringIO())):
        assert hf_logging.is_progress_bar_enabled()
