"""`model.path=org/name`: a Hub id resolved once to a commit and a manifest, found in each host's own cache,
refused where a cached file differs; offline only where the environment says so. The Hub is never reached:
the tests write a cache in huggingface_hub's layout (blobs, snapshot symlinks, refs) and set HF_HUB_OFFLINE=1."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from earl_stream.config import load_config
from earl_stream.errors import ConfigError, ModelError
from earl_stream.model.hub import hub_snapshot, pin_model, resolve
from earl_stream.model.loading import load_model
from earl_stream.workers.common import model_path

REPO = "earl-test/tiny"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def write_hub_cache(hf_home: Path, repo: str, model_dir: Path, commit: str = COMMIT, ref: str = "main") -> Path:
    """`model_dir` as huggingface_hub caches a download of `repo` at `commit`: blobs named by their sha256,
    the snapshot's files symlinks to them, refs/<ref> holding the commit. Returns the snapshot directory."""
    root = hf_home / "hub" / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / commit
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    for src in sorted(p for p in model_dir.rglob("*") if p.is_file()):
        data = src.read_bytes()
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / src.relative_to(model_dir)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def hub_home(tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    hf_home = tmp_path / "hf"
    write_hub_cache(hf_home, REPO, tiny_model_dir)
    monkeypatch.setenv("HF_HOME", str(hf_home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hf_home


def test_hub_id_resolves_offline_to_the_cached_commit_and_loads(hub_home: Path) -> None:
    cfg = pin_model(load_config(None, [f"model.path={REPO}"]))
    assert cfg.model.path == REPO and cfg.model.revision == COMMIT
    assert {"config.json", "model.safetensors", "tokenizer_config.json"} <= set(cfg.model.manifest)
    folder = model_path(cfg)  # what every worker does with the pinned (repo, commit, manifest)
    assert folder == hub_home / "hub" / "models--earl-test--tiny" / "snapshots" / COMMIT
    model, tokenizer = load_model(folder)
    assert model.config.model_type and tokenizer.chat_template
    assert pin_model(cfg) is cfg  # pinned once: a supervisor given `up`'s config changes nothing
    assert load_model(REPO, revision=COMMIT)[0].config.vocab_size == model.config.vocab_size


def test_revision_names_a_branch_or_commit(hub_home: Path, tiny_model_dir: Path) -> None:
    other = "fedcba9876543210fedcba9876543210fedcba98"
    write_hub_cache(hub_home, REPO, tiny_model_dir, commit=other, ref="v2")
    assert pin_model(load_config(None, [f"model.path={REPO}", "model.revision=v2"])).model.revision == other
    assert pin_model(load_config(None, [f"model.path={REPO}", f"model.revision={other}"])).model.revision == other
    with pytest.raises(ModelError, match="model.revision"):
        resolve(REPO, "no-such-branch")


def test_a_worker_whose_cached_file_differs_refuses_naming_it(hub_home: Path) -> None:
    cfg = pin_model(load_config(None, [f"model.path={REPO}"]))
    config_file = hub_home / "hub" / "models--earl-test--tiny" / "snapshots" / COMMIT / "config.json"
    blob = config_file.resolve()
    blob.write_text(blob.read_text().replace("{", '{"edited": 1, ', 1))
    with pytest.raises(ModelError, match=r"config\.json differs") as err:
        model_path(cfg)
    assert "model.safetensors" not in str(err.value)  # only what differs is named
    config_file.unlink()
    with pytest.raises(ModelError, match=r"config\.json is missing"):
        hub_snapshot(REPO, COMMIT, cfg.model.manifest)


def test_config_checks_the_hub_fields(tiny_model_dir: Path) -> None:
    with pytest.raises(ConfigError, match="model.revision=main applies to a Hugging Face Hub id"):
        load_config(None, [f"model.path={tiny_model_dir}", "model.revision=main"])
    with pytest.raises(ConfigError, match="model.manifest is set by `up`"):
        load_config(None, [f"model.path={REPO}", 'model.manifest={"config.json": "' + "0" * 64 + '"}'])
    assert load_config(None, [f"model.path={tiny_model_dir}"]).model.revision == ""  # a local folder stays one


def test_a_missing_hub_model_is_one_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty-hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelError) as err:
        resolve("earl-test/absent")
    proc = subprocess.run([sys.executable, "-m", "earl_stream", "up", "--steps", "1", "model.path=earl-test/absent",
                           f"run_dir={tmp_path / 'run'}"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    error = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(error) == 1 and str(err.value) in error[0]
    for hint in ("model.path=earl-test/absent", "HF_HOME", "HF_TOKEN", "model.revision", "HF_HUB_OFFLINE=1"):
        assert hint in error[0]


def test_cli_leaves_offline_mode_to_the_user(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    probe = "import os, earl_stream.cli.main as m; m.main(['config', 'show']); print(os.environ.get('HF_HUB_OFFLINE'))"
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0 and proc.stdout.splitlines()[-1] == "None", proc.stderr[-2000:]


@pytest.mark.live
def test_up_trains_a_hub_model_and_records_its_commit(tmp_path: Path, hub_home: Path) -> None:
    summary = tmp_path / "s.json"
    cmd = [sys.executable, "-m", "earl_stream", "up", "--steps", "2", "--summary", str(summary),
           f"model.path={REPO}", f"run_dir={tmp_path / 'run'}", "trainer.groups_per_step=1", "trainer.group_size=2",
           "rollout.groups_in_flight=1", "supervisor.heartbeat_s=0.2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    written = json.loads(summary.read_text())
    assert written["policy_version"] >= 2
    assert written["model"] == {"path": REPO, "revision": COMMIT}
    run_config = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert run_config["model"]["revision"] == COMMIT and "model.safetensors" in run_config["model"]["manifest"]


def test_a_resumed_run_keeps_the_commit_it_started_with(hub_home: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    from earl_stream.cli.up import prepare

    run = [f"model.path={REPO}", f"run_dir={tmp_path / 'run'}"]
    first, _ = prepare(load_config(None, run))
    assert first.model.revision == COMMIT
    moved = "c" * 40  # main moves on after the run started
    write_hub_cache(hub_home, REPO, tiny_model_dir, commit=moved)
    resumed, _ = prepare(load_config(None, run), resume=True)
    assert (resumed.model.revision, resumed.model.manifest) == (COMMIT, first.model.manifest)
    assert prepare(load_config(None, run))[0].model.revision == moved  # a fresh run takes the new commit
