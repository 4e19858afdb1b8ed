"""The Ray actor of the `ray` launcher: it holds one `earl-stream` process of the run on its Ray node.

The actor reserves the role's declared resources (launcher.ray.<role>.*) for as long as the process
runs, writes the key it was handed (the cluster secret for the supervisor, the worker key for workers) to
a private file on its node, and starts the same command `up` starts locally (a child that dies with the
actor, cli/procs.py). It adds EARL_STREAM_RAY_NODE_ID to the child's environment, which a worker reports when it registers. An
actor made with `exit_with_child` leaves when its process fails, so that Ray restarts it (the
`max_restarts` it was created with) and the new process re-registers: how a rollout worker rejoins.
Arguments may hold `{dir}` (the actor's private directory) and `{ip}` (its node's address).
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import tempfile
import threading
from pathlib import Path
from typing import Any

from earl_stream.cli.procs import STOP_GRACE_S, Child, ProcessGroup
from earl_stream.security.secret import SECRET_ENV

log = logging.getLogger(__name__)
RAY_NODE_ENV = "EARL_STREAM_RAY_NODE_ID"


class ProcessHost:
    def __init__(self, secret: bytes, files: dict[str, str], cwd: str, start: dict[str, Any] | None = None,
                 exit_with_child: bool = False, env: dict[str, str] | None = None) -> None:
        """`env`: added to the environment of every process this actor starts (e.g. whether it encrypts)."""
        import ray

        self.node_id = ray.get_runtime_context().get_node_id()
        self.ip = ray.util.get_node_ip_address()
        if os.path.isdir(cwd):  # the driver's directory, where relative run_dir paths point (a shared one)
            os.chdir(cwd)
        self.dir = Path(tempfile.mkdtemp(prefix="earl-stream-ray-"))
        fd = os.open(self.dir / "secret", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(secret)
        for name, text in files.items():
            (self.dir / name).write_text(text)
        self.group = ProcessGroup()
        self.child: Child | None = None
        self.stopping = False
        self.exit_with_child = exit_with_child
        self.env = dict(env or {})
        if start is not None:
            self.start(**start)

    def node(self) -> dict[str, str]:
        return {"node_id": self.node_id, "ip": self.ip, "hostname": socket.gethostname()}

    def free_port(self) -> int:
        with socket.socket() as s:
            s.bind((self.ip, 0))
            return int(s.getsockname()[1])

    def start(self, name: str, args: list[str], env: dict[str, str], log_path: str) -> int:
        args = [a.replace("{dir}", str(self.dir)).replace("{ip}", self.ip) for a in args]
        env = {**self.env, **env, SECRET_ENV: str(self.dir / "secret"), RAY_NODE_ENV: self.node_id}
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        self.child = self.group.start(name, args, env=env, log_path=log_path)
        if self.exit_with_child:
            threading.Thread(target=self._exit_with_child, args=(self.child,), daemon=True).start()
        return self.child.proc.pid

    def _exit_with_child(self, child: Child) -> None:
        code = child.proc.wait()
        if code != 0 and not self.stopping:
            log.warning("%s; leaving so that Ray restarts this actor", child.describe_exit().splitlines()[0])
            os._exit(1)

    def poll(self) -> int | None:
        code = self.child.poll() if self.child is not None else None
        if code not in (None, 0) and self.exit_with_child:
            return None  # this actor is leaving for Ray to restart it: not failed for good (yet)
        return code

    def describe_exit(self) -> str:
        what = self.child.describe_exit() if self.child is not None else "nothing started"
        first, _, rest = what.partition("\n")
        return f"{first} (on Ray node {self.node_id[:12]} at {self.ip})" + (f"\n{rest}" if rest else "")

    def read(self, name: str) -> str | None:
        path = self.dir / name
        return path.read_text() if path.exists() else None

    def restart(self, args: list[str] | None = None) -> None:
        assert self.child is not None
        if args is not None:
            args = [a.replace("{dir}", str(self.dir)).replace("{ip}", self.ip) for a in args]
        self.group.restart(self.child, args)

    def args(self) -> list[str]:
        return list(self.child.args) if self.child is not None else []

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM the process, SIGKILL it after `grace_s` (a trainer rank's: trainer.stop_grace_s)."""
        self.stopping = True
        self.group.stop(grace_s)
        shutil.rmtree(self.dir, ignore_errors=True)
