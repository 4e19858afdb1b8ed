"""Resume with a different trainer parallelism, as real processes: `earl-stream up` with one trainer
rank writes DCP checkpoints, `up --resume` with two ranks continues from them (and back to one), and
each resumed rank holds exactly the saved weights and Adam moments; the ledger adds up."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cluster import REPLY_LENGTH_ENV, wait_for
from safetensors.torch import load_file

from earl_stream.errors import ModelError
from earl_stream.model import load_model
from earl_stream.workers import checkpoint as ckpt

pytestmark = pytest.mark.slow

GROUPS, GROUP_SIZE = 2, 4
FINGERPRINT = r"fingerprint param0 \S+ params \S+ exp_avg0 \S+ exp_avg_sq0 \S+ adam_step0 \S+"


def _up(run: Path, model_dir: Path, steps: int, nproc: int, *, resume: bool,
        interrupt_after: int = 0) -> tuple[dict, str]:
    """`earl-stream up`; with `interrupt_after`, Ctrl-C once `checkpoints/latest` reaches that step.
    Returns the summary and what this run appended to the trainer's log."""
    env_file = run.parent / "reply_length.py"
    env_file.write_text(REPLY_LENGTH_ENV)
    log = run / "logs" / "trainer.log"
    start = log.stat().st_size if log.exists() else 0
    summary = run.parent / f"summary-{steps}-{nproc}.json"
    cmd = [sys.executable, "-m", "earl_stream", "up", "--steps", str(steps), "--summary", str(summary),
           *(["--resume"] if resume else []), f"model.path={model_dir}", f"run_dir={run}",
           f"envs.0.spec={env_file}:ReplyLength", f"trainer.groups_per_step={GROUPS}",
           f"trainer.group_size={GROUP_SIZE}", "rollout.groups_in_flight=2", "rollout.workers=1",
           "supervisor.heartbeat_s=0.2", f"trainer.nproc={nproc}", "trainer.checkpoint_every=2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        if interrupt_after:
            latest = run / "checkpoints" / "latest"
            wait_for(lambda: latest.exists() and int(latest.read_text().split("_")[1]) >= interrupt_after
                     or proc.poll() is not None, 180, f"a checkpoint of step {interrupt_after}")
            proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]  # a requested stop (Ctrl-C) exits 0, as the end of the run does
    return json.loads(summary.read_text()), log.read_text(errors="replace")[start:]


def _saved(log: str, step: int) -> str:
    found = re.findall(rf"checkpoint of step {step} written to \S+ \(({FINGERPRINT})\)", log)
    assert len(found) == 1, f"no single checkpoint of step {step} in the trainer log"
    return found[0]


def _check_resumed(log: str, step: int, nproc: int, written_by: int, saved: str) -> None:
    """Every rank of the new pool loaded checkpoint `step` and holds exactly the saved state."""
    loaded = re.findall(rf"loaded checkpoint \S+ of step (\d+) \(policy version (\d+), written by (\d+) ranks\): "
                        rf"({FINGERPRINT})", log)
    assert [(int(s), int(v), int(w)) for s, v, w, _ in loaded] == [(step, step, written_by)] * nproc
    assert [f for *_, f in loaded] == [saved] * nproc
    assert [int(s) for s in re.findall(r"resumed from \S+ at step (\d+)", log)] == [step] * nproc
    trained = [int(s) for s in re.findall(r"step (\d+): loss", log)]
    assert trained and min(trained) == step + 1, f"the resumed pool trained steps {trained}"


def _check_ledger(run: Path, summary: dict, steps: int) -> None:
    journal: dict[int, dict] = {}
    for line in (run / "trained.jsonl").read_text().splitlines():
        entry = json.loads(line)
        assert journal.setdefault(entry["step"], entry) == entry  # a step journaled twice has the same rows
    assert sorted(journal) == list(range(steps))
    trained = [o for e in journal.values() for o in e["trained"]]
    lost = sum(len(e["lost"]) for e in journal.values())
    assert len(trained) == len(set(trained)) == steps * GROUPS - lost  # no prompt twice, none skipped
    assert summary["policy_version"] == steps
    assert steps * GROUPS * GROUP_SIZE - summary["samples_lost"] <= summary["samples_trained"] <= steps * GROUPS * GROUP_SIZE
    assert summary["duplicates_detected"] == 0


def _latest_step(run: Path) -> int:
    path = ckpt.latest_checkpoint(run)
    assert path is not None
    return int(path.name.split("_")[1])


def _check_in_one_process(run: Path, model_dir: Path, step: int, saved: str, world_size: int) -> None:
    """The DCP checkpoint loads in a plain process: weights equal its Hugging Face export, and model and
    optimizer state equal what the pool logged when it wrote it."""
    path = ckpt.checkpoints_dir(run) / f"step_{step:06d}"
    model, _ = load_model(model_dir)
    ckpt.load_model_weights(path, model)
    exported = load_file(path / "model.safetensors")
    assert exported and all(torch.equal(model.state_dict()[k], v) for k, v in exported.items())
    optimizer = torch.optim.AdamW(model.parameters())
    state = ckpt.load_checkpoint(path, model, optimizer, collective=False)
    assert (state.step, state.policy_version, state.world_size) == (step, step, world_size)
    assert ckpt.state_fingerprint(model, optimizer) == saved


@pytest.mark.faults
def test_resume_with_more_then_fewer_trainer_ranks(tmp_path: Path, tiny_model_dir: Path) -> None:
    torch.set_num_threads(1)
    run = tmp_path / "run"
    # one rank, interrupted (Ctrl-C) once it has checkpointed step 4; the stopping rank may write one more
    _, log = _up(run, tiny_model_dir, 40, 1, resume=False, interrupt_after=4)
    first = _latest_step(run)
    saved = _saved(log, first)
    assert "exp_avg0 0.0 " not in saved, "the steps did not move Adam's moments: the test would prove nothing"
    _check_in_one_process(run, tiny_model_dir, first, saved, world_size=1)
    # 1 -> 2 ranks: both load the one-rank checkpoint through DCP and continue after it
    _, log = _up(run, tiny_model_dir, 40, 2, resume=True, interrupt_after=first + 2)
    _check_resumed(log, first, nproc=2, written_by=1, saved=saved)
    second = _latest_step(run)
    saved = _saved(log, second)
    together = [p for p in ckpt.checkpoints_dir(run).glob("step_*") if first < int(p.name[5:]) and int(p.name[5:]) % 2 == 0]
    assert together and all(sorted(f.name for f in (p / ckpt.DCP_DIR).glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
                            for p in together)  # both ranks wrote (DCP spreads the replicated tensors over them)
    _check_in_one_process(run, tiny_model_dir, second, saved, world_size=2)
    # 2 -> 1 rank, to the end of the run
    steps = second + 2
    summary, log = _up(run, tiny_model_dir, steps, 1, resume=True)
    _check_resumed(log, second, nproc=1, written_by=2, saved=saved)
    _check_ledger(run, summary, steps)
    print(f"resumed 1 -> 2 ranks at step {first}, 2 -> 1 at step {second}, finished at {steps}; ledger: trained "
          f"{summary['samples_trained']}, produced {summary['samples_produced']}, lost {summary['samples_lost']}, "
          f"duplicates {summary['duplicates_detected']}")


def test_checkpoint_of_the_format_before_dcp_still_loads(tmp_path: Path, tiny_model_dir: Path) -> None:
    """A run written before DCP (HF export + rank 0's torch.save of the optimizer) still resumes."""
    torch.set_num_threads(1)
    model, tokenizer = load_model(tiny_model_dir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.arange(12).reshape(2, 6)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    out = tmp_path / "checkpoints" / "step_000003"
    out.mkdir(parents=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    torch.save({"optimizer": optimizer.state_dict(), "step": 3, "policy_version": 3, "rng": torch.get_rng_state(),
                "unreleased": [(2, ["g1.0-0"])]}, out / ckpt.LEGACY_STATE)
    (tmp_path / "checkpoints" / "latest").write_text(out.name)
    saved = ckpt.state_fingerprint(model, optimizer)
    fresh, _ = load_model(tiny_model_dir)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    state = ckpt.load_checkpoint(ckpt.latest_checkpoint(tmp_path), fresh, fresh_opt)
    assert (state.step, state.policy_version, state.unreleased, state.format) == (3, 3, [(2, ["g1.0-0"])], 1)
    assert ckpt.state_fingerprint(fresh, fresh_opt) == saved
    with pytest.raises(ModelError, match="not a complete trainer checkpoint"):
        ckpt.load_checkpoint(tmp_path, fresh, fresh_opt)
