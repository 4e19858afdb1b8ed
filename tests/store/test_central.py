"""Central dispatch mode: same answers as the layout-aware pull, every byte through one dispatcher."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np
import pytest

from earl_stream.errors import StoreError
from earl_stream.records import TOKEN_FIELDS, SampleRecord
from earl_stream.store import (
    CentralClient,
    CentralDispatcher,
    ErrorCode,
    ExperienceWriter,
    Layout,
    RemoteError,
    SampleMeta,
    SamplesUnavailable,
    ShardClient,
    ShardNode,
    partition,
    pull_samples,
    pull_samples_central,
    start_dispatcher_process,
    wire,
)
from earl_stream.store.wire import Kind

FIELDS = list(TOKEN_FIELDS)


def _records(prefix: str, n: int, seed: int) -> list[SampleRecord]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        t = int(rng.integers(1, 500))
        mask = (np.arange(t) >= t // 4).astype(np.uint8)
        out.append(
            SampleRecord(
                sample_id=f"{prefix}-{i}", prompt_ordinal=i, episode_id=f"e-{prefix}-{i}", group_id=f"g-{prefix}-{i // 2}",
                env="test", turns=1, prompt_tokens=t // 4, input_ids=rng.integers(0, 512, t).astype(np.int32),
                loss_mask=mask, behaviour_logprobs=(-rng.random(t, dtype=np.float32)) * mask,
                policy_version=np.where(mask == 1, 2, -1).astype(np.int32), reward=float(rng.random()), info={},
            )
        )
    return out


@pytest.fixture
def producers() -> Iterator[tuple[list[ShardNode], list[SampleMeta]]]:
    nodes = [ShardNode(), ShardNode()]
    claim: list[SampleMeta] = []
    for k, node in enumerate(nodes):
        claim += ExperienceWriter(node, f"p{k}").put(_records(f"p{k}", 7, seed=k))
    claim.sort(key=lambda m: m.sample_id[::-1])  # interleave the producers
    yield nodes, claim
    for node in nodes:
        node.close()


@pytest.fixture
def dispatcher() -> Iterator[CentralDispatcher]:
    with CentralDispatcher(keep_steps=2) as d:
        yield d


@pytest.mark.parametrize("dims", [(2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 1, 2)])
def test_central_gives_every_rank_what_pull_gives(producers: tuple, dispatcher: CentralDispatcher, dims: tuple) -> None:
    nodes, claim = producers
    dp, tp, cp = dims
    lengths = [m.total_tokens for m in claim]
    with ShardClient(timeout_s=10.0) as direct, CentralClient(ShardClient(timeout_s=10.0), dispatcher.address) as central:
        for rank in range(dp * tp * cp):
            part = partition(lengths, Layout.from_rank(rank, dp=dp, tp=tp, cp=cp))
            mine = [claim[i] for i in part.rows]
            ranges = part.ranges_by_position() if cp > 1 else None
            want = pull_samples(direct, mine, FIELDS, ranges)
            got = pull_samples_central(central, 5, claim, mine, FIELDS, ranges)
            for w, g in zip(want, got):
                for name in FIELDS:
                    np.testing.assert_array_equal(g[name], w[name])
        # Every claimed row went through the dispatcher, whole; the consumer never touched a producer.
        assert len([k for k in dispatcher.node.keys() if k.startswith("c/5/")]) == len(claim) * len(FIELDS)
        assert central._client.transport(nodes[0].address) is None


def test_a_lost_producer_costs_exactly_its_samples(producers: tuple, dispatcher: CentralDispatcher) -> None:
    nodes, claim = producers
    nodes[1].close()  # dies before the step is gathered
    with CentralClient(ShardClient(timeout_s=5.0), dispatcher.address) as central:
        with pytest.raises(SamplesUnavailable) as info:
            pull_samples_central(central, 1, claim, claim, FIELDS)
        lost = sorted(m.sample_id for m in claim if m.producer_address == nodes[1].address)
        assert sorted(info.value.sample_ids) == lost
        kept = [i for i, m in enumerate(claim) if m.producer_address == nodes[0].address]
        assert all(info.value.partial[i] is not None for i in kept)


def test_old_steps_are_dropped_and_release_frees(producers: tuple, dispatcher: CentralDispatcher) -> None:
    _, claim = producers
    with CentralClient(ShardClient(timeout_s=5.0), dispatcher.address) as central:
        for step in (1, 2):
            pull_samples_central(central, step, claim, claim[:3], ["input_ids"])
        assert {k.split("/")[1] for k in dispatcher.node.keys()} == {"1", "2"}
        pull_samples_central(central, 3, claim, claim[:3], ["input_ids"])  # keep_steps=2 drops step 1
        assert {k.split("/")[1] for k in dispatcher.node.keys()} == {"2", "3"}
        assert central.release(3) > 0 and central.release(3) == 0
        with pytest.raises(StoreError, match="set_step"):
            CentralClient(ShardClient(), dispatcher.address).gather(["input_ids"])


def test_dispatcher_kinds_are_refused_elsewhere_and_drop_is_confined(dispatcher: CentralDispatcher) -> None:
    with ShardNode() as plain, ShardClient(timeout_s=5.0) as client:
        with pytest.raises(RemoteError) as info:
            client.call(plain.address, wire.GatherRequest(1, []), Kind.GATHER_REPLY)
        assert info.value.code == ErrorCode.UNKNOWN_KIND
        plain.put("k", np.arange(3))
        np.testing.assert_array_equal(client.pull(plain.address, [("k", 0, 3)])[0], [0, 1, 2])  # still serving
        with pytest.raises(RemoteError) as info:
            client.call(dispatcher.address, wire.DropRequest("s/"), Kind.DROP_REPLY)
        assert info.value.code == ErrorCode.BAD_RANGE


def test_dispatcher_in_its_own_process(producers: tuple) -> None:
    _, claim = producers
    proc = start_dispatcher_process()
    try:
        with CentralClient(ShardClient(timeout_s=10.0), proc.address) as central:
            rows = pull_samples_central(central, 0, claim, claim, FIELDS)
            assert [len(r["input_ids"]) for r in rows] == [m.total_tokens for m in claim]
    finally:
        proc.stop()
    assert proc.process.exitcode == 0


def test_central_carries_routed_experts_exactly(dispatcher: CentralDispatcher) -> None:
    """`store.dispatch=central`: a MoE sample's routed_experts (uint8 [T, layers, top_k], flattened) reach every
    rank through the dispatcher byte for byte, whole rows and context-parallel sub-ranges, crc-checked."""
    from earl_stream.records import ROUTED_EXPERTS

    rng = np.random.default_rng(3)
    records = [dataclasses.replace(r, routed_experts=rng.integers(0, 8, (r.num_tokens, 3, 2)).astype(np.uint8))
               for r in _records("m", 6, seed=5)]
    fields = [*FIELDS, ROUTED_EXPERTS]
    with ShardNode() as node:
        claim = ExperienceWriter(node, "p").put(records)
        lengths = [m.total_tokens for m in claim]
        with CentralClient(ShardClient(timeout_s=10.0), dispatcher.address) as central:
            for dp, cp in [(1, 1), (2, 1), (1, 2)]:
                for rank in range(dp * cp):
                    part = partition(lengths, Layout.from_rank(rank, dp=dp, cp=cp))
                    ranges = part.ranges_by_position() if cp > 1 else None
                    got = pull_samples_central(central, 7 + dp + 2 * cp, claim, [claim[i] for i in part.rows], fields, ranges)
                    for pos, (i, row) in enumerate(zip(part.rows, got)):
                        routed = records[i].routed_experts
                        assert routed is not None
                        spans = ranges[pos] if ranges is not None else [(0, routed.shape[0])]
                        want = np.concatenate([routed[s:e] for s, e in spans])
                        np.testing.assert_array_equal(row[ROUTED_EXPERTS].reshape(want.shape), want)
                        np.testing.assert_array_equal(row["input_ids"], np.concatenate(
                            [records[i].input_ids[s:e] for s, e in spans]))
        assert any(k.endswith("/" + ROUTED_EXPERTS) for k in dispatcher.node.keys())  # they went through it
        assert central._client.transport(node.address) is None
