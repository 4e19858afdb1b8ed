"""A vision-language policy plays an image game through the built-in agent loop: every turn's board picture enters
the context as the processor's image tokens (a tiny Idefics3, a tiny Qwen2.5-VL), the engine encodes each picture
once (later turns reuse the KV), and the episode's record keeps the pictures with their token spans. The log-probs
the engine sampled with equal a fresh forward of the whole episode (tokens and pictures) within 1e-4: what the
trainer's forward will recompute (both leave the image token out of the distribution: a reply never holds one,
even from a policy that favours it)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor
from vlm_inputs import hf_image_kwargs

from earl_stream.env import Observation, StepResult, make_env
from earl_stream.model.loading import load_processor, placeholder_token_ids
from earl_stream.model.tiny_vlm import init_vlm_model
from earl_stream.model.vision import VisionChat
from earl_stream.workers.agent_loop import EpisodeFailed, Sampling, play_episode
from earl_stream.workers.engines.batcher import AsyncBatcher
from earl_stream.workers.engines.torch_engine import TorchEngine


class Shown:
    """Three turns, a new picture each, whatever the reply (so every episode is multi-turn)."""

    system_prompt = "Say what you see."
    max_turn_tokens = 4

    def __init__(self) -> None:
        self.turn = 0

    def _picture(self) -> Observation:
        return Observation(f"Picture {self.turn}.", [np.full((40, 40, 3), 60 * self.turn, dtype=np.uint8)])

    async def reset(self, seed: int) -> Observation:
        self.turn = 0
        return self._picture()

    async def step(self, action: str) -> StepResult:
        self.turn += 1
        return StepResult(self._picture(), 0.0, self.turn >= 3, {"outcome": "done"} if self.turn >= 3 else {})


def _play(model, chat, envs) -> list:  # type: ignore[no-untyped-def,type-arg]
    engine = TorchEngine(model, seed=0)

    async def go() -> list:  # type: ignore[type-arg]
        batcher = AsyncBatcher(engine)
        try:
            episodes = [play_episode(env, None, chat, batcher, env_name="pictures", seed=s,
                                     prompt_ordinal=s, group_id="g", sampling=Sampling(temperature=1.0),
                                     policy_version=lambda: 0, decode=chat.tokenizer.decode, sample_seed=10 + s)
                        for s, env in enumerate(envs)]
            return await asyncio.gather(*episodes, return_exceptions=True)
        finally:
            await batcher.aclose()

    return [asyncio.run(go()), engine]


def _check(model, chat, records) -> None:  # type: ignore[no-untyped-def]
    for record in records:
        if isinstance(record, EpisodeFailed):
            pytest.fail(f"an image episode failed: {record}")
        ids = record.input_ids.tolist()
        assert record.images and all(ids[i.start] == chat._around for i in record.images)
        assert ids.count(chat.image_token_id) == 4 * len(record.images)  # no reply holds an image token
        assert len(record.images) >= record.turns  # a picture per observation the model answered
        x = torch.tensor([ids])
        with torch.no_grad():
            logits = model(input_ids=x, **hf_image_kwargs(chat, x, [chat.prompt_image(i) for i in record.images])).logits[0]
        logits[:, list(placeholder_token_ids(model.config))] = float("-inf")  # never sampled
        logprobs = torch.log_softmax(logits.float(), -1)
        mask = record.loss_mask.astype(bool)
        positions = np.nonzero(mask)[0]
        want = logprobs[positions - 1, torch.tensor(record.input_ids[positions], dtype=torch.long)].numpy()
        np.testing.assert_allclose(record.behaviour_logprobs[mask], want, atol=1e-4)


@pytest.mark.parametrize("family", ["idefics3", "qwen2_5_vl"])
def test_an_image_episode_records_its_pictures_and_the_logprobs_a_forward_recomputes(tmp_path, family) -> None:  # type: ignore[no-untyped-def]
    d = init_vlm_model(tmp_path / "vlm", family=family, image_size=64 if family == "idefics3" else 56)
    model = AutoModelForImageTextToText.from_pretrained(d).eval()
    chat = VisionChat(load_processor(d))
    records, engine = _play(model, chat, [make_env("tictactoe_image"), Shown(), Shown()])
    assert [r.turns for r in records[1:]] == [3, 3] and engine.stats.reused_tokens > 0  # earlier turns' KV reused
    _check(model, chat, records)


def test_a_policy_that_favours_the_image_token_never_samples_it(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Sampled, an image token in a reply would stand for a picture that is not there: the next turn's forward
    (the engine's, the trainer's) would fail on the count of image features. The engine masks it out; the
    trainer's log-probs (`workers.vocab_parallel.forward_logprobs`) use the same distribution."""
    from earl_stream.workers.vocab_parallel import forward_logprobs

    d = init_vlm_model(tmp_path / "vlm", family="idefics3", image_size=64)
    model = AutoModelForImageTextToText.from_pretrained(d).eval()
    chat = VisionChat(AutoProcessor.from_pretrained(d))

    def favour(_module, _inputs, out):  # type: ignore[no-untyped-def]
        out = out.clone()
        out[..., chat.image_token_id] += 30.0  # the image token would be sampled nearly always
        return out

    model.lm_head.register_forward_hook(favour)
    records, _ = _play(model, chat, [Shown(), Shown()])
    assert [r.turns for r in records] == [3, 3]
    _check(model, chat, records)
    ids = torch.tensor([[5, chat.image_token_id, 7]])
    batch = {"input_ids": ids, "position_ids": torch.arange(3)[None], "labels": torch.tensor([[chat.image_token_id, 7, 9]])}
    with torch.no_grad():
        logits, logp = forward_logprobs(model, batch)
    assert float(logp[0, 0]) == 0.0  # an image token as a label is a placeholder, no log-prob
    want = torch.log_softmax(logits.float(), -1)[0, 1, 7]
    assert torch.isfinite(logp).all() and float(logp[0, 1]) == pytest.approx(float(want), abs=1e-5)
    assert float(torch.softmax(logits.float(), -1)[0, :, chat.image_token_id].max()) == 0.0
