"""`earl-stream eval` on a trainer checkpoint: the same figure as bench/heldout.py on the same items (the
model of the checkpoint's Hugging Face export, played in-process); samples and pass@k through the CLI;
Tic-Tac-Toe, which has no held-out items, on evaluation seeds with its win/draw/loss rates; what cannot be played
is refused with the reason."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from earl_stream.model import load_model
from earl_stream.workers.checkpoint import RunState, save_checkpoint

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PARITY = f"{Path(__file__).resolve().parent / 'parity_env.py'}:ParityEnv"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """A run directory with one checkpoint of the tiny model, its weights moved off their init."""
    model, tokenizer = load_model(tiny_model_dir)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    run = tmp_path_factory.mktemp("run")
    save_checkpoint(run, RunState(step=3, policy_version=3, rng=torch.get_rng_state(), unreleased=[]), model,
                    torch.optim.AdamW(model.parameters()), tokenizer, collective=False)
    return run


def _eval(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "earl_stream", "eval", *args], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)


def test_eval_of_a_checkpoint_equals_bench_heldout(run_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "eval.json"
    proc = _eval("--model", str(run_dir), "--env", PARITY, "--params", '{"size": 500}', "--problems", "16",
                 "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["model_kind"] == "checkpoint" and result["model"].endswith("step_000003")
    assert "success" in proc.stdout and "pass@1" in proc.stdout
    assert result["seeds"] == list(range(500, 516)) and result["heldout_params"]["held"] is True

    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import heldout
    finally:
        sys.path.remove(str(ROOT / "bench"))
    model, tokenizer = load_model(run_dir / "checkpoints" / "step_000003")
    bench = heldout.evaluate(model, tokenizer, {"size": 500}, problems=16, batch=8, spec=PARITY)
    assert bench.problems == result["problems"] == 16
    assert bench.outcomes == result["outcomes"] and bench.success == result["success"]
    assert 0 < result["success"] < 1, "the parity task should split a random policy's items"
    assert result["pass_at_k"] == {"1": result["success"]}


def test_eval_samples_give_pass_at_k(run_dir: Path) -> None:
    """--json: the result alone on stdout (the human summary on stderr); --param as --params would give it."""
    proc = _eval("--model", str(run_dir), "--env", PARITY, "--param", "size=500", "--problems", "6", "--samples", "3",
                 "--temperature", "1.0", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout)
    assert "pass@1" in proc.stderr and r["seeds"] == list(range(500, 506))
    assert r["episodes"] == 18 and set(r["pass_at_k"]) == {"1", "2", "3"}
    assert r["pass_at_k"]["1"] == pytest.approx(r["success"])
    assert r["pass_at_k"]["1"] <= r["pass_at_k"]["2"] <= r["pass_at_k"]["3"]


def test_eval_of_tictactoe_plays_evaluation_seeds_and_reports_game_rates(run_dir: Path, tmp_path: Path) -> None:
    """The default game defines no held-out items: a checkpoint is evaluated on seeds no run trains on, with win,
    draw and loss rates beside success. The deprecated `--json PATH` still writes the file, with a warning."""
    from earl_stream.env.seeds import eval_seeds

    proc = _eval("--model", str(run_dir), "--env", "tictactoe", "--problems", "8", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout)
    assert r["model_kind"] == "checkpoint" and r["items"] == "eval_seeds" and r["seeds"] == eval_seeds(8)
    assert r["episodes"] == 8 and sum(r["outcomes"].values()) == 8
    rates = (r["win_rate"], r["draw_rate"], r["loss_rate"])
    assert all(0 <= x <= 1 for x in rates) and sum(rates) == pytest.approx(1.0)  # every game ends one of the three
    assert r["success"] == pytest.approx(r["win_rate"])
    assert "evaluation seeds (never issued for training)" in proc.stderr and "  win " in proc.stderr

    old = tmp_path / "old.json"
    proc = _eval("--model", str(run_dir), "--env", "tictactoe", "--problems", "2", "--json", str(old))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "`--json PATH` is deprecated" in proc.stderr and json.loads(old.read_text())["problems"] == 2


def test_eval_refuses_what_it_cannot_play(run_dir: Path) -> None:
    proc = _eval("--model", str(run_dir), "--env", "no_such_module_xyz:Env", "--problems", "4")
    assert proc.returncode == 2 and "cannot be loaded" in proc.stderr
    proc = _eval("--model", str(run_dir), "--env", PARITY, "--samples", "2")
    assert proc.returncode == 2 and "needs a temperature above 0" in proc.stderr
