"""A shard node in its own process (`python -c`), for tests that pull across processes: UCX between two
processes (the real case), and a node killed while pulls from it run.

The node holds the same arrays every time: "k" int32 0..3,000,000; "m" uint8 0..6; "bad" float64
0..999 with one byte flipped at rest (its checksum no longer matches); and, with `big_mib`, "big", a
uint8 array of that many MiB. It prints its address and serves until its stdin closes.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

_SCRIPT = """
import json, sys
import numpy as np
from earl_stream.store import ShardNode
spec = json.loads(sys.argv[1])
secret = bytes.fromhex(spec["secret"]) if spec["secret"] else None
with ShardNode(shm=spec["shm"], ucx=spec["ucx"], secret=secret, frame_timeout_s=10.0) as node:
    node.put("k", np.arange(3_000_000, dtype=np.int32))
    node.put("m", np.arange(7, dtype=np.uint8))
    node.put("bad", np.arange(1000, dtype=np.float64))
    node._corrupt_for_test("bad", 17)
    if spec["big_mib"]:
        node.put("big", np.full(spec["big_mib"] << 20, 7, dtype=np.uint8))
    print(node.address, flush=True)
    sys.stdin.read()
"""


class NodeProcess:
    def __init__(self, log_dir: Path, *, shm: bool, ucx: bool, secret: bytes | None = None, big_mib: int = 0) -> None:
        self.spec = {"shm": shm, "ucx": ucx, "secret": secret.hex() if secret else "", "big_mib": big_mib}
        self.log = log_dir / "node.log"
        self.proc: subprocess.Popen[str] | None = None
        self.address = ""

    def __enter__(self) -> NodeProcess:
        with self.log.open("w") as err:
            self.proc = subprocess.Popen([sys.executable, "-c", _SCRIPT, json.dumps(self.spec)], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=err, text=True, env={**os.environ})
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], 120)
        line = self.proc.stdout.readline().strip() if ready else ""
        if not line:
            self.proc.kill()
            raise AssertionError(f"the shard node process did not start: {self.log.read_text()[-2000:]}")
        self.address = line
        return self

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def __exit__(self, *exc: object) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
