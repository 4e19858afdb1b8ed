"""Configuration: defaults, YAML, dotted overrides, and one error naming every bad field."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from earl_stream.config import config_from_dict, config_to_dict, load_config
from earl_stream.errors import ConfigError


def test_defaults_need_no_file() -> None:
    cfg = load_config()
    assert cfg.envs[0].spec == "tictactoe" and cfg.trainer.max_staleness == 1 and cfg.rollout.workers >= 2


def test_yaml_then_overrides(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("trainer:\n  lr: 0.01\n  group_size: 4\nrollout:\n  workers: 3\n")
    cfg = load_config(f, ["trainer.lr=3e-4", "envs.0.weight=2", "envs.1.spec=x.py:Env"])
    assert cfg.trainer.lr == pytest.approx(3e-4) and cfg.trainer.group_size == 4 and cfg.rollout.workers == 3
    assert [e.spec for e in cfg.envs] == ["tictactoe", "x.py:Env"] and cfg.envs[0].weight == 2.0
    assert config_from_dict(config_to_dict(cfg)) == cfg


def test_every_problem_in_one_error() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, ["trainer.lr=abc", "trainer.bogus=1", "rollout.engine=tgi", "steps=-3", "nosuch"])
    text = str(err.value)
    for needle in ("trainer.lr", "trainer.bogus", "allowed:", "rollout.engine", "torch, vllm, sglang", "steps", "nosuch"):
        assert needle in text


def test_bad_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(bad)


def test_cli_config_show_and_errors(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "earl_stream", "config", "show", "trainer.lr=0.5"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "lr: 0.5" in out.stdout
    out = subprocess.run([sys.executable, "-m", "earl_stream", "config", "show", "trainer.lr=x", "rollout.workers=-1"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "trainer.lr" in out.stderr and "rollout.workers" in out.stderr and "Traceback" not in out.stderr


def test_the_written_out_default_is_the_embedded_default() -> None:
    """configs/tictactoe.yaml says it is the embedded default written out: it must stay so."""
    written = load_config(Path(__file__).resolve().parents[1] / "configs" / "tictactoe.yaml")
    default = load_config(None)
    assert config_to_dict(written) == {**config_to_dict(default), "run_dir": written.run_dir}
