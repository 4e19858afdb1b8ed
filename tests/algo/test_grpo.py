"""GRPO math against hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from earl_stream.algo.grpo import clipped_pg_loss, group_advantages, token_logprobs


def test_group_advantages_by_hand() -> None:
    # group a: rewards 1, -1 -> mean 0, std 1 -> +1, -1; group b: 0, 0, 3 -> mean 1, std sqrt(2)
    adv = group_advantages([1.0, -1.0, 0.0, 0.0, 3.0], ["a", "a", "b", "b", "b"], eps=0.0)
    s = math.sqrt(2.0)
    np.testing.assert_allclose(adv, [1.0, -1.0, -1 / s, -1 / s, 2 / s], rtol=1e-6)


def test_equal_rewards_give_zero_advantage() -> None:
    assert np.all(group_advantages([0.5, 0.5, 0.5], ["g", "g", "g"]) == 0)


def test_clipped_loss_by_hand() -> None:
    # two loss tokens: ratio e^0.5 ~ 1.6487 with A=+1 is clipped to 1.2; ratio e^-0.5 ~ 0.6065 with A=-1
    # is clipped to 0.8 -> -min(0.6065*-1, 0.8*-1) = 0.8
    lp = torch.tensor([[0.0, 0.5, -0.5]])
    blp = torch.tensor([[0.0, 0.0, 0.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    # per-sample advantage broadcast: use two samples to give each token its own sign
    lp2 = torch.tensor([[0.0, 0.5], [0.0, -0.5]])
    blp2 = torch.zeros(2, 2)
    mask2 = torch.tensor([[0.0, 1.0], [0.0, 1.0]])
    terms = clipped_pg_loss(lp2, blp2, torch.tensor([1.0, -1.0]), mask2, clip_eps=0.2, normalizer=2.0)
    assert terms.loss.item() == pytest.approx((-1.2 + 0.8) / 2, abs=1e-6)
    assert terms.stats["clip_frac"] == pytest.approx(2.0)
    # on-policy (ratio 1): loss = -mean(A) over tokens and the gradient is -A * grad(logp)
    x = torch.zeros(1, 3, requires_grad=True)
    terms = clipped_pg_loss(lp + x, lp.detach(), torch.tensor([2.0]), mask, clip_eps=0.2, normalizer=2.0)
    terms.loss.backward()
    assert terms.loss.item() == pytest.approx(-2.0)
    np.testing.assert_allclose(x.grad.numpy(), [[0.0, -1.0, -1.0]])
    del blp


def test_kl_penalty_is_zero_at_the_reference() -> None:
    lp = torch.tensor([[0.0, -1.0]])
    mask = torch.tensor([[0.0, 1.0]])
    terms = clipped_pg_loss(lp, lp, torch.tensor([0.0]), mask, clip_eps=0.2, normalizer=1.0, ref_logprobs=lp, kl_coef=1.0)
    assert terms.stats["kl"] == pytest.approx(0.0)


def test_token_logprobs_alignment() -> None:
    logits = torch.log(torch.tensor([[[0.25, 0.75], [0.5, 0.5], [0.1, 0.9]]]))
    ids = torch.tensor([[0, 1, 0]])
    out = token_logprobs(logits, ids)
    np.testing.assert_allclose(out.numpy(), [[0.0, math.log(0.75), math.log(0.5)]], rtol=1e-6)
