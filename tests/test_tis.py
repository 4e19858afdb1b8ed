"""Truncated importance sampling (TIS) in the GRPO loss: the weights are ~1 when the built-in engine
and the trainer run the same weights (real model, real multi-turn generation, the trainer's
recompute), the cap truncates, and `algo.is_correction=none` is exactly the loss without TIS."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch

from earl_stream.algo.losses import LossTerms, is_weights, policy_loss, token_logprobs
from earl_stream.config import AlgoConfig, load_config
from earl_stream.env import StepResult, env_options
from earl_stream.errors import ConfigError
from earl_stream.model import load_model
from earl_stream.model.chat import ChatFormat
from earl_stream.records import SampleRecord
from earl_stream.workers.agent_loop import Sampling, episode_sample_seed, play_episode
from earl_stream.workers.batches import batch_tensors, local_batch
from earl_stream.workers.engines.batcher import AsyncBatcher
from earl_stream.workers.engines.torch_engine import TorchEngine
from earl_stream.workers.vocab_parallel import forward_logprobs

torch.set_num_threads(1)


def _loss(lp: torch.Tensor, blp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, n: float, correction: str,
          old: torch.Tensor | None = None) -> LossTerms:
    """The token-mean loss over n loss tokens, clip 0.2, no entropy term."""
    algo = AlgoConfig(entropy_coef=0.0, is_correction=correction, tis_cap=2.0)
    return policy_loss(lp, blp, adv, mask, torch.full((lp.shape[0],), 1.0 / n), algo, old_logprobs=old)


def _tis_weights(old: torch.Tensor, blp: torch.Tensor, mask: torch.Tensor, cap: float) -> torch.Tensor:
    return is_weights(old, blp, mask, AlgoConfig(tis_cap=cap))[0]


class FourTurns:
    """A scripted multi-turn environment: every reply is answered, the episode ends after four turns
    (a random tiny model cannot keep a real game going)."""

    max_turn_tokens = 12

    def __init__(self) -> None:
        self.turn = 0

    async def reset(self, seed: int) -> str:
        self.turn = 0
        return f"Game {seed}. Say something."

    async def step(self, action_text: str) -> StepResult:
        self.turn += 1
        return StepResult(observation=f"Turn {self.turn}: you said {len(action_text)} characters. Again.",
                          reward=float(len(action_text) % 3), done=self.turn >= 4, info={})


def _episodes(model_dir: Path, n: int, temperature: float = 1.0) -> tuple[torch.nn.Module, list[SampleRecord]]:
    """n four-turn episodes played concurrently by the built-in engine (batched, KV kept across turns)."""
    model, tokenizer = load_model(model_dir)
    model.eval()
    chat = ChatFormat(tokenizer)
    engine = TorchEngine(model, seed=0)

    async def go() -> list[SampleRecord]:
        batcher = AsyncBatcher(engine, max_batch_size=n)
        try:
            envs = [FourTurns() for _ in range(n)]
            return list(await asyncio.gather(*[
                play_episode(env, env_options(env), chat, batcher, env_name="four_turns", seed=i % 3, prompt_ordinal=i,
                             group_id=f"g{i % 3}", sampling=Sampling(temperature=temperature), policy_version=lambda: 0,
                             decode=tokenizer.decode, sample_seed=episode_sample_seed(i % 3, i))
                for i, env in enumerate(envs)]))
        finally:
            await batcher.aclose()

    records = asyncio.run(go())
    assert engine.stats.reused_tokens > 0, "the engine never reused a kept KV cache: not a multi-turn test"
    return model, records


@pytest.fixture(scope="module")
def recomputed(tiny_model_dir: Path) -> dict[str, torch.Tensor]:
    """The trainer's view of real engine episodes: its own log-probs next to the engine's."""
    model, records = _episodes(tiny_model_dir, 8)
    assert max(r.turns for r in records) >= 2
    rows = [{"input_ids": r.input_ids, "loss_mask": r.loss_mask, "behaviour_logprobs": r.behaviour_logprobs}
            for r in records]
    batch = batch_tensors(rows, np.linspace(-1.0, 1.0, len(rows)).astype(np.float32))
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    batch["trainer_logprobs"] = token_logprobs(logits, batch["input_ids"])
    return batch


def test_tis_weights_are_one_for_the_builtin_engine_at_equal_weights(recomputed: dict[str, torch.Tensor]) -> None:
    b = recomputed
    m = b["loss_mask"] > 0
    assert int(m.sum()) >= 50
    gap = (b["trainer_logprobs"] - b["behaviour_logprobs"])[m].abs()
    weights = _tis_weights(b["trainer_logprobs"], b["behaviour_logprobs"], b["loss_mask"], 2.0)[m]
    assert float(gap.mean()) < 1e-5 and float(gap.max()) < 1e-4, (float(gap.mean()), float(gap.max()))
    assert float((weights - 1).abs().max()) < 1e-4
    # The loss with TIS is then the loss without it, value and gradient alike.
    lp = b["trainer_logprobs"].clone().requires_grad_(True)
    with_tis = _loss(lp, b["behaviour_logprobs"], b["advantages"], b["loss_mask"], float(m.sum()), "tis")
    with_tis.loss.backward()
    grad_tis = lp.grad.clone()
    lp.grad = None
    plain = _loss(lp, b["behaviour_logprobs"], b["advantages"], b["loss_mask"], float(m.sum()), "none")
    plain.loss.backward()
    assert with_tis.loss.item() == pytest.approx(plain.loss.item(), abs=1e-5)
    torch.testing.assert_close(grad_tis, lp.grad, atol=1e-6, rtol=1e-4)
    assert with_tis.stats["tis_truncated"] == 0
    assert with_tis.stats["mismatch_abs"] == pytest.approx(float(gap.sum()), abs=1e-4)


def test_the_trainer_scores_samples_at_the_rollout_temperature(tiny_model_dir: Path) -> None:
    """Episodes sampled at temperature 0.5 carry the engine's log-probs of the tempered distribution; the
    trainer's forward (`forward_logprobs`, temperature=rollout.temperature) gives the same ones, so the
    importance weights are ~1; scored at temperature 1 they are far off."""
    model, records = _episodes(tiny_model_dir, 6, temperature=0.5)
    rows = [{"input_ids": r.input_ids, "loss_mask": r.loss_mask, "behaviour_logprobs": r.behaviour_logprobs}
            for r in records]
    n = max(len(r["input_ids"]) for r in rows) - 1
    batch = local_batch(rows, np.zeros(len(rows), np.float32), (0, n))
    m = batch["loss_mask"] > 0
    assert int(m.sum()) >= 30
    with torch.no_grad():
        tempered = forward_logprobs(model, batch, temperature=0.5)[1]
        plain = forward_logprobs(model, batch, temperature=1.0)[1]
    gap = (tempered - batch["behaviour_logprobs"])[m].abs()
    assert float(gap.max()) < 1e-4, float(gap.max())
    assert float((plain - batch["behaviour_logprobs"])[m].abs().mean()) > 100 * float(gap.mean()) + 1e-3


def test_cap_truncates_and_scales_the_gradient() -> None:
    # token 1: engine far less likely than the trainer (w = e^3 > cap); token 2: engine more likely (w = e^-1)
    lp = torch.tensor([[0.0, -1.0, -2.0]], requires_grad=True)
    blp = torch.tensor([[0.0, -4.0, -1.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    w = _tis_weights(lp, blp, mask, 2.0)
    torch.testing.assert_close(w, torch.tensor([[1.0, 2.0, float(np.exp(-1.0))]]))
    terms = _loss(lp, blp, torch.tensor([1.0]), mask, 2.0, "tis")
    terms.loss.backward()
    # one optimizer step per batch: the ratio to the trainer's old policy is 1, gradient = -A * w / normalizer
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, -1.0, -float(np.exp(-1.0)) / 2]]))
    assert terms.stats["tis_truncated"] == 1
    assert terms.stats["mismatch_abs"] == pytest.approx(4.0)
    # explicit old log-probs (a second epoch over the batch): the PPO ratio is taken against them
    lp2 = torch.tensor([[0.0, -0.5, -2.0]], requires_grad=True)
    terms = _loss(lp2, blp, torch.tensor([1.0]), mask, 2.0, "tis", old=lp.detach())
    assert terms.stats["clip_frac"] == 1  # exp(0.5) is outside 1 +- 0.2
    with pytest.raises(ValueError):
        _tis_weights(lp, blp, mask, 0.0)


def _old_loss(lp: torch.Tensor, blp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, clip_eps: float,
              normalizer: float) -> torch.Tensor:
    """The loss before TIS existed, written out."""
    m = mask.float()
    ratio = torch.exp((lp - blp) * m)
    a = adv.float().unsqueeze(-1)
    per_token = -torch.minimum(ratio * a, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * a)
    return (per_token * m).sum() / normalizer


def test_cap_zero_is_exactly_the_old_loss(recomputed: dict[str, torch.Tensor]) -> None:
    b = recomputed
    gen = torch.Generator().manual_seed(0)
    # move the trainer away from the engine so clipping and weights both matter
    lp0 = b["trainer_logprobs"] + 0.3 * torch.randn(b["trainer_logprobs"].shape, generator=gen)
    n = float(b["loss_mask"].sum())
    lp = lp0.clone().requires_grad_(True)
    terms = _loss(lp, b["behaviour_logprobs"], b["advantages"], b["loss_mask"], n, "none")
    terms.loss.backward()
    ref_lp = lp0.clone().requires_grad_(True)
    ref = _old_loss(ref_lp, b["behaviour_logprobs"], b["advantages"], b["loss_mask"], 0.2, n)
    ref.backward()
    # (the same sum, weighted by 1/n per token instead of divided by n once: equal to rounding)
    torch.testing.assert_close(terms.loss.detach(), ref.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(lp.grad, ref_lp.grad, rtol=1e-6, atol=1e-9)
    assert "tis_truncated" not in terms.stats
    # ... and TIS on the same inputs is a different loss (the weights are far from 1 here)
    other = _loss(lp0, b["behaviour_logprobs"], b["advantages"], b["loss_mask"], n, "tis")
    assert other.loss.item() != pytest.approx(terms.loss.item(), abs=1e-4)


def test_config_fields() -> None:
    algo = load_config(None, []).algo
    assert (algo.is_correction, algo.tis_cap) == ("tis", 2.0)
    assert load_config(None, ["algo.is_correction=none"]).algo.is_correction == "none"
    with pytest.raises(ConfigError, match="trainer.tis_cap: moved to algo.tis_cap"):
        load_config(None, ["trainer.tis_cap=0"])
    with pytest.raises(ConfigError, match="algo.tis_cap must be > 0"):
        load_config(None, ["algo.tis_cap=0"])
