"""The control plane under load: one real supervisor process, the control traffic of many workers.

    python bench/supervisor_load.py --json bench/results/supervisor_load.json [--quick]

A real `earl-stream supervisor` (cluster secret on, write-ahead state in a temp directory on this
disk) is driven open-loop by a load generator that speaks for W simulated rollout workers and one
trainer over signed messages, as the real workers do: per rollout worker and second (assumed rates,
stated in the JSON) HEARTBEAT_HZ heartbeats, GROUP_HZ prompt requests and GROUP_HZ metadata puts of
GROUP_SIZE rows each (a group every 1/GROUP_HZ seconds: long multi-turn episodes); the trainer claims
GROUPS_PER_STEP groups as soon as they are ready, releases them and publishes a version. The offered
rate rises phase by phase (W = rate / messages per worker-second) until the supervisor no longer keeps
up. Per phase: offered and answered messages/s, p50/p99 reply latency, and write-ahead bytes and fsyncs
per message (the supervisor's own counters, earl_supervisor_state_*). `max_messages_per_s`: the best
rate answered while keeping up (>= 95% of offered, p99 < 1 s); `p99_latency_ms_at_1000_workers`: p99
in the phase at the traffic of 1,000 workers. `snapshot_bytes`: the size of the whole state at the
end, which is what the supervisor wrote per state-changing message before the log (a full rewrite).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.provenance import write_result  # noqa: E402
from earl_stream import protocol as P  # noqa: E402
from earl_stream.security.secret import create_secret_file, load_secret, sign, verify  # noqa: E402
from earl_stream.store.schema import SCHEMA_VERSION, SampleMeta  # noqa: E402

HEARTBEAT_HZ = 1.0  # heartbeats per rollout worker and second (supervisor.heartbeat_s = 1)
GROUP_HZ = 0.1  # groups per rollout worker and second: a request and a metadata put each
GROUP_SIZE = 8
GROUPS_PER_STEP = 256
PER_WORKER_HZ = HEARTBEAT_HZ + 2 * GROUP_HZ


def _rows(prompt: P.Prompt, worker: str, version: int) -> list[SampleMeta]:
    return [SampleMeta(schema_version=SCHEMA_VERSION, sample_id=f"{prompt.group_id}-{i}", prompt_ordinal=prompt.prompt_ordinal,
                       episode_id=str(i), group_id=prompt.group_id, env=prompt.env, turns=4, prompt_tokens=200,
                       response_tokens=600, total_tokens=800, reward=float(i % 2), advantage=None,
                       policy_version_min=version, policy_version_max=version, producer_id=worker,
                       producer_address=f"10.0.{hash(worker) % 250}.1:7000", checksum=i, created_at=time.time(),
                       info_json="{}")
            for i in range(prompt.group_size)]


class Load:
    """Open-loop traffic over one DEALER socket: replies come back in order, so latency pairs up FIFO."""

    def __init__(self, address: str, secret: bytes | None) -> None:
        self.address, self.secret = address, secret
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.connect(address)
        self.sent: deque[tuple[float, str, str]] = deque()  # send time, kind, worker
        self.latencies: list[float] = []
        self.answered = 0
        self.version = 0
        self.held: dict[str, list[P.Prompt]] = {}  # worker -> prompts it holds (to put their rows)
        self.lock = threading.Lock()
        self.stop = False

    def call(self, msg: P.Msg) -> Any:
        """One synchronous call (setup only, before the receiver runs)."""
        self.sock.send_multipart([b"", sign(self.secret, P.encode(msg))])
        if not self.sock.poll(30_000):
            raise RuntimeError(f"no reply to {type(msg).__name__}")
        return P.decode(verify(self.secret, self.sock.recv_multipart()[-1]) or b"")

    def send(self, msg: P.Msg, kind: str, worker: str = "") -> None:
        with self.lock:
            self.sent.append((time.perf_counter(), kind, worker))
            self.sock.send_multipart([b"", sign(self.secret, P.encode(msg))])

    def receive(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not self.stop or self.sent:
            if not poller.poll(200):
                continue
            frames = self.sock.recv_multipart()
            now = time.perf_counter()
            with self.lock:
                at, kind, worker = self.sent.popleft()
            self.latencies.append(now - at)
            self.answered += 1
            reply = P.decode(verify(self.secret, frames[-1]) or b"")
            if kind == "request" and isinstance(reply, P.Prompts) and reply.prompts:
                self.held.setdefault(worker, []).extend(reply.prompts)
            elif kind == "claim" and isinstance(reply, P.Claimed) and reply.ready:
                self.claimed_step = reply.step

    claimed_step = -1


def _metric(metrics: str, name: str, label: str = "") -> float:
    text = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10).read().decode()
    pattern = rf"^{name}{{{label}}} (\S+)$" if label else rf"^{name} (\S+)$"
    return sum(float(v) for v in re.findall(pattern, text, re.M))


def _phase(load: Load, workers: list[str], trainer: str, rate: float, seconds: float, metrics: str) -> dict[str, Any]:
    before = {k: _metric(metrics, *k) for k in (("earl_supervisor_state_bytes_total", 'kind="log"'),
                                              ("earl_supervisor_state_bytes_total", 'kind="snapshot"'),
                                              ("earl_supervisor_state_fsyncs_total", ""))}
    load.latencies.clear()
    answered0 = load.answered
    n = len(workers)
    # the per-worker schedule, spread evenly over each second: heartbeat always, group traffic 1 in 10
    period = 1.0 / rate
    start = time.perf_counter()
    sent = 0
    step = load.claimed_step + 1
    next_claim = start
    releases = 0
    i = 0
    while (now := time.perf_counter()) - start < seconds:
        due = int((now - start) / period) + 1
        while sent < due:
            w = workers[i % n]
            i += 1
            roll = (i // n) % 10  # the 1-in-10 "seconds" of this worker that carry its group traffic
            held = load.held.get(w)
            if held and roll == (hash(w) % 10):
                prompt = held.pop(0)
                load.send(P.PutMeta(worker_id=w, rows=_rows(prompt, w, load.version)), "put", w)
            elif not held and roll == (hash(w) % 10):
                load.send(P.RequestPrompts(worker_id=w, max_groups=1, request_id=f"{w}-{i}"), "request", w)
            else:
                load.send(P.Heartbeat(worker_id=w, stats={"episodes": float(i)}), "heartbeat", w)
            sent += 1
        if now >= next_claim:  # the trainer: claim the next step, release and publish the one claimed
            if load.claimed_step >= step:
                load.send(P.Release(worker_id=trainer, step=step, checkpointed=True), "release")
                load.version = step + 1
                releases += 1
                load.send(P.PublishVersion(worker_id=trainer, version=load.version), "publish")
                step += 1
            load.send(P.Claim(worker_id=trainer, step=step, num_groups=GROUPS_PER_STEP,
                              min_policy_version=max(0, step - 1)), "claim")
            next_claim = now + 0.2
        time.sleep(max(0.0, min(period * 50, start + (sent + 1) * period - time.perf_counter())))
    wall = time.perf_counter() - start
    drain_until = time.monotonic() + 10
    while load.sent and time.monotonic() < drain_until:
        time.sleep(0.05)
    elapsed = time.perf_counter() - start  # until the last reply of the phase (or the drain gave up)
    answered = load.answered - answered0
    lat = np.array(load.latencies) * 1000 if load.latencies else np.array([float("nan")])
    after = {k: _metric(metrics, *k) for k in before}
    log_bytes, snap_bytes, fsyncs = (after[k] - before[k] for k in before)
    return {"workers": n, "offered_messages_per_s": round(sent / wall, 1),
            "answered_messages_per_s": round(answered / elapsed, 1),
            "answered_fraction": round(answered / max(sent, 1), 3), "unanswered": len(load.sent),
            "p50_latency_ms": round(float(np.percentile(lat, 50)), 2), "p99_latency_ms": round(float(np.percentile(lat, 99)), 2),
            "state_log_bytes_per_message": round(log_bytes / max(answered, 1), 1),
            "state_snapshot_bytes_per_message": round(snap_bytes / max(answered, 1), 1),
            "fsyncs_per_message": round(fsyncs / max(answered, 1), 4), "steps_released": releases}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--quick", action="store_true", help="three short phases (250, 1,000 and 2,000 workers)")
    ap.add_argument("--seconds", type=float, default=10.0, help="length of each phase")
    args = ap.parse_args()
    worker_counts = [250, 1000, 2000] if args.quick else [250, 500, 1000, 2000, 4000, 8000]
    seconds = 5.0 if args.quick else args.seconds
    with tempfile.TemporaryDirectory(prefix="earl-supload-", dir=os.environ.get("BENCH_STATE_DIR")) as tmp:
        secret_file = create_secret_file(Path(tmp) / "secret")
        ready = Path(tmp) / "ready.json"
        cmd = [sys.executable, "-m", "earl_stream", "supervisor", "--bind", "127.0.0.1:0", "--ready-file", str(ready),
               "--state-dir", str(Path(tmp) / "state"), "model.path=/nonexistent", f"run_dir={tmp}/run",
               f"trainer.groups_per_step={GROUPS_PER_STEP}", f"trainer.group_size={GROUP_SIZE}", "trainer.max_staleness=64",
               "supervisor.lease_s=600", "selector.enabled=false"]
        sup = subprocess.Popen(cmd, env={**os.environ, "EARL_STREAM_SECRET_FILE": str(secret_file)},
                               stdout=open(Path(tmp) / "supervisor.log", "wb"), stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 60
            while not ready.exists():
                if sup.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("the supervisor did not start:\n" + (Path(tmp) / "supervisor.log").read_text()[-3000:])
                time.sleep(0.1)
            info = json.loads(ready.read_text())
            load = Load(info["address"], load_secret(str(secret_file)))
            trainer = load.call(P.Register(role=P.Role.TRAINER, rank=0)).worker_id
            workers = [load.call(P.Register(role=P.Role.ROLLOUT, shard_address=f"10.0.{i % 250}.1:7000")).worker_id
                       for i in range(max(worker_counts))]
            receiver = threading.Thread(target=load.receive, daemon=True)
            receiver.start()
            phases = []
            for count in worker_counts:
                phase = _phase(load, workers[:count], trainer, count * PER_WORKER_HZ, seconds, info["metrics_address"])
                print(json.dumps(phase), flush=True)
                phases.append(phase)
                if phase["answered_fraction"] < 0.5:
                    break  # far past saturation: larger phases say nothing more
            load.stop = True
            receiver.join(15)
            snapshot_bytes = (Path(tmp) / "state" / "supervisor.state").stat().st_size
        finally:
            sup.terminate()
            sup.wait(30)
    keeping_up = [p for p in phases if p["answered_fraction"] >= 0.95 and p["p99_latency_ms"] < 1000]
    at_1000 = next((p for p in phases if p["workers"] == 1000), None)
    result = {
        "assumed_rates": {"heartbeats_per_worker_s": HEARTBEAT_HZ, "groups_per_worker_s": GROUP_HZ,
                          "group_size": GROUP_SIZE, "groups_per_step": GROUPS_PER_STEP,
                          "messages_per_worker_s": PER_WORKER_HZ},
        "phases": phases,
        "max_messages_per_s": max((p["answered_messages_per_s"] for p in keeping_up), default=0.0),
        "p99_latency_ms_at_1000_workers": at_1000["p99_latency_ms"] if at_1000 else None,
        "snapshot_bytes": snapshot_bytes,
        "note": "snapshot_bytes is what each state-changing message wrote before the write-ahead log (a full "
                "rewrite of the state); state_log_bytes_per_message is what it writes now",
        "machine": f"{os.cpu_count()} cores; load generator and supervisor share them",
    }
    print(json.dumps({k: v for k, v in result.items() if k != "phases"}, indent=1))
    if args.json:
        write_result(Path(args.json), result, indent=1)


if __name__ == "__main__":
    main()
