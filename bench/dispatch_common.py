"""Shared pieces of the dispatch benchmarks (bench/dispatch.py on one host, bench/dispatch_cluster.py
across simulated hosts): the per-token fields of a step and their deterministic content, the claim's
metadata, the producer process, and one consumer's delivery of its part of a step under a layout."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from earl_stream.store import (
    CentralClient,
    Layout,
    SampleMeta,
    ShardClient,
    ShardNode,
    partition,
    pull_samples,
    pull_samples_central,
    sample_key,
)

GIB = float(1 << 30)
FIELD_DTYPES: dict[str, Any] = {
    "input_ids": np.int32,
    "loss_mask": np.uint8,
    "behaviour_logprobs": np.float32,
    "advantages": np.float32,
}
FIELDS = list(FIELD_DTYPES)
EXTRA_DTYPES = {"advantages": np.dtype(np.float32)}  # not a TOKEN_FIELD of the records: declared to pull_samples
BYTES_PER_TOKEN = sum(np.dtype(d).itemsize for d in FIELD_DTYPES.values())
LAYOUTS = {"dp4": {"dp": 4, "tp": 1, "cp": 1}, "dp2_tp2": {"dp": 2, "tp": 2, "cp": 1}, "dp2_cp2": {"dp": 2, "tp": 1, "cp": 2}}
ROW_TOKENS = (4096, 28672)  # agentic contexts of 4K-28K tokens, uniform (mean 16K)


# --- data -------------------------------------------------------------------------------------------


def make_lengths(nbytes: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    lengths: list[int] = []
    while sum(lengths) * BYTES_PER_TOKEN < nbytes:
        lengths.append(int(rng.integers(ROW_TOKENS[0], ROW_TOKENS[1] + 1)))
    return lengths


def row_fields(row: int, n: int) -> dict[str, np.ndarray]:
    """Deterministic content of claim row `row` ([n] per field), so any process can check what it got."""
    t = np.arange(n, dtype=np.int64)
    return {
        "input_ids": ((t * 7 + row) % 50_000).astype(np.int32),
        "loss_mask": ((t + row) % 3 != 0).astype(np.uint8),
        "behaviour_logprobs": (-(t % 100) / 100.0 - row).astype(np.float32),
        "advantages": np.full(n, row * 0.5, np.float32),
    }


def check_rows(rows: list[int], got: list[dict[str, np.ndarray]], lengths: list[int],
               ranges: dict[int, list[tuple[int, int]]] | None) -> None:
    for pos, (row, data) in enumerate(zip(rows, got)):
        want = row_fields(row, lengths[row])
        spans = [(0, lengths[row])] if ranges is None else ranges[pos]
        for name in FIELDS:
            expect = np.concatenate([want[name][s:e] for s, e in spans])
            if not np.array_equal(data[name], expect):
                raise AssertionError(f"row {row} field {name}: wrong bytes")


def meta_for(row: int, n: int, address: str) -> SampleMeta:
    return SampleMeta(
        schema_version=1, sample_id=f"r{row}", prompt_ordinal=row, episode_id=f"e{row}", group_id=f"g{row // 8}",
        env="bench", turns=1, prompt_tokens=0, response_tokens=n, total_tokens=n, reward=0.0, advantage=None,
        policy_version_min=0, policy_version_max=0, producer_id=address, producer_address=address, checksum=0,
        created_at=0.0, info_json="{}",
    )


def producer_main(conn: Any, index: int, rows: list[int], lengths: list[int], node_kwargs: dict[str, Any] | None = None) -> None:
    """Put rows `rows` (of `lengths` tokens) into a shard node, send their metadata, serve until told to stop."""
    # default: the one-host benchmark's node (no secret here: UCX offered explicitly)
    node = ShardNode(**(node_kwargs or {"shm_max_bytes": 4 << 30, "ucx": True}))
    put = 0.0
    metas = []
    for row, n in zip(rows, lengths):
        fields = row_fields(row, n)
        t0 = time.perf_counter()
        node.put_many({sample_key(f"r{row}", name): arr for name, arr in fields.items()})
        put += time.perf_counter() - t0
        metas.append(meta_for(row, n, node.address))
    conn.send({"metas": metas, "put_seconds": put})
    conn.recv()
    node.close()


def deliver(client: ShardClient | None, central: CentralClient | None, claim: list[SampleMeta], mode: str,
            lay: dict[str, int], rank: int, step: int, verify: bool) -> int:
    """Consumer `rank`'s part of step `step` under layout `lay` ({dp, tp, cp}): pulled from the producers
    through `client` (mode pull, or pull_zc for zero-copy views) or through the dispatcher (mode central).
    Checks the bytes if `verify`; returns the bytes delivered."""
    lengths = [m.total_tokens for m in claim]
    layout = Layout.from_rank(rank, dp=lay["dp"], tp=lay["tp"], cp=lay["cp"])
    part = partition(lengths, layout)
    mine = [claim[i] for i in part.rows]
    ranges = part.ranges_by_position() if layout.cp_size > 1 else None
    if mode == "central":
        assert central is not None
        got = pull_samples_central(central, step, claim, mine, FIELDS, ranges, dtypes=EXTRA_DTYPES)
    else:
        assert client is not None
        got = pull_samples(client, mine, FIELDS, ranges, dtypes=EXTRA_DTYPES, zero_copy=mode == "pull_zc")
    if verify:
        check_rows(part.rows, got, lengths, ranges)
    return sum(a.nbytes for r in got for a in r.values())  # zero-copy views die with `got` on return
