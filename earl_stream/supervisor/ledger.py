"""The prompt ledger and layout index of the supervisor: which prompts are out, which finished
samples wait in which producer's store, what each training step claimed, and the sample accounting
(produced = consumed + lost + stale + waiting).

Pure bookkeeping, no I/O: the server (`earl_stream.supervisor.server`) calls it. Each prompt carries
a monotonic ordinal; a prompt whose samples are lost or stale is re-issued under the same ordinal,
so no prompt is skipped and none is trained twice.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import random

import msgspec
from collections import deque
from typing import Iterable

from earl_stream.config import EnvSpec
from earl_stream.protocol import Prompt
from earl_stream.store.schema import SampleMeta, metas_to_table, table_to_ipc


class PromptState(enum.Enum):
    QUEUED = "queued"
    INFLIGHT = "inflight"
    READY = "ready"  # all samples of the group are in a producer's store
    CLAIMED = "claimed"
    DONE = "done"


@dataclasses.dataclass
class Group:
    prompt: Prompt
    state: PromptState
    worker_id: str = ""
    rows: list[SampleMeta] = dataclasses.field(default_factory=list)

    @property
    def min_version(self) -> int:
        return min((r.policy_version_min for r in self.rows), default=0)


@dataclasses.dataclass
class Counters:
    samples_produced: int = 0
    samples_consumed: int = 0
    samples_lost: int = 0
    samples_stale: int = 0
    prompts_issued: int = 0
    prompts_reissued: int = 0
    duplicates_detected: int = 0
    tokens_produced: int = 0


class LedgerState(msgspec.Struct):
    next_ordinal: int
    next_claim_step: int
    counters: dict[str, int]
    groups: list[Group]
    queue: list[int]
    ready: list[int]
    claims: dict[int, tuple[bytes, list[int]]]
    attempts: dict[int, int]


class Ledger:
    def __init__(self, envs: Iterable[EnvSpec], *, seed: int, group_size: int, groups_per_step: int,
                 max_staleness: int) -> None:
        self.envs = list(envs)
        self.seed = seed
        self.group_size = group_size
        self.groups_per_step = groups_per_step
        self.max_staleness = max_staleness
        self.counters = Counters()
        self.groups: dict[int, Group] = {}  # by prompt ordinal
        self.queue: deque[int] = deque()  # ordinals to (re)issue, oldest first
        self.ready: list[int] = []  # ordinals of complete groups, in completion order
        self.claims: dict[int, tuple[bytes, list[int]]] = {}  # step -> (table ipc, ordinals)
        self.next_ordinal = 0
        self.next_claim_step = 0
        self._attempts: dict[int, int] = {}

    # -- prompts ------------------------------------------------------------------------------

    def _new_prompt(self) -> int:
        ordinal = self.next_ordinal
        self.next_ordinal += 1
        # a per-ordinal RNG: the choice is reproducible after a restart without persisting RNG state
        env = random.Random(self.seed * 7_777_777 + ordinal).choices(self.envs, weights=[e.weight for e in self.envs])[0]
        seed = (self.seed * 1_000_003 + ordinal * 7919) & 0x7FFFFFFF
        prompt = Prompt(group_id=f"g{ordinal}", prompt_ordinal=ordinal, env=env.display_name, seed=seed,
                        group_size=self.group_size)
        self.groups[ordinal] = Group(prompt=prompt, state=PromptState.QUEUED)
        self.counters.prompts_issued += 1
        return ordinal

    def outstanding_groups(self) -> int:
        return sum(1 for g in self.groups.values() if g.state in (PromptState.QUEUED, PromptState.INFLIGHT, PromptState.READY))

    def issue(self, worker_id: str, max_groups: int) -> list[Prompt]:
        """Hand out up to `max_groups` prompts, never more than the staleness bound lets be used."""
        limit = self.groups_per_step * (self.max_staleness + 1)
        out: list[Prompt] = []
        while len(out) < max_groups:
            if self.queue:
                ordinal = self.queue[0]
            elif self.envs and self.outstanding_groups() < limit:
                ordinal = self._new_prompt()
                self.queue.append(ordinal)
            else:
                break
            ahead = sum(1 for g in self.groups.values() if g.state in (PromptState.INFLIGHT, PromptState.READY))
            step = self.next_claim_step + ahead // self.groups_per_step
            self.queue.popleft()
            group = self.groups[ordinal]
            attempt = self._attempts.get(ordinal, 0)
            prompt = msgspec.structs.replace(group.prompt, group_id=f"g{ordinal}.{attempt}",
                                         min_policy_version=max(0, step - self.max_staleness))
            group.prompt, group.state, group.worker_id, group.rows = prompt, PromptState.INFLIGHT, worker_id, []
            out.append(prompt)
        return out

    def _reissue(self, ordinal: int) -> None:
        group = self.groups[ordinal]
        group.state, group.worker_id, group.rows = PromptState.QUEUED, "", []
        self._attempts[ordinal] = self._attempts.get(ordinal, 0) + 1
        self.queue.appendleft(ordinal)
        self.counters.prompts_reissued += 1

    # -- samples ------------------------------------------------------------------------------

    def add_rows(self, worker_id: str, rows: Iterable[SampleMeta]) -> None:
        for row in rows:
            group = self.groups.get(row.prompt_ordinal)
            if group is None or group.state != PromptState.INFLIGHT or group.prompt.group_id != row.group_id \
                    or any(r.sample_id == row.sample_id for r in group.rows):
                self.counters.duplicates_detected += 1
                continue
            group.rows.append(row)
            self.counters.samples_produced += 1
            self.counters.tokens_produced += row.total_tokens
            if len(group.rows) == group.prompt.group_size:
                group.state = PromptState.READY
                self.ready.append(row.prompt_ordinal)

    def fail_groups(self, group_ids: Iterable[str]) -> None:
        """The worker could not finish these groups (an environment failed): re-issue them."""
        for gid in group_ids:
            ordinal = int(gid[1:].split(".")[0])
            group = self.groups.get(ordinal)
            if group is not None and group.state == PromptState.INFLIGHT and group.prompt.group_id == gid:
                self._reissue(ordinal)

    def worker_lost(self, worker_id: str, producer_address: str) -> dict[str, int]:
        """A worker died: its in-flight prompts and its unpulled samples are re-issued."""
        lost = reissued = 0
        for ordinal, group in self.groups.items():
            if group.state == PromptState.INFLIGHT and group.worker_id == worker_id:
                self._reissue(ordinal)
                reissued += 1
            elif group.state == PromptState.READY and any(r.producer_address == producer_address for r in group.rows):
                lost += len(group.rows)
                self.ready.remove(ordinal)
                self._reissue(ordinal)
                reissued += 1
        self.counters.samples_lost += lost
        return {"samples_lost": lost, "prompts_reissued": reissued}

    # -- claims -------------------------------------------------------------------------------

    def claim(self, step: int, num_groups: int, min_policy_version: int) -> tuple[bytes | None, dict[str, list[str]]]:
        """The step's metadata table (the same for every rank), or None while not enough is ready.

        Also returns {producer address: sample ids} of stale samples to free.
        """
        if step in self.claims:
            return self.claims[step][0], {}
        to_free: dict[str, list[str]] = {}
        for ordinal in list(self.ready):
            group = self.groups[ordinal]
            if group.min_version < min_policy_version:
                self.ready.remove(ordinal)
                self.counters.samples_stale += len(group.rows)
                for r in group.rows:
                    to_free.setdefault(r.producer_address, []).append(r.sample_id)
                self._reissue(ordinal)
        if len(self.ready) < num_groups:
            return None, to_free
        taken, self.ready = self.ready[:num_groups], self.ready[num_groups:]
        rows = [r for o in taken for r in sorted(self.groups[o].rows, key=lambda r: r.sample_id)]
        for o in taken:
            self.groups[o].state = PromptState.CLAIMED
        ipc = table_to_ipc(metas_to_table(rows))
        self.claims[step] = (ipc, taken)
        self.next_claim_step = max(self.next_claim_step, step + 1)
        return ipc, to_free

    def release(self, step: int, lost_sample_ids: Iterable[str] = ()) -> dict[str, list[str]]:
        """The step was trained: free its shards; samples that could not be pulled are lost and their
        prompts re-issued. Returns {producer address: sample ids} to free."""
        if step not in self.claims:
            return {}
        _, ordinals = self.claims.pop(step)
        lost = set(lost_sample_ids)
        to_free: dict[str, list[str]] = {}
        for o in ordinals:
            group = self.groups[o]
            # The trainer drops a whole group when any of its samples could not be pulled (its
            # advantages need every member), so the group counts as lost and is played again.
            group_lost = any(r.sample_id in lost for r in group.rows)
            if group_lost:
                self.counters.samples_lost += len(group.rows)
            else:
                self.counters.samples_consumed += len(group.rows)
            for r in group.rows:
                to_free.setdefault(r.producer_address, []).append(r.sample_id)
            if group_lost:
                self._reissue(o)
            else:
                group.state = PromptState.DONE
                del self.groups[o]
        return to_free

    # -- persistence --------------------------------------------------------------------------

    def snapshot(self) -> bytes:
        """Everything needed to continue after a supervisor restart (msgpack, no pickle)."""
        state = LedgerState(
            next_ordinal=self.next_ordinal, next_claim_step=self.next_claim_step,
            counters=dataclasses.asdict(self.counters), groups=list(self.groups.values()), queue=list(self.queue),
            ready=self.ready, claims={k: list(v) for k, v in self.claims.items()}, attempts=self._attempts)
        return msgspec.msgpack.encode(state)

    def restore(self, data: bytes) -> None:
        state = msgspec.msgpack.decode(data, type=LedgerState)
        self.next_ordinal, self.next_claim_step = state.next_ordinal, state.next_claim_step
        self.counters = Counters(**state.counters)
        self.groups = {g.prompt.prompt_ordinal: g for g in state.groups}
        self.queue = deque(state.queue)
        self.ready = list(state.ready)
        self.claims = {k: (bytes(v[0]), list(v[1])) for k, v in state.claims.items()}
        self._attempts = dict(state.attempts)

    def samples_waiting(self) -> int:
        return sum(len(self.groups[o].rows) for o in self.ready)


def outcome_of(meta: SampleMeta) -> str:
    try:
        return str(json.loads(meta.info_json or "{}").get("outcome", ""))
    except ValueError:
        return ""
