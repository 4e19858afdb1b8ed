"""`StopFlag` (workers/common.py) in a real process: the first SIGTERM/SIGINT lets the worker finish what it
does; the same stop reaching it twice at once (Slurm signals every process of a step, and the pool process
or torchrun above a trainer rank passes it on) is still one stop; a second signal later stops it at once."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from earl_stream.workers.common import SAME_STOP_S

# a worker whose step in progress takes argv[1] seconds to finish once it is told to stop
WORKER = """
import sys, time
from earl_stream.workers.common import StopFlag

flag = StopFlag(stopping="finishing the step in progress")
print("ready", flush=True)
while not flag:
    time.sleep(0.01)
time.sleep(float(sys.argv[1]))
print("finished", flush=True)
"""


def _worker(step_s: float) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", WORKER, str(step_s)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def test_the_same_stop_twice_at_once_lets_the_step_finish() -> None:
    proc = _worker(1.0)
    proc.send_signal(signal.SIGINT)  # from Slurm
    time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)  # passed on by the pool process
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0 and out.strip() == "finished", (proc.returncode, out)


def test_a_second_signal_later_stops_at_once() -> None:
    proc = _worker(60.0)
    proc.send_signal(signal.SIGTERM)
    time.sleep(SAME_STOP_S + 0.5)
    assert proc.poll() is None  # finishing its step
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM and time.monotonic() - started < 5
