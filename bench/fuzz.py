"""Fuzz every listening port of a live run, then check that the run shrugged it off.

    python bench/fuzz.py --json bench/results/fuzz.json [--quick] [--frames N]

Starts `earl-stream up` (the embedded default, run until stopped) in a temp directory, waits for a
few training steps, and reads from `status` every port the run listens on: the supervisor's control
socket (ZMQ) and metrics, each worker's shard node (the data plane, TCP) and metrics, each rollout
worker's OpenAI-compatible endpoint, and attached environment servers. To each it sends N frames
(default 10,000; --quick 1,000) drawn from a seeded mix, as an attacker without the cluster secret can:
  zmq (supervisor, environment servers): random bytes, signed frames (made with the run's secret, as
  captured traffic) truncated, bit-flipped or replayed verbatim, valid messages of the wrong type,
  oversized frames, and raw bytes that are not ZMTP at all;
  shard nodes: random bytes, frames with a bad magic, absurd header/payload lengths, truncated frames,
  authentication proofs with a wrong MAC, pulls before authentication;
  HTTP (metrics, OpenAI endpoint): random bytes, huge headers, unknown paths, malformed JSON bodies,
  missing or wrong bearer tokens.
Then it checks that every process of the run is alive (none crashed, `up` still runs), that the run
still trains (the policy version advances after the fuzzing), and that the ledger adds up (produced =
consumed + lost + stale + filtered + waiting + claimed, no duplicates). JSON keys: `frames_sent`,
`crashes`, `ports`, `run_still_trains` (and the per-port counts, the ledger, the refusals counted).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import socket
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from live_up import LiveUp  # noqa: E402  (bench/, beside this script)

from bench.provenance import write_result  # noqa: E402
from earl_stream import protocol as P  # noqa: E402
from earl_stream.security.secret import sign  # noqa: E402
from earl_stream.store import wire  # noqa: E402

REPLY_WAIT_S = 0.02  # how long the fuzzer waits for an answer to a frame (it does not need one)
OVERSIZED = 24 << 20  # bytes of an oversized frame, above the supervisor's 16 MiB limit (a few per port)


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.split("://", 1)[-1].split("/", 1)[0].rpartition(":")
    return host or "127.0.0.1", int(port)


def _raw(address: str, data: bytes) -> None:
    """One TCP connection: send `data`, half-close, take whatever comes back within a moment, close."""
    try:
        with socket.create_connection(_host_port(address), timeout=2) as s:
            s.settimeout(REPLY_WAIT_S)
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
            try:
                s.recv(4096)
            except OSError:
                pass
    except OSError:
        pass  # refused or reset: the port dropped us, which is fine


def fuzz_zmq(address: str, n: int, rng: random.Random, secret: bytes | None) -> int:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.connect(address)
    legit = [P.encode(m) for m in (P.StatusRequest(), P.Heartbeat(worker_id="rollout-0"), P.EnvList())]
    captured = sign(secret, legit[0])
    sent = 0
    for i in range(n):
        kind = rng.randrange(6)
        if i % max(1, n // 4) == 0:  # four per port
            sock.send_multipart([b"", rng.randbytes(OVERSIZED)])
            sent += 1
            continue
        if kind == 0:
            frame = rng.randbytes(rng.randrange(0, 2048))
        elif kind == 1:
            frame = sign(secret, rng.choice(legit))[: rng.randrange(0, 60)]
        elif kind == 2:
            flipped = bytearray(sign(secret, rng.choice(legit)))
            flipped[rng.randrange(len(flipped))] ^= 1 << rng.randrange(8)
            frame = bytes(flipped)
        elif kind == 3:
            frame = captured  # a replay of captured traffic
        elif kind == 4:  # well-formed msgpack of a reply type, unsigned: refused before decoding
            frame = P.encode(P.Claimed(step=rng.randrange(1 << 30), ready=True, table_ipc=rng.randbytes(64)))
        else:
            frames = [rng.randbytes(rng.randrange(0, 64)) for _ in range(rng.randrange(0, 5))]
            sock.send_multipart(frames or [b""])
            sent += 1
            continue
        sock.send_multipart([b"", frame])
        sent += 1
        while sock.poll(0):
            sock.recv_multipart()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and sock.poll(200):
        sock.recv_multipart()
    sock.close(0)
    for _ in range(max(1, n // 100)):  # not ZMTP at all
        _raw(address, rng.randbytes(rng.randrange(1, 512)))
        sent += 1
    return sent


def fuzz_shard_node(address: str, n: int, rng: random.Random) -> int:
    sent = 0
    per_conn = 20
    while sent < n:
        try:
            s = socket.create_connection(_host_port(address), timeout=2)
        except OSError:
            time.sleep(0.05)
            sent += 1
            continue
        with s:
            s.settimeout(REPLY_WAIT_S)
            for _ in range(min(per_conn, n - sent)):
                kind = rng.randrange(6)
                if kind == 0:
                    data = rng.randbytes(rng.randrange(1, 1024))
                elif kind == 1:
                    data = wire.PREFIX.pack(b"XXXX", wire.PROTOCOL_VERSION, 2, 10, 0) + rng.randbytes(10)
                elif kind == 2:  # absurd lengths: must be refused, never allocated
                    data = wire.PREFIX.pack(wire.MAGIC, wire.PROTOCOL_VERSION, rng.randrange(1 << 16), (1 << 32) - 1,
                                            (1 << 64) - 1)
                elif kind == 3:
                    data = wire.encode_frame(wire.Hello(rng.randbytes(32)))  # a wrong MAC
                elif kind == 4:
                    data = wire.encode_frame(wire.PullRequest([]))[: rng.randrange(1, 12)]  # truncated
                else:
                    data = wire.encode_frame(wire.ManifestRequest("w"))  # before authenticating
                sent += 1
                try:
                    s.sendall(data)
                    if not s.recv(65536):
                        break  # the node closed this connection: open another
                except TimeoutError:
                    continue  # no answer (it waits for the rest of a frame): send the next
                except OSError:
                    break  # reset: open another
    return sent


def fuzz_http(address: str, n: int, rng: random.Random, paths: list[str]) -> int:
    sent = 0
    for _ in range(n):
        kind = rng.randrange(5)
        path = rng.choice(paths)
        if kind == 0:
            data = rng.randbytes(rng.randrange(1, 1024))
        elif kind == 1:
            data = f"GET {path} HTTP/1.1\r\nHost: x\r\nX-Big: {'a' * rng.randrange(10_000, 100_000)}\r\n\r\n".encode()
        elif kind == 2:
            data = f"GET /{rng.randbytes(8).hex()} HTTP/1.1\r\nHost: x\r\n\r\n".encode()
        elif kind == 3:
            body = rng.choice([b"{", b"[]", b'{"model": 1, "messages": "x"}', rng.randbytes(200),
                               b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1000000000}'])
            auth = rng.choice(["", "Authorization: Bearer wrong\r\n"])
            data = (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{auth}"
                    f"Content-Length: {len(body)}\r\n\r\n").encode() + body
        else:
            data = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999\r\n\r\n{{".encode()  # a lying length
        _raw(address, data)
        sent += 1
    return sent


def ports_of(status: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(name, kind, address) of every port the run listens on."""
    ports = [("supervisor", "zmq", status["address"]), ("supervisor metrics", "http", status["metrics_address"])]
    for w in status["workers"]:
        if not w["alive"]:
            continue
        if w.get("shard_address"):
            ports.append((f"{w['id']} shard node", "shard", w["shard_address"]))
        if w.get("metrics_address"):
            ports.append((f"{w['id']} metrics", "http", w["metrics_address"]))
        if w.get("openai_url"):
            ports.append((f"{w['id']} openai", "openai", w["openai_url"]))
    for name, env in status.get("envs", {}).items():
        address = (env.get("params") or {}).get("address")
        if address:
            ports.append((f"environment server {name}", "zmq", address))
    return ports


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--quick", action="store_true", help="1,000 frames per port")
    ap.add_argument("--frames", type=int, default=10_000, help="frames per port (default 10,000)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="overrides for the run (`up`)")
    args = ap.parse_args()
    n = 1000 if args.quick else args.frames
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="earl-fuzz-") as tmp:
        run = Path(tmp) / "run"
        up = LiveUp(run, "--steps", "0", *args.overrides, log=Path(tmp) / "up.log")
        secret = up.secret
        try:
            before = up.wait("two training steps", lambda: (s := up.status()) and s["policy_version"] >= 2 and s, 300)
            ports = ports_of(before)
            pids = {w["id"]: w["pid"] for w in before["workers"] if w["alive"]}
            counts: dict[str, int] = {}
            started = time.monotonic()
            for name, kind, address in ports:
                if kind == "zmq":
                    counts[name] = fuzz_zmq(address, n, rng, secret)
                elif kind == "shard":
                    counts[name] = fuzz_shard_node(address, n, rng)
                else:
                    paths = ["/v1/chat/completions", "/v1/completions", "/v1/models"] if kind == "openai" else ["/metrics"]
                    base = address.split("://", 1)[-1].split("/", 1)[0]
                    counts[name] = fuzz_http(base, n, rng, paths)
                print(f"fuzz: {counts[name]} frames to {name} ({address}) at {time.monotonic() - started:.0f}s", flush=True)
            fuzz_s = time.monotonic() - started
            refused = _refusals(before["metrics_address"])
            at = up.wait("the status after fuzzing", up.status, 60)["policy_version"]
            after = up.wait("the run to train two more steps",
                            lambda: (s := up.status()) and s["policy_version"] >= at + 2 and s, 180)
            still_trains = after["policy_version"] >= at + 2
            dead = [wid for wid, pid in pids.items() if not _alive_pid(pid)]
            if up.proc.poll() is not None:
                dead.append("up")
        finally:
            up.stop()
        s = after
        produced = s["samples_produced"]
        accounted = (s["samples_consumed"] + s["samples_lost"] + s["samples_stale"] + s.get("samples_filtered", 0)
                     + s["samples_in_store"] + s["samples_claimed"])
    result = {
        "frames_sent": sum(counts.values()), "frames_per_port": counts, "ports": len(ports),
        "port_kinds": sorted({k for _, k, _ in ports}), "crashes": len(dead), "crashed": dead,
        "run_still_trains": still_trains, "policy_version_before": at, "policy_version_after": after["policy_version"],
        "ledger_adds_up": produced == accounted and s["duplicates_detected"] == 0,
        "ledger": {k: s[k] for k in ("samples_produced", "samples_consumed", "samples_lost", "samples_stale",
                                     "samples_in_store", "samples_claimed", "duplicates_detected")},
        "supervisor_refused": refused,
        "fuzz_seconds": round(fuzz_s, 1), "seed": args.seed, "frames_per_port_asked": n,
    }
    print(json.dumps(result, indent=1))
    if args.json:
        write_result(Path(args.json), result, indent=1)
    return 0 if not dead and still_trains and result["ledger_adds_up"] else 1


def _refusals(metrics: str) -> dict[str, float]:
    """The supervisor's count of refused control messages by reason (earl_security_refused_total)."""
    text = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10).read().decode()
    return {m[0]: float(m[1]) for m in re.findall(r'earl_security_refused_total\{plane="control",reason="(\w+)"\} (\S+)', text)}


def _alive_pid(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


if __name__ == "__main__":
    raise SystemExit(main())
