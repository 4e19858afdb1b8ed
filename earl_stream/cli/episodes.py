"""`earl-stream episodes tail|export`: finished episodes as readable transcripts, and as Parquet.

Metadata rows come from the supervisor (its window of recent episodes); each transcript is pulled
from the rollout worker that produced it, which keeps the last `records.TRANSCRIPTS_KEPT` of them in its shard
node. Episodes whose producer is gone are listed without a transcript.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from earl_stream import protocol as P
from earl_stream.errors import ConfigError, StoreError
from earl_stream.records import transcript_key
from earl_stream.security.keys import KeyRole, key_for, role_of
from earl_stream.security.secret import load_secret
from earl_stream.store.client import ShardClient
from earl_stream.store.schema import SampleMeta, table_from_ipc, table_to_metas

NO_TRANSCRIPT = "(transcript no longer held by its producer)"
ROLE_KEY_TRANSCRIPT = "(transcript not pulled: shard nodes take only the cluster secret, not a role key)"


def fetch(client: P.ControlClient, store: ShardClient | None, since: int,
          limit: int | None = None) -> tuple[int, list[SampleMeta], list[str | None]]:
    """Episodes finished after cursor `since` (at most the first `limit`), their transcripts, and the
    cursor to ask from next."""
    reply = client.call(P.RecentEpisodes(since=since))
    metas = table_to_metas(table_from_ipc(reply.table_ipc)) if reply.table_ipc else []
    cursor = reply.cursor
    if limit is not None and len(metas) > limit:  # more finished since `since` was chosen (a live run)
        metas, cursor = metas[:limit], since + limit
    texts: list[str | None] = []
    if store is None:  # a read-only key: metadata only
        return cursor, metas, [None] * len(metas)
    for m in metas:
        key = transcript_key(m.sample_id)
        try:
            entry = next((e for e in store.manifest(m.producer_address, key) if e.key == key), None)
            if entry is None:
                texts.append(None)
                continue
            arr = store.pull(m.producer_address, [(key, 0, int(entry.shape[0]))])[0]
            texts.append(bytes(arr).decode(errors="replace"))
        except StoreError:
            texts.append(None)
    return cursor, metas, texts


def run_episodes_command(args: argparse.Namespace) -> int:
    secret = load_secret()
    client = P.ControlClient(args.supervisor, timeout_s=10, secret=key_for(secret, KeyRole.READONLY))
    # transcripts are pulled from the producers' shard nodes, which take only the cluster secret
    store = ShardClient(secret=secret, timeout_s=10) if role_of(secret) in (None, KeyRole.CLUSTER) else None
    try:
        if args.episodes_command == "export":
            return _export(client, store, Path(args.path), args.format)
        cursor = 0 if args.all else max(0, client.call(P.RecentEpisodes(since=1 << 62)).cursor - args.last)
        limit = None if args.all else args.last  # `--last N` shows N, however many finish meanwhile
        while True:
            cursor, metas, texts = fetch(client, store, cursor, limit)
            limit = None
            for m, text in zip(metas, texts):
                _show(m, text, NO_TRANSCRIPT if store is not None else ROLE_KEY_TRANSCRIPT)
            if not args.follow:
                return 0
            time.sleep(1.0)
    finally:
        if store is not None:
            store.close()
        client.close()


def _show(m: SampleMeta, text: str | None, missing: str) -> None:
    print(f"=== {m.sample_id}  env={m.env} reward={m.reward:+.2f} turns={m.turns} tokens={m.total_tokens} "
          f"policy v{m.policy_version_min}-{m.policy_version_max} {m.info_json}")
    print(text if text is not None else missing, flush=True)


def _export(client: P.ControlClient, store: ShardClient | None, path: Path, fmt: str) -> int:
    if fmt != "parquet":
        raise ConfigError(f"--format {fmt!r} is not supported; use parquet")
    _, metas, texts = fetch(client, store, 0)
    rows: dict[str, list[Any]] = {name: [getattr(m, name) for m in metas] for name in SampleMeta.__struct_fields__}
    rows["transcript"] = texts
    table = pa.table(rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)
    print(f"wrote {table.num_rows} episodes to {path}")
    return 0
