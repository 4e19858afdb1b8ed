"""After a pool re-formed its process group (`workers.pool_abort`), `sharding.rebind` puts an FSDP2- or
tensor-parallel-sharded model and its AdamW state on the new group's meshes, each shard where it was: two
real processes (gloo) fail to allocate in the same step, re-form, re-bind; the full model and optimizer state
gathered over the new mesh equal those before the failure, and the next step trains exactly as in a pool that never failed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

RANK_SCRIPT = Path(__file__).with_name("pool_rebind_rank.py")


@pytest.mark.parametrize("plan", ["fsdp2", "tp2"])
def test_a_sharded_model_is_rebound_to_the_reformed_group(tmp_path: Path, plan: str) -> None:
    init = f"file://{tmp_path / 'rendezvous'}"
    procs = [subprocess.Popen([sys.executable, str(RANK_SCRIPT), str(r), init, plan, str(tmp_path)]) for r in range(2)]
    assert [p.wait(timeout=180) for p in procs] == [0, 0]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in ranks:
        assert r["same"] and r["keys"] > 0, r  # parameters and optimizer state, whole, unchanged
        assert r["next_same"], r  # the next step trains as in a pool that never failed
