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
