"""The prompt ledger and layout index of the supervisor: which prompts are out, which finished
samples wait in which producer's store, what each training step claimed, and the sample accounting
(produced = consumed + lost + stale + filtered + waiting + claimed, where claimed = claimed but not
trained yet, and filtered = groups of equal rewards dropped by `algo.dynamic_sampling`, and rows of a
claimed step that no trainer plan holds (`refuse_longer`), never replayed).

A group is ready when all its episodes are: an episode whose agent rewrote its history is several
samples (segments, `rollout.non_append=split`) under the group's one ordinal, and the group waits for
every segment. From there on a segment is a sample like any other: claimed, trained, lost, re-issued
and recovered with its group, so each is trained once and none is counted twice.

Pure bookkeeping, no I/O: the server (`earl_stream.supervisor.server`) calls it. Each prompt carries
a monotonic ordinal; a prompt whose samples are lost or stale is re-issued under the same ordinal,
so no prompt is skipped and none is trained twice.

Every mutating call is safe to repeat, because control calls are retried after a timeout whose reply
may have been lost: a `RequestPrompts` carries a request id and a repeat gets the same prompts back;
re-sent rows are ignored; a repeated release is a no-op. A claimed step is first reported trained
(its samples count as consumed) and released only once a checkpoint holds its update, so a trainer
that resumes from its checkpoint is served the claims after it again, with the same rows; the
producers keep them until then (see `earl_stream.workers.trainer`).

Durable experience (`earl_stream.store.durable`): a rollout worker restarted from the run directory
sends the samples it had persisted (`earl_stream.supervisor.recovery.recover`, which keeps `lost_rows`
here to check them against). The ledger takes back only groups it still waits for:
ready or claimed ones (their rows then point at the new producer), and groups counted lost with a
dead producer whose prompt is not yet played again (they go back to ready under their original
ordinal and attempt; `samples_lost` and `prompts_reissued` give them back, `samples_recovered`
counts them). Anything else (trained and released, played again, unknown, another run's) is refused,
so nothing is trained twice.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import random
from collections import deque
from collections.abc import Collection, Iterable

import msgspec

from earl_stream.config import EnvSpec
from earl_stream.env.seeds import train_seed
from earl_stream.protocol import Prompt
from earl_stream.store.schema import SampleMeta, metas_to_table, table_from_ipc, table_to_ipc, table_to_metas

log = logging.getLogger(__name__)


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

    @property
    def max_version(self) -> int:
        """The newest policy version of any of its tokens (the trainer masks the too-stale ones)."""
        return max((r.policy_version_max for r in self.rows), default=0)

    @property
    def episodes_complete(self) -> int:
        """Episodes of which every sample has arrived: a one-sample episode is its row; an episode split into
        segments (`rollout.non_append=split`) counts once all its `segments` rows are here."""
        have = {(r.episode_id, r.segment) for r in self.rows}
        return sum(1 for r in self.rows if r.segment == 0 and all((r.episode_id, k) in have for k in range(1, r.segments)))

    @property
    def uniform(self) -> bool:
        """All its rewards are equal: every group-baseline advantage is 0, no signal."""
        return len({r.reward for r in self.rows}) <= 1


@dataclasses.dataclass
class Counters:
    samples_produced: int = 0
    samples_consumed: int = 0
    samples_lost: int = 0
    samples_stale: int = 0
    samples_filtered: int = 0  # in groups of equal rewards, dropped by dynamic sampling (done, not replayed)
    prompts_issued: int = 0
    prompts_reissued: int = 0
    duplicates_detected: int = 0
    tokens_produced: int = 0
    requests_repeated: int = 0  # RequestPrompts retried after a lost reply, answered with the same prompts
    prompts_dropped: int = 0  # queued prompts of an environment detached (or unloadable) before they were played
    samples_recovered: int = 0  # persisted by a producer, taken back after it restarted (not re-played)
    samples_too_long: int = 0  # episodes stopped (or refused) as longer than the largest plan the pools can run
    episodes_produced: int = 0  # finished episodes whose samples arrived (samples_produced counts every segment)
    segments_split: int = 0  # samples beyond an episode's first: its agent rewrote its history (non_append=split)


class LedgerState(msgspec.Struct):
    next_ordinal: int
    next_claim_step: int
    counters: dict[str, int]
    groups: list[Group]
    queue: list[int]
    ready: list[int]
    claims: dict[int, tuple[bytes, list[int]]]
    attempts: dict[int, int]
    requests: dict[str, list[tuple[str, list[str]]]] = {}  # worker -> recent (request id, group ids)
    trained_steps: dict[int, list[int]] = {}  # trained, not checkpointed: step -> ordinals lost in it
    lost_rows: dict[int, list[SampleMeta]] = {}  # lost groups not yet played again: their rows, for `recover`


RETRY_MAX_S = 30.0  # the longest back-off of a group its environment failed


class Ledger:
    def __init__(self, envs: Iterable[EnvSpec], *, seed: int, group_size: int, groups_per_step: int,
                 max_staleness: int, dynamic_sampling: bool = False) -> None:
        self.envs = list(envs)
        self.seed = seed
        self.group_size = group_size
        self.groups_per_step = groups_per_step
        self.max_staleness = max_staleness
        self.dynamic_sampling = dynamic_sampling
        self.counters = Counters()
        self.groups: dict[int, Group] = {}  # by prompt ordinal
        self.queue: deque[int] = deque()  # ordinals to (re)issue, oldest first
        self.ready: list[int] = []  # ordinals of complete groups, in completion order
        self.claims: dict[int, tuple[bytes, list[int]]] = {}  # step -> (table ipc, ordinals)
        self.next_ordinal = 0
        self.next_claim_step = 0
        self._attempts: dict[int, int] = {}
        self.requests: dict[str, dict[str, list[str]]] = {}  # worker -> request id -> group ids issued
        self.trained_steps: dict[int, list[int]] = {}  # claimed steps trained, not yet checkpointed -> lost ordinals
        self.journal: list[dict[str, object]] = []  # released steps not yet written out by the server
        self.lost_rows: dict[int, list[SampleMeta]] = {}  # ordinal -> rows of a lost group still queued
        # queued groups whose environment failed them, held back until this (monotonic) time: a broken
        # environment server must not keep every rollout slot busy with its retries
        self._retry_at: dict[int, float] = {}

    # -- prompts ------------------------------------------------------------------------------

    def _new_prompt(self, avoid: Collection[str] = ()) -> int:
        """A new group of an environment drawn by weight, among those not named in `avoid` (if any is left)."""
        ordinal = self.next_ordinal
        self.next_ordinal += 1
        envs = [e for e in self.envs if e.display_name not in avoid] or self.envs
        # a per-ordinal RNG: the choice is reproducible after a restart without persisting RNG state
        env = random.Random(self.seed * 7_777_777 + ordinal).choices(envs, weights=[e.weight for e in envs])[0]
        seed = train_seed(self.seed * 1_000_003 + ordinal * 7919)  # never an evaluation seed (env/seeds.py)
        prompt = Prompt(group_id=f"g{ordinal}", prompt_ordinal=ordinal, env=env.display_name, seed=seed,
                        group_size=self.group_size)
        self.groups[ordinal] = Group(prompt=prompt, state=PromptState.QUEUED)
        self.counters.prompts_issued += 1
        return ordinal

    def outstanding_groups(self) -> int:
        return sum(1 for g in self.groups.values() if g.state in (PromptState.QUEUED, PromptState.INFLIGHT, PromptState.READY))

    def issue(self, worker_id: str, max_groups: int, request_id: str = "", now: float | None = None) -> list[Prompt]:
        """Hand out up to `max_groups` prompts, never more than the staleness bound lets be used.

        A repeated `request_id` of the same worker (its first reply was lost) gets the prompts of
        the first answer that this worker still holds, and nothing new. Groups an environment failed
        wait out their back-off (`fail_groups`) when `now` is given; other queued groups and new
        prompts go first meanwhile.
        """
        if request_id:
            seen = self.requests.setdefault(worker_id, {})
            if request_id in seen:
                self.counters.requests_repeated += 1
                return self._held(worker_id, seen[request_id])
        out = self._issue_new(worker_id, max_groups, now)
        if request_id:
            seen[request_id] = [p.group_id for p in out]
            while len(seen) > REQUESTS_KEPT:  # only the last few can still be retried
                del seen[next(iter(seen))]
        return out

    def _held(self, worker_id: str, group_ids: list[str]) -> list[Prompt]:
        out = []
        for gid in group_ids:
            group = self.groups.get(_ordinal_of(gid))
            if group is not None and group.state == PromptState.INFLIGHT and group.worker_id == worker_id \
                    and group.prompt.group_id == gid:
                out.append(group.prompt)
        return out

    def _issue_new(self, worker_id: str, max_groups: int, now: float | None) -> list[Prompt]:
        limit = self.groups_per_step * (self.max_staleness + 1)
        out: list[Prompt] = []
        usable = {e.display_name for e in self.envs}
        # Groups waiting out a back-off hold no generation (their prompts get a fresh version bound when they
        # are played again), so they do not count against the staleness bound, and no new prompt is drawn
        # from their environments meanwhile: a dead environment server's groups once took the whole bound
        # and training stopped although other environments could have fed it. If every environment is
        # backing off, they count (nothing new would succeed anyway, and the queue stays bounded).
        waiting = [o for o in self.queue if now is not None and self._retry_at.get(o, 0.0) > now]
        failing = {self.groups[o].prompt.env for o in waiting}
        resting = len(waiting) if usable - failing else 0
        while len(out) < max_groups:
            if self.queue and self.groups[self.queue[0]].prompt.env not in usable:
                self._drop(self.queue.popleft())
                continue
            # the oldest queued group not waiting out a back-off
            ordinal = next((o for o in self.queue if now is None or self._retry_at.get(o, 0.0) <= now), None)
            if ordinal is not None and self.groups[ordinal].prompt.env not in usable:
                self.queue.remove(ordinal)
                self._drop(ordinal)
                continue
            if ordinal is None:
                if self.envs and self.outstanding_groups() - resting < limit:
                    ordinal = self._new_prompt(avoid=failing)
                    self.queue.append(ordinal)
                else:
                    break
            ahead = sum(1 for g in self.groups.values() if g.state in (PromptState.INFLIGHT, PromptState.READY))
            step = self.next_claim_step + ahead // self.groups_per_step
            self.queue.remove(ordinal)
            self._retry_at.pop(ordinal, None)
            group = self.groups[ordinal]
            self.lost_rows.pop(ordinal, None)  # played again: a persisted copy may no longer come back
            attempt = self._attempts.get(ordinal, 0)
            prompt = msgspec.structs.replace(group.prompt, group_id=f"g{ordinal}.{attempt}",
                                         min_policy_version=max(0, step - self.max_staleness))
            group.prompt, group.state, group.worker_id, group.rows = prompt, PromptState.INFLIGHT, worker_id, []
            out.append(prompt)
        return out

    def _drop(self, ordinal: int) -> None:
        """A queued prompt whose environment is gone (detached, or no worker can load it): never played."""
        group = self.groups.pop(ordinal)
        group.state = PromptState.DONE
        self.lost_rows.pop(ordinal, None)
        self.counters.prompts_dropped += 1
        log.warning("prompt %d of environment %r dropped: the environment is detached or cannot be loaded", ordinal,
                    group.prompt.env)

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
            if group is not None and group.prompt.group_id == row.group_id \
                    and any(r.sample_id == row.sample_id for r in group.rows):
                continue  # the same row sent again (a retried PutMeta): already counted once
            if group is None or group.state != PromptState.INFLIGHT or group.prompt.group_id != row.group_id \
                    or any(r.sample_id == row.sample_id for r in group.rows):
                self.counters.duplicates_detected += 1
                continue
            group.rows.append(row)
            self.counters.samples_produced += 1
            self.counters.episodes_produced += row.segment == 0
            self.counters.segments_split += row.segment > 0
            self.counters.samples_too_long += too_long_of(row)
            self.counters.tokens_produced += row.total_tokens
            if group.episodes_complete == group.prompt.group_size:
                group.state = PromptState.READY
                self.ready.append(row.prompt_ordinal)

    def fail_groups(self, group_ids: Iterable[str], now: float | None = None) -> None:
        """The worker could not finish these groups (an environment failed): re-issue them, each after a
        back-off that doubles with its failures (1 s, 2 s, ... at most RETRY_MAX_S) when `now` is given."""
        for gid in group_ids:
            ordinal = _ordinal_of(gid)
            group = self.groups.get(ordinal)
            if group is not None and group.state == PromptState.INFLIGHT and group.prompt.group_id == gid:
                self._reissue(ordinal)
                if now is not None:
                    failures = self._attempts.get(ordinal, 1)
                    self._retry_at[ordinal] = now + min(RETRY_MAX_S, 2.0 ** (failures - 1))

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
                self.lost_rows[ordinal] = list(group.rows)
                self._reissue(ordinal)
                reissued += 1
        self.counters.samples_lost += lost
        self.requests.pop(worker_id, None)  # what it asked for is re-issued; its retries get nothing
        return {"samples_lost": lost, "prompts_reissued": reissued}


    # -- claims -------------------------------------------------------------------------------

    def claim(self, step: int, num_groups: int, min_policy_version: int) -> tuple[bytes | None, dict[str, list[str]]]:
        """The step's metadata table (the same for every rank), or None while not enough is ready.

        Also returns {producer address: sample ids} of stale or filtered samples to free. A group is
        stale when even its newest token is older than `min_policy_version` (older tokens of a newer
        group are masked by the trainer); stale groups are played again. With dynamic sampling a group
        whose rewards are all equal is dropped for good (`samples_filtered`), and the step waits for
        other groups, which the freed room lets `issue` hand out; so is a group with no model token at all
        (every episode refused as too long).
        """
        if step in self.claims:
            return self.claims[step][0], {}
        to_free: dict[str, list[str]] = {}
        for ordinal in list(self.ready):
            group = self.groups[ordinal]
            # no model token at all: every episode was refused as too long (a prompt longer than any plan);
            # nothing to train, and played again it would be refused again: dropped, as filtered
            untrainable = group.max_version < 0
            if not untrainable and group.max_version < min_policy_version:
                self.ready.remove(ordinal)
                self.counters.samples_stale += len(group.rows)
                for r in group.rows:
                    to_free.setdefault(r.producer_address, []).append(r.sample_id)
                self._reissue(ordinal)
            elif untrainable or (self.dynamic_sampling and group.uniform):
                self.ready.remove(ordinal)
                self.counters.samples_filtered += len(group.rows)
                for r in group.rows:
                    to_free.setdefault(r.producer_address, []).append(r.sample_id)
                self.groups.pop(ordinal).state = PromptState.DONE
        if len(self.ready) < num_groups:
            return None, to_free
        taken, self.ready = self.ready[:num_groups], self.ready[num_groups:]
        # prompt order, not completion order, and within a group the producer's order (its episodes' order
        # in the group): the step's math (its mini-batches, its float sums) then depends neither on which
        # rollout finished first nor on the random part of the episode ids, which once reordered a group
        # from run to run and, at a few updates per step, changed the weights past the float rounding
        rows = [r for o in sorted(taken) for r in self.groups[o].rows]
        for o in taken:
            self.groups[o].state = PromptState.CLAIMED
        ipc = table_to_ipc(metas_to_table(rows))
        self.claims[step] = (ipc, taken)
        self.next_claim_step = max(self.next_claim_step, step + 1)
        return ipc, to_free

    def trained(self, step: int, lost_sample_ids: Iterable[str] = ()) -> dict[str, list[str]]:
        """The step was trained (not yet checkpointed): its samples count as consumed, and groups with
        a sample that could not be pulled count as lost and are re-issued. The claim stays, without
        those groups, so that a trainer resuming from an older checkpoint is served it again; the
        producers keep its rows until `release`. Returns {producer address: sample ids} to free.

        Repeating it is a no-op, except for groups newly lost in a replay (their producer died after
        the first training): they move from consumed to lost and are re-issued.
        """
        if step not in self.claims:
            return {}
        ipc, ordinals = self.claims[step]
        replay = step in self.trained_steps
        lost = set(lost_sample_ids)
        kept: list[int] = []
        to_free: dict[str, list[str]] = {}
        for o in ordinals:
            group = self.groups[o]
            # The trainer drops a whole group when any of its samples could not be pulled (its
            # advantages need every member), so the group counts as lost and is played again.
            if not any(r.sample_id in lost for r in group.rows):
                kept.append(o)
                if not replay:
                    self.counters.samples_consumed += len(group.rows)
                continue
            if replay:
                self.counters.samples_consumed -= len(group.rows)
            self.counters.samples_lost += len(group.rows)
            for r in group.rows:
                to_free.setdefault(r.producer_address, []).append(r.sample_id)
            self.trained_steps.setdefault(step, []).append(o)
            self.lost_rows[o] = list(group.rows)
            self._reissue(o)
        self.trained_steps.setdefault(step, [])
        if len(kept) < len(ordinals):  # a replay pulls exactly what the first training used
            ipc = table_to_ipc(metas_to_table([r for o in kept for r in sorted(self.groups[o].rows,
                                                                             key=lambda r: r.sample_id)]))
        self.claims[step] = (ipc, kept)
        return to_free

    def refuse_longer(self, step: int, max_tokens: int) -> tuple[list[SampleMeta], dict[str, list[str]]]:
        """The rows of claimed, untrained `step` longer than `max_tokens` that no trainer plan holds
        (`oom_replan`): taken out of the claim and their groups for good, counted `samples_too_long` (unless
        the rollout already counted them so) and `samples_filtered` (never trained, never played again: they
        would be refused again). The claim keeps the other rows in its order; a group left with no row, and
        a claim left with no group, are gone (the step is then claimed afresh). Returns (the refused rows,
        {producer address: sample ids} to free); a repeat refuses nothing more."""
        if step not in self.claims or step in self.trained_steps:
            return [], {}
        ipc, ordinals = self.claims[step]
        refused: list[SampleMeta] = []
        kept: list[int] = []
        for o in ordinals:
            group = self.groups[o]
            refused += [r for r in group.rows if r.total_tokens > max_tokens]
            group.rows = [r for r in group.rows if r.total_tokens <= max_tokens]
            if group.rows:
                kept.append(o)
            else:
                self.groups.pop(o).state = PromptState.DONE
                self.lost_rows.pop(o, None)
        if not refused:
            return [], {}
        self.counters.samples_filtered += len(refused)
        self.counters.samples_too_long += sum(not too_long_of(r) for r in refused)
        to_free: dict[str, list[str]] = {}
        for r in refused:
            to_free.setdefault(r.producer_address, []).append(r.sample_id)
        if kept:
            gone = {r.sample_id for r in refused}
            rows = [m for m in table_to_metas(table_from_ipc(ipc)) if m.sample_id not in gone]
            self.claims[step] = (table_to_ipc(metas_to_table(rows)), kept)
        else:
            del self.claims[step]
        return refused, to_free

    def release(self, step: int, lost_sample_ids: Iterable[str] = ()) -> dict[str, list[str]]:
        """A checkpoint holds the step: it is done for good and its rows may be freed (counted by
        `trained` first if it was not yet). Returns {producer address: sample ids} to free."""
        if step not in self.claims:
            return {}
        to_free = self.trained(step, lost_sample_ids) if step not in self.trained_steps else {}
        _, ordinals = self.claims.pop(step)
        for o in ordinals:
            group = self.groups.pop(o)
            group.state = PromptState.DONE
            self.lost_rows.pop(o, None)
            for r in group.rows:
                to_free.setdefault(r.producer_address, []).append(r.sample_id)
        self.journal.append({"step": step, "trained": ordinals, "lost": self.trained_steps.pop(step)})
        return to_free

    # -- persistence --------------------------------------------------------------------------

    def snapshot(self) -> bytes:
        """Everything needed to continue after a supervisor restart (msgpack, no pickle)."""
        state = LedgerState(
            next_ordinal=self.next_ordinal, next_claim_step=self.next_claim_step,
            counters=dataclasses.asdict(self.counters), groups=list(self.groups.values()), queue=list(self.queue),
            ready=self.ready, claims={k: (ipc, list(o)) for k, (ipc, o) in self.claims.items()}, attempts=self._attempts,
            requests={w: list(r.items()) for w, r in self.requests.items()}, trained_steps=self.trained_steps,
            lost_rows=self.lost_rows)
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
        self.requests = {w: dict(r) for w, r in state.requests.items()}
        self.trained_steps = {k: list(v) for k, v in state.trained_steps.items()}
        self.lost_rows = {k: list(v) for k, v in state.lost_rows.items()}

    def held_by(self, worker_id: str, producer_address: str) -> int:
        """Groups a worker still answers for: in flight on it, or with samples in its store that are not
        yet released (ready, claimed, or trained but not checkpointed). 0: it may leave, losing nothing."""
        return sum(1 for g in self.groups.values()
                   if (g.state == PromptState.INFLIGHT and g.worker_id == worker_id)
                   or (g.state in (PromptState.READY, PromptState.CLAIMED)
                       and any(r.producer_address == producer_address for r in g.rows)))

    def samples_waiting(self) -> int:
        return sum(len(self.groups[o].rows) for o in self.ready)

    def samples_claimed(self) -> int:
        """Samples of claimed steps not trained yet."""
        return sum(len(self.groups[o].rows) for step, (_, ords) in self.claims.items() if step not in self.trained_steps
                   for o in ords)

    def samples_uncheckpointed(self) -> int:
        """Samples trained (counted consumed) that no checkpoint holds yet; their producers keep them."""
        return sum(len(self.groups[o].rows) for step, (_, ords) in self.claims.items() if step in self.trained_steps
                   for o in ords)


REQUESTS_KEPT = 64


def _ordinal_of(group_id: str) -> int:
    """`g<ordinal>.<attempt>` -> ordinal."""
    return int(group_id[1:].split(".")[0])


def outcome_of(meta: SampleMeta) -> str:
    try:
        return str(json.loads(meta.info_json or "{}").get("outcome", ""))
    except ValueError:
        return ""


def too_long_of(meta: SampleMeta) -> bool:
    """The episode was stopped or refused for its length (`info["too_long"]`, set by the agent loop)."""
    if "too_long" not in (meta.info_json or ""):
        return False
    try:
        return bool(json.loads(meta.info_json).get("too_long"))
    except (ValueError, AttributeError):
        return False
