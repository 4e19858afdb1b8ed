"""The training step's algorithm options on a real store (a shard node in this process) and the tiny
model: the loss aggregations do not depend on the micro-batching, too-stale tokens are masked (not
their group dropped), KL in the reward is the KL-free step on shifted rewards, and several updates per
step take their ratios against the step's starting log-probs."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from earl_stream.algo.losses import token_logprobs
from earl_stream.config import AlgoConfig, TrainerConfig
from earl_stream.model import load_model
from earl_stream.records import SampleRecord
from earl_stream.store.client import ShardClient
from earl_stream.store.experience import ExperienceWriter
from earl_stream.store.layout import Layout
from earl_stream.store.node import ShardNode
from earl_stream.store.schema import SampleMeta
from earl_stream.workers.train_step import StepResult, train_step

ALGO = AlgoConfig(entropy_coef=0.0, grad_clip=0.0)
PROMPT = 3


@pytest.fixture()
def store() -> Iterator[tuple[ExperienceWriter, ShardClient]]:
    torch.set_num_threads(1)
    with ShardNode("127.0.0.1") as node:
        client = ShardClient(timeout_s=10)
        try:
            yield ExperienceWriter(node, "w"), client
        finally:
            client.close()


def _records(model: torch.nn.Module, *, stale: int = 0, mask_stale: bool = False) -> list[SampleRecord]:
    """Two groups of four episodes of 6-12 tokens (3 prompt tokens), engine log-probs = the model's.
    The first `stale` response tokens of every episode were sampled by policy 0, the rest by policy 1;
    with mask_stale those tokens are out of the loss mask instead."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for i in range(8):
        t = 6 + (i * 5) % 7
        ids = torch.randint(3, int(model.config.vocab_size), (t,), generator=gen)
        mask = np.array([0] * PROMPT + [1] * (t - PROMPT), np.uint8)
        with torch.no_grad():
            lp = token_logprobs(model(input_ids=ids[None]).logits, ids[None])[0].numpy() * mask
        versions = np.where(mask > 0, 1, -1).astype(np.int32)
        versions[PROMPT:PROMPT + stale] = 0
        if mask_stale:
            mask[PROMPT:PROMPT + stale] = 0
        out.append(SampleRecord(sample_id=f"s{i}", prompt_ordinal=i // 4, episode_id=f"e{i}", group_id=f"g{i // 4}",
                                env="test", turns=1, prompt_tokens=PROMPT, input_ids=ids.numpy().astype(np.int32),
                                loss_mask=mask, behaviour_logprobs=lp.astype(np.float32), policy_version=versions,
                                reward=float((i * 7) % 3)))
    return out


def _step(model_dir: Path, metas: list[SampleMeta], client: ShardClient, algo: AlgoConfig, *, tokens: int = 1 << 20,
          lr: float = 0.1, **kw: object) -> tuple[StepResult, dict[str, torch.Tensor]]:
    """One SGD step from the tiny model's weights: its result and the update of every weight."""
    model, _ = load_model(model_dir)
    model.train()
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    result = train_step(model, torch.optim.SGD(model.parameters(), lr=lr), metas, Layout(), client,
                        TrainerConfig(micro_batch_tokens=tokens), algo=algo, **kw)  # type: ignore[arg-type]
    return result, {k: v.detach() - start[k] for k, v in model.state_dict().items()}


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], rel: float = 1e-5) -> None:
    """Equal updates, to float rounding (relative to the largest change of each tensor, plus the float32
    resolution of weights near 1)."""
    assert max(float(v.abs().max()) for v in a.values()) > 1e-4, "the step changed nothing: no test"
    for k in a:
        scale = float(a[k].abs().max())
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=rel * scale + 3e-7, msg=lambda m, name=k: f"{name}: {m}")


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_aggregation_does_not_depend_on_micro_batching(tiny_model_dir: Path, store, agg: str) -> None:
    writer, client = store
    model, _ = load_model(tiny_model_dir)
    metas = writer.put(_records(model))
    algo = dataclasses.replace(ALGO, loss_agg=agg)
    whole, w_whole = _step(tiny_model_dir, metas, client, algo)
    split, w_split = _step(tiny_model_dir, metas, client, algo, tokens=12)  # about one row per micro-batch
    # (at ratio 1 the loss is -sum(weight x A), ~0 under the seq-mean shapes: the gradients are the test)
    assert split.loss == pytest.approx(whole.loss, rel=1e-5, abs=1e-6)
    _assert_same(w_whole, w_split)


def test_too_stale_tokens_are_masked_not_their_group(tiny_model_dir: Path, store) -> None:
    writer, client = store
    model, _ = load_model(tiny_model_dir)
    metas = writer.put(_records(model, stale=2))
    # seq-mean-token-sum weighs rows by 1/N whatever their token counts: masking two tokens of each row
    # must then be exactly the step on records whose loss mask already leaves them out
    algo = dataclasses.replace(ALGO, loss_agg="seq-mean-token-sum")
    masked, w_masked = _step(tiny_model_dir, metas, client, algo, min_version=1)
    others = writer.put([dataclasses.replace(r, sample_id=f"x{r.sample_id}")
                         for r in _records(model, stale=2, mask_stale=True)])
    plain, w_plain = _step(tiny_model_dir, others, client, algo)
    _assert_same(w_masked, w_plain)
    assert masked.samples == 8 and not masked.lost_sample_ids
    # 2 of each row's response tokens (8 rows): the fraction of all the claim's loss tokens
    assert masked.stale_frac == pytest.approx(16 / sum(m.response_tokens for m in metas))
    assert masked.masked_frac == masked.stale_frac and plain.stale_frac == 0
    fresh, _ = _step(tiny_model_dir, metas, client, algo, min_version=0)
    assert fresh.stale_frac == 0


def test_kl_in_the_reward_is_the_step_on_shifted_rewards(tiny_model_dir: Path, store) -> None:
    writer, client = store
    model, _ = load_model(tiny_model_dir)
    ref, _ = load_model(tiny_model_dir)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    records = _records(model)
    metas = writer.put(records)
    algo = dataclasses.replace(ALGO, kl_coef=0.5, kl_in="reward", kl_estimator="k1")
    with_kl, w_kl = _step(tiny_model_dir, metas, client, algo, ref_model=ref)
    shifted = []
    for r in records:  # reward - 0.5 * sum over loss tokens of k1 = log pi - log ref
        ids = torch.from_numpy(r.input_ids.astype(np.int64))[None]
        with torch.no_grad():
            k1 = token_logprobs(model(input_ids=ids).logits, ids) - token_logprobs(ref(input_ids=ids).logits, ids)
        kl = float((k1[0] * torch.from_numpy(r.loss_mask.astype(np.float32))).sum())
        shifted.append(dataclasses.replace(r, sample_id=f"k{r.sample_id}", reward=r.reward - 0.5 * kl))
    plain, w_plain = _step(tiny_model_dir, writer.put(shifted), client, dataclasses.replace(algo, kl_coef=0.0))
    assert with_kl.loss == pytest.approx(plain.loss, rel=1e-4)
    _assert_same(w_kl, w_plain, rel=1e-4)
    # algo.kl_decay_steps: at step 1 of 2 the weight is half of kl_coef (1.0 -> the 0.5 above), at step 2 it is
    # 0 and the step is the one without KL (a constant lr, so that steps 0, 1 and 2 compare)
    decayed = dataclasses.replace(algo, kl_coef=1.0, kl_decay_steps=2, lr_schedule="constant")
    half, w_half = _step(tiny_model_dir, metas, client, decayed, ref_model=ref, step=1)
    assert half.loss == pytest.approx(with_kl.loss, rel=1e-6) and half.kl == pytest.approx(with_kl.kl, rel=1e-6)
    _assert_same(w_half, w_kl, rel=1e-6)
    off, w_off = _step(tiny_model_dir, metas, client, decayed, ref_model=ref, step=2)
    free, w_free = _step(tiny_model_dir, metas, client, dataclasses.replace(decayed, kl_coef=0.0, kl_decay_steps=0),
                         ref_model=ref, step=2)
    assert off.kl == 0 and off.loss == pytest.approx(free.loss, rel=1e-6)
    _assert_same(w_off, w_free, rel=1e-6)


def test_updates_after_the_first_see_ratios_against_the_steps_old_log_probs(tiny_model_dir: Path, store) -> None:
    writer, client = store
    model, _ = load_model(tiny_model_dir)
    metas = writer.put(_records(model))
    one, _ = _step(tiny_model_dir, metas, client, ALGO)
    assert one.updates == 1 and one.ratio_dev < 1e-6 and one.clip_frac == 0
    two, _ = _step(tiny_model_dir, metas, client, dataclasses.replace(ALGO, ppo_epochs=2), lr=1.0)
    assert two.updates == 2 and two.ratio_dev > 1e-3 and two.clip_frac > 0, two
    minis, _ = _step(tiny_model_dir, metas, client, dataclasses.replace(ALGO, mini_batches=2), lr=1.0)
    assert minis.updates == 2 and minis.ratio_dev > 1e-3, minis
    # warm-up: step 0 of 4 runs at a quarter of the optimizer's lr
    warm, _ = _step(tiny_model_dir, metas, client, dataclasses.replace(ALGO, warmup_steps=4), lr=0.2, step=0)
    assert warm.lr == pytest.approx(0.05)
