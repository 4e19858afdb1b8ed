"""A live `earl-stream up` for the benchmarks that act on a running run (fuzz, chaos, context_growth).

`LiveUp(run_dir, *up_args)` starts `up` in its own process group with a cluster secret written to
RUN_DIR/secret beforehand; `status()` is the supervisor's status (None while it is not up or does not
answer, e.g. being restarted); `wait(what, cond, timeout)` polls a condition; `stop()` is Ctrl-C to the
group (`up` stops every process and writes its summary), then SIGKILL after a minute.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from earl_stream import protocol as P  # noqa: E402
from earl_stream.errors import EarlError  # noqa: E402
from earl_stream.security.secret import SECRET_ENV, create_secret_file, load_secret  # noqa: E402


def stop_on_sigterm() -> None:
    """SIGTERM raises SystemExit in the main thread, so that `finally` blocks stop the `up` runs they started
    (each in a session of its own: a killed benchmark would otherwise leave its run training)."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


class LiveUp:
    def __init__(self, run_dir: Path, *up_args: str, log: Path) -> None:
        self.run_dir = run_dir
        self.ready = run_dir / "supervisor.json"
        self.ready.unlink(missing_ok=True)
        self.secret_file = create_secret_file(run_dir / "secret")
        self.secret = load_secret(str(self.secret_file))
        self.log = log
        self.proc = subprocess.Popen([sys.executable, "-m", "earl_stream", "up", *up_args, f"run_dir={run_dir}"],
                                     stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, SECRET_ENV: str(self.secret_file)})

    def status(self, timeout_s: float = 10) -> dict[str, Any] | None:
        try:
            client = P.ControlClient(json.loads(self.ready.read_text())["address"], timeout_s=timeout_s,
                                     secret=self.secret)
        except (OSError, ValueError, KeyError):
            return None
        try:
            return json.loads(client.call(P.StatusRequest()).status_json)
        except EarlError:
            return None
        finally:
            client.close()

    def wait(self, what: str, cond: Any, timeout: float) -> Any:
        """Poll `cond()` until it is truthy; SystemExit naming `what` if `up` exits or time runs out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"earl-stream up exited ({self.proc.returncode}) waiting for {what}: see {self.log}")
            value = cond()
            if value:
                return value
            time.sleep(0.5)
        raise SystemExit(f"timed out after {timeout:.0f}s waiting for {what}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
