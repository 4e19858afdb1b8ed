"""Images of vision-language episodes in the experience store: stored beside the token
fields as the PNGs back to back, described and crc-checked by the metadata; a consumer pulls whole images whose
spans meet its token ranges (a sequence-parallel rank gets every image its slice touches), straight from the
producer, through the central dispatcher, and after a restart from durable experience, byte for byte."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from earl_stream.env import Observation
from earl_stream.errors import StoreError
from earl_stream.records import IMAGES, TOKEN_FIELDS, SampleImage, SampleRecord
from earl_stream.store import CentralClient, CentralDispatcher, ExperienceWriter, ShardClient, ShardNode, pull_samples
from earl_stream.store.durable import Identity, PersistRefused, Slot, decode, encode
from earl_stream.store.experience import pull_images

ME = Identity(run="run-a", model="/m#1")


def _records(n: int, seed: int = 0) -> list[SampleRecord]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        t = 60 + i
        mask = (np.arange(t) >= 40).astype(np.uint8)
        pictures = [rng.integers(0, 256, (6 + k, 5 + i, 3), dtype=np.uint8) for k in range(i % 3)]
        images = tuple(SampleImage(2 + 15 * k, 9, img) for k, img in enumerate(Observation("", pictures).images))
        out.append(SampleRecord(
            sample_id=f"s{i}", prompt_ordinal=i, episode_id=f"e{i}", group_id="g", env="board", turns=1,
            prompt_tokens=40, input_ids=rng.integers(0, 512, t).astype(np.int32), loss_mask=mask,
            behaviour_logprobs=-mask.astype(np.float32), policy_version=np.where(mask == 1, 1, -1).astype(np.int32),
            reward=1.0, images=images))
    return out


def test_images_are_pulled_whole_where_a_token_range_meets_them() -> None:
    records = _records(4)
    with ShardNode(shm=False) as node, ShardClient(timeout_s=10.0) as client:
        metas = ExperienceWriter(node, "w").put(records)
        assert [len(x) for x in pull_images(client, metas)] == [0, 1, 2, 0]
        assert pull_images(client, metas) == [r.images for r in records]  # byte for byte, spans and sizes
        # a sequence-parallel rank's slice [10, 20) meets image 0 of s2 ([2, 11)) and image 1 ([17, 26)), a slice
        # [11, 17) meets neither, [25, 30) only image 1: whole images, with their own spans
        got = pull_images(client, [metas[2]] * 3, {0: [(10, 20)], 1: [(11, 17)], 2: [(25, 30)]})
        assert got == [records[2].images, (), records[2].images[1:]]
        (row,) = pull_samples(client, [metas[2]], list(TOKEN_FIELDS))  # the token fields are what they were
        np.testing.assert_array_equal(row["input_ids"], records[2].input_ids)


def test_images_that_do_not_match_their_metadata_are_refused() -> None:
    record = _records(3)[2]
    with ShardNode(shm=False) as node, ShardClient(timeout_s=10.0) as client:
        (meta,) = ExperienceWriter(node, "w").put([record])
        key = next(k for k in node.keys() if k.endswith("/" + IMAGES))
        stored = node.copy({key: key})[key]
        stored[-5] ^= 0xFF
        node.drop([key])
        node.put_many({key: stored})
        with pytest.raises(StoreError, match="do not match their checksum"):
            pull_images(client, [meta])
    with pytest.raises(ValueError, match="overlaps the previous image"):
        dataclasses.replace(record, images=(record.images[1], record.images[0]))


def test_images_cross_the_central_dispatcher_and_durable_experience_byte_for_byte(tmp_path: Path) -> None:
    records = _records(5, seed=1)
    with ShardNode(shm=False) as node, CentralDispatcher(keep_steps=2) as dispatcher, \
            CentralClient(ShardClient(timeout_s=10.0), dispatcher.address) as central:
        writer = ExperienceWriter(node, "w1")
        metas = writer.put(records)
        central.set_step(3, metas)
        assert pull_images(central, metas) == [r.images for r in records]
        assert any(k.endswith("/" + IMAGES) for k in dispatcher.node.keys())  # they went through it
        slot = Slot(tmp_path, host="h")
        slot.write(ME, 3, writer.held_samples())
        slot.close()
        _, loaded = Slot(tmp_path, host="h").load(ME)
    with ShardNode(shm=False) as new, ShardClient(timeout_s=10.0) as client:
        again = ExperienceWriter(new, "w2")
        rows = [again.restore(m, f) for m, f in loaded]
        assert pull_images(client, rows) == [r.images for r in records]
    held = [(m, dict(f)) for m, f in loaded]
    with_images = next(f for _, f in held if IMAGES in f)
    with_images[IMAGES] = with_images[IMAGES].copy()
    with_images[IMAGES][3] ^= 1
    with pytest.raises(PersistRefused, match="images do not match"):
        decode(encode(ME, 1, held), ME)
    del with_images[IMAGES]
    with pytest.raises(PersistRefused, match="does not hold"):
        decode(encode(ME, 1, held), ME)
