"""A live run driven through the CLI a user types: attaching and detaching environments, and reading
finished episodes back as transcripts and as Parquet."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from cluster import Cluster, wait_for

pytestmark = pytest.mark.slow

BROKEN_ENV = '''
raise RuntimeError("this environment cannot even be imported")
'''


def _cli(cluster: Cluster, *args: str, command: str = "env") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "earl_stream", command, *args, "--supervisor", cluster.address],
                          env=cluster.env, capture_output=True, text=True, timeout=120)


@pytest.mark.live
def test_attach_and_detach_on_a_live_run(tmp_path: Path, tiny_model_dir: Path) -> None:
    cluster = Cluster(tmp_path, tiny_model_dir, "steps=0")
    try:
        cluster.start_supervisor()
        cluster.worker("rollout", "rollout")
        cluster.worker("trainer", "trainer")
        wait_for(lambda: cluster.status()["policy_version"] >= 2, 180, "training to start")
        out = _cli(cluster, "attach", "connect_four", "--weight", "3", "--group-seed", "shared")
        assert out.returncode == 0, out.stderr
        assert "connect_four" in out.stdout and "group seed shared" in out.stdout
        s = wait_for(lambda: (st := cluster.status())["envs"].get("connect_four", {}).get("episodes", 0) >= 4 and st,
                     120, "connect_four episodes in the status")
        assert s["envs"]["tictactoe"]["episodes"] > 0
        # each environment's own outcome rates over the window (the game's win rate apart from the other's)
        for name in ("tictactoe", "connect_four"):
            rates = s["envs"][name]["outcomes"]
            assert rates and set(rates) <= {"win", "draw", "loss", "illegal"} and sum(rates.values()) == pytest.approx(1, abs=1e-3)

        bad = tmp_path / "broken.py"
        bad.write_text(BROKEN_ENV)
        out = _cli(cluster, "attach", f"{bad}:Broken", "--name", "broken")
        assert out.returncode != 0 and "could not load" in out.stderr and "Traceback" not in out.stderr
        assert "cannot even be imported" in out.stdout
        out = _cli(cluster, "attach", "connect_four")
        assert out.returncode != 0 and "already attached" in out.stderr

        out = _cli(cluster, "detach", "connect_four")
        assert out.returncode == 0, out.stderr
        before = cluster.status()["policy_version"]
        wait_for(lambda: cluster.status()["policy_version"] >= before + 3, 180, "training to go on")
        listing = _cli(cluster, "list")
        assert "detached" in listing.stdout and "FAILED" in listing.stdout

        tail = _cli(cluster, "tail", "--last", "3", command="episodes")
        assert tail.returncode == 0, tail.stderr
        assert tail.stdout.count("=== ") == 3 and "<|assistant|>" in tail.stdout
        out = _cli(cluster, "export", str(tmp_path / "episodes.parquet"), command="episodes")
        assert out.returncode == 0, out.stderr
        table = pq.read_table(tmp_path / "episodes.parquet")
        assert table.num_rows > 10 and {"sample_id", "reward", "env", "transcript"} <= set(table.column_names)
        assert sum(t is not None for t in table.column("transcript").to_pylist()) > 10
    finally:
        cluster.stop()
