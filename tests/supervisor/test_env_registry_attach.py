"""The supervisor's environment registry: what `env attach` stores and sends to the rollout workers."""

from __future__ import annotations

import json

import pytest

from earl_stream.config import EnvSpec
from earl_stream.errors import ConfigError
from earl_stream.supervisor.envs import EnvRegistry


def test_attach_keeps_the_group_seed_for_the_workers() -> None:
    reg = EnvRegistry([EnvSpec()])
    reg.attach("connect_four", "", 2.0, {}, "shared")
    sent = {d["spec"]: d for d in json.loads(reg.specs_json())}
    assert sent["connect_four"]["group_seed"] == "shared" and sent["tictactoe"]["group_seed"] == "auto"
    assert {e["name"]: e["group_seed"] for e in reg.describe({}, {})} == {"tictactoe": "auto", "connect_four": "shared"}


def test_attach_refuses_an_unknown_group_seed() -> None:
    reg = EnvRegistry([])
    with pytest.raises(ConfigError, match="--group-seed must be one of auto, shared, per_episode, got 'each'"):
        reg.attach("connect_four", "", 1.0, {}, "each")
    assert reg.entries == {}
