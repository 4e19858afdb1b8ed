"""An environment file attached to a live run: its module's top-level code runs only in the rollout
worker's sandboxed child, never in the worker, and its episodes train; a file that cannot be imported fails
`env attach` with what the import said, and the run goes on."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from cluster import REPLY_LENGTH_ENV, Cluster, wait_for

from earl_stream.sandbox import bwrap_problem
from earl_stream.security.secret import SECRET_ENV

pytestmark = [pytest.mark.slow, pytest.mark.live]

MODE = "bwrap" if bwrap_problem() is None else "process"

# what the module's top level saw, appended to a file of the worker's filesystem (where it can write)
SPY_TOP = '''
import json, os

SEEN = {"pid": os.getpid(), "secret_var": "SECRET_VAR" in os.environ}
try:
    SEEN["secret"] = open("SECRET_FILE").read()
except OSError:
    SEEN["secret"] = None
try:
    with open("MARKER", "a") as f:
        f.write(json.dumps(SEEN) + "\\n")
except OSError:
    pass
'''


def _attach(cluster: Cluster, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "earl_stream", "env", "attach", *args, "--supervisor",
                           cluster.address], env=cluster.env, capture_output=True, text=True, timeout=120)


def test_an_attached_file_runs_its_top_level_only_in_the_sandbox(tmp_path: Path, tiny_model_dir: Path) -> None:
    cluster = Cluster(tmp_path, tiny_model_dir, "steps=0", f"sandbox.mode={MODE}")
    marker = tmp_path / "marker"
    top = SPY_TOP.replace("SECRET_VAR", SECRET_ENV).replace("SECRET_FILE", str(cluster.secret_file))
    (tmp_path / "spy.py").write_text(top.replace("MARKER", str(marker)) + REPLY_LENGTH_ENV)
    (tmp_path / "broken.py").write_text('raise RuntimeError("this environment cannot even be imported")\n')
    try:
        cluster.start_supervisor()
        worker = cluster.worker("rollout", "rollout")
        cluster.worker("trainer", "trainer")
        wait_for(lambda: cluster.status()["policy_version"] >= 2, 180, "training to start")
        out = _attach(cluster, f"{tmp_path}/broken.py:Broken", "--name", "broken")
        assert out.returncode != 0 and "could not load" in out.stderr, out.stderr
        assert "broken.py failed to import: RuntimeError: this environment cannot even be imported" in out.stdout
        out = _attach(cluster, f"{tmp_path}/spy.py:ReplyLength", "--name", "spy", "--weight", "3")
        assert out.returncode == 0, out.stderr
        before = cluster.status()["policy_version"]
        wait_for(lambda: cluster.status()["envs"].get("spy", {}).get("episodes", 0) >= 4, 120, "the file's episodes")
        wait_for(lambda: cluster.status()["policy_version"] >= before + 3, 180, "training to go on")
        assert worker.poll() is None
    finally:
        cluster.stop()
    seen = [json.loads(line) for line in marker.read_text().splitlines()] if marker.exists() else []
    if MODE == "bwrap":  # its episodes ran, yet its top level left no trace: it ran where the worker's files are not
        assert seen == []
    else:  # in the child, which holds no secret's variable (its files are this host's: process mode)
        assert seen and all(s["pid"] != worker.pid and not s["secret_var"] for s in seen), seen
