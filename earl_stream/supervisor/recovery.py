"""Durable experience on the supervisor's side: which persisted samples a restarted producer may serve
again (`recover`). The ledger (`ledger.py`) keeps the groups and, for groups lost with a dead producer
and not yet played again, their rows (`Ledger.lost_rows`); the files are `earl_stream.store.durable`'s.

A group is taken back whole or not at all, and only while the ledger still waits for exactly those
samples (same ids and token checksums): ready or claimed (its rows, and the claim tables that name
them, now point at the new node, so a resumed trainer pulls them from there), or lost and still queued
(back to ready under its original ordinal and attempt: its loss and re-issue are given back and it
counts in `samples_recovered`). Everything else (trained and released, played again, unknown, another
run's) is refused, so nothing is trained twice. Pure bookkeeping, safe to repeat.
"""

from __future__ import annotations

from collections.abc import Iterable

from earl_stream.store.schema import SampleMeta, metas_to_table, table_from_ipc, table_to_ipc, table_to_metas
from earl_stream.supervisor.ledger import Ledger, PromptState


def recover(ledger: Ledger, rows: Iterable[SampleMeta]) -> tuple[list[str], list[str]]:
    """Take back what a restarted producer serves (`rows` name its new node). Returns (accepted,
    refused) sample ids; the producer frees the refused ones."""
    by_group: dict[int, list[SampleMeta]] = {}
    for row in rows:
        by_group.setdefault(row.prompt_ordinal, []).append(row)
    accepted: list[str] = []
    refused: list[str] = []
    repointed: dict[str, SampleMeta] = {}
    for ordinal, got in by_group.items():
        (accepted if _take_back(ledger, ordinal, got, repointed) else refused).extend(r.sample_id for r in got)
    if repointed:
        _repoint_claims(ledger, repointed)
    return accepted, refused


def _take_back(ledger: Ledger, ordinal: int, got: list[SampleMeta], repointed: dict[str, SampleMeta]) -> bool:
    group = ledger.groups.get(ordinal)
    if group is None or any(r.group_id != group.prompt.group_id for r in got):
        return False
    lost = ledger.lost_rows.get(ordinal)
    c = ledger.counters
    if group.state == PromptState.QUEUED and lost is not None and ordinal in ledger.queue and _same(lost, got):
        ledger.queue.remove(ordinal)
        ledger._attempts[ordinal] -= 1  # its prompt keeps the attempt it had: g<ordinal>.<attempt> as produced
        group.state, group.worker_id, group.rows = PromptState.READY, got[0].producer_id, list(got)
        ledger.ready.append(ordinal)
        del ledger.lost_rows[ordinal]
        c.samples_lost -= len(got)
        c.prompts_reissued -= 1
        c.samples_recovered += len(got)
        return True
    if group.state in (PromptState.READY, PromptState.CLAIMED) and _same(group.rows, got):
        if {r.producer_address for r in group.rows} != {r.producer_address for r in got}:
            c.samples_recovered += len(got)  # a repeat (already on this node) counts once
        order = {r.sample_id: i for i, r in enumerate(group.rows)}
        group.rows = sorted(got, key=lambda r: order[r.sample_id])
        if group.state == PromptState.CLAIMED:
            repointed.update({r.sample_id: r for r in got})
        return True
    return False


def _repoint_claims(ledger: Ledger, rows: dict[str, SampleMeta]) -> None:
    """Claim tables name their samples' producers: point the recovered ones at their new node."""
    for step, (ipc, ordinals) in ledger.claims.items():
        metas = table_to_metas(table_from_ipc(ipc))
        if any(m.sample_id in rows for m in metas):
            ledger.claims[step] = (table_to_ipc(metas_to_table([rows.get(m.sample_id, m) for m in metas])), ordinals)


def _same(have: list[SampleMeta], got: list[SampleMeta]) -> bool:
    """The same samples (ids and token checksums), each once."""
    return len(got) == len(have) == len({r.sample_id for r in got}) and \
        {(r.sample_id, r.checksum) for r in have} == {(r.sample_id, r.checksum) for r in got}
