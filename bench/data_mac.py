"""The cost of authenticated and encrypted data-plane frames: TCP pulls open, with MACs, and encrypted.

    python bench/data_mac.py --json bench/results/data_mac.json [--quick]

One ShardNode and one ShardClient in this process (transport tcp, so the bytes cross the socket), a
int32 tensor of each size; per size, open (no secret: crc32 only) and authenticated (secret: every frame
after the handshake carries a Poly1305 tag, store/frame_mac.py) and encrypted (security.encrypt: the
frames also ChaCha20-encrypted under that tag, earl_stream/security/encryption.py) pulls alternate, --reps each,
and the medians and their ratios to open are reported. One host: the socket costs a memory copy, so the ratio is an upper
bound of what the MAC adds where a network link is the bottleneck.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.provenance import write_result  # noqa: E402
from earl_stream.store import ShardClient, ShardNode  # noqa: E402

SECRET = b"bench-secret-0123456789abcdef"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--quick", action="store_true", help="1 and 16 MiB, 3 repetitions")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    sizes = [1, 16] if args.quick else [1, 16, 64, 256]
    reps = 3 if args.quick else args.reps
    rows = []
    for mib in sizes:
        data = np.random.default_rng(mib).integers(0, 1 << 30, size=(mib << 20) // 4, dtype=np.int32)
        times: dict[str, list[float]] = {"open": [], "mac": [], "encrypted": []}
        with ShardNode(encrypt=False) as open_node, ShardNode(secret=SECRET, encrypt=False) as mac_node, \
                ShardNode(secret=SECRET, encrypt=True) as sealed_node, \
                ShardClient(transport="tcp", timeout_s=120, encrypt=False) as open_client, \
                ShardClient(secret=SECRET, transport="tcp", timeout_s=120, encrypt=False) as mac_client, \
                ShardClient(secret=SECRET, transport="tcp", timeout_s=120, encrypt=True) as sealed_client:
            pairs = {"open": (open_node, open_client), "mac": (mac_node, mac_client),
                     "encrypted": (sealed_node, sealed_client)}
            for node, client in pairs.values():
                node.put("k", data)
                client.pull(node.address, [("k", 0, 16)])  # connect and handshake outside the timing
            for _ in range(reps):
                for name, (node, client) in pairs.items():
                    started = time.perf_counter()
                    (got,) = client.pull(node.address, [("k", 0, len(data))])
                    times[name].append(time.perf_counter() - started)
                    assert got[-1] == data[-1]
        med = {k: statistics.median(v) for k, v in times.items()}
        row = {"mib": mib, "open_s": round(med["open"], 4), "mac_s": round(med["mac"], 4),
               "mac_over_open": round(med["mac"] / med["open"], 2),
               "mac_gb_per_s": round((mib << 20) / med["mac"] / 1e9, 2), "encrypted_s": round(med["encrypted"], 4),
               "encrypted_over_open": round(med["encrypted"] / med["open"], 2),
               "encrypted_gb_per_s": round((mib << 20) / med["encrypted"] / 1e9, 2)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    result = {"rows": rows, "worst_mac_over_open": max(r["mac_over_open"] for r in rows),
              "best_mac_over_open": min(r["mac_over_open"] for r in rows),
              "worst_encrypted_over_open": max(r["encrypted_over_open"] for r in rows),
              "best_encrypted_over_open": min(r["encrypted_over_open"] for r in rows), "reps": reps}
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}))
    if args.json:
        write_result(Path(args.json), result, indent=1)


if __name__ == "__main__":
    main()
