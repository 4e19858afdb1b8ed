"""Every loss option against a hand-computed example: the clip (symmetric, clip-higher, dual-clip),
aggregation, KL estimators, importance correction (TIS, masking, none), ratios against the step's old
log-probs, the learning-rate schedule and gradient-norm clipping."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from earl_stream.algo.losses import clipped_surrogate, kl_estimate, policy_loss, row_weights, token_logprobs
from earl_stream.algo.schedule import apply_lr, kl_factor, lr_factor
from earl_stream.config import AlgoConfig
from earl_stream.workers.mesh import Placement, clip_gradients

ALGO = AlgoConfig(entropy_coef=0.0, is_correction="none")


def _col(*values: float) -> torch.Tensor:
    return torch.tensor(values).unsqueeze(-1)  # one token per row


def test_symmetric_clip_by_hand() -> None:
    # ratio e^0.5 = 1.6487 with A = +1 is clipped to 1.2 -> loss -1.2 (clip active);
    # ratio e^-0.5 = 0.6065 with A = -1: -min(-0.6065, -0.8) = 0.8 (clip active);
    # ratio 1.1 with A = +1 is inside the band -> -1.1 (not active)
    ratio = torch.exp(_col(0.5, -0.5, math.log(1.1)))
    loss, active = clipped_surrogate(ratio, _col(1.0, -1.0, 1.0), ALGO)
    np.testing.assert_allclose(loss.squeeze(-1).numpy(), [-1.2, 0.8, -1.1], rtol=1e-6)
    assert active.squeeze(-1).tolist() == [True, True, False]


def test_clip_higher_by_hand() -> None:
    # eps_low 0.2, eps_high 0.28: ratio 1.25 with A = +1 is no longer clipped (1.25 < 1.28) -> -1.25;
    # ratio 1.5 with A = +1 -> -1.28; ratio 0.7 with A = -1 still clipped at 0.8 -> 0.8
    algo = dataclasses.replace(ALGO, clip_eps_high=0.28)
    loss, active = clipped_surrogate(_col(1.25, 1.5, 0.7), _col(1.0, 1.0, -1.0), algo)
    np.testing.assert_allclose(loss.squeeze(-1).numpy(), [-1.25, -1.28, 0.8], rtol=1e-6)
    assert active.squeeze(-1).tolist() == [False, True, True]


def test_dual_clip_by_hand() -> None:
    # c = 3. A = -1, ratio 5: PPO's loss max(5 * 1, 1.2 * 1) = 5 is capped at -c A = 3 (active);
    # A = -1, ratio 2: max(2, 1.2) = 2 < 3, kept (PPO clip active? 1.2 < 2: no);
    # A = +1, ratio 5: -min(5, 1.2) = -1.2, the dual clip does not apply to positive advantages
    algo = dataclasses.replace(ALGO, dual_clip_c=3.0)
    loss, active = clipped_surrogate(_col(5.0, 2.0, 5.0), _col(-1.0, -1.0, 1.0), algo)
    np.testing.assert_allclose(loss.squeeze(-1).numpy(), [3.0, 2.0, -1.2], rtol=1e-6)
    assert active.squeeze(-1).tolist() == [True, False, True]


@pytest.mark.parametrize(("agg", "expected"), [
    # row 1: one loss token with per-token loss -A = -1; row 2: three tokens with loss +2 each (A = -2)
    ("token-mean", (-1 + 6) / 4),  # all four tokens alike: 1.25
    ("seq-mean-token-mean", (-1 / 1 + 6 / 3) / 2),  # each row's mean, then the mean of rows: 0.5
    ("seq-mean-token-sum", (-1 + 6) / 2),  # each row's sum, then the mean of rows: 2.5
])
def test_aggregation_by_hand(agg: str, expected: float) -> None:
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    lp = torch.zeros(2, 3)  # on-policy: ratio 1, per-token loss = -A
    weights = torch.tensor(row_weights([1, 3], agg))
    terms = policy_loss(lp, lp, torch.tensor([1.0, -2.0]), mask, weights, dataclasses.replace(ALGO, loss_agg=agg))
    assert terms.loss.item() == pytest.approx(expected)
    assert terms.stats["pg_loss"] == pytest.approx(expected)


def test_row_weights_use_the_counts_of_the_whole_update() -> None:
    # rows of 2, 6 and 0 loss tokens: token-mean 1/8 each; seq-mean-token-mean 1/(3*2), 1/(3*6), 1/3;
    # seq-mean-token-sum 1/3 each
    assert row_weights([2, 6, 0], "token-mean") == pytest.approx([1 / 8] * 3)
    assert row_weights([2, 6, 0], "seq-mean-token-mean") == pytest.approx([1 / 6, 1 / 18, 1 / 3])
    assert row_weights([2, 6, 0], "seq-mean-token-sum") == pytest.approx([1 / 3] * 3)


def test_kl_estimators_by_hand() -> None:
    # pi = 0.5, ref = 0.25: d = log(ref/pi) = -ln 2. k1 = ln 2 = 0.6931; k2 = (ln 2)^2 / 2 = 0.2402;
    # k3 = e^-ln2 + ln 2 - 1 = 0.5 + 0.6931 - 1 = 0.1931, and dk3/dlog pi = 1 - ref/pi = 0.5
    ln2 = math.log(2.0)
    for name, value in (("k1", ln2), ("k2", ln2 * ln2 / 2), ("k3", 0.5 + ln2 - 1)):
        lp = torch.tensor([[math.log(0.5)]], requires_grad=True)
        k = kl_estimate(lp, torch.tensor([[math.log(0.25)]]), name)
        assert k.item() == pytest.approx(value, rel=1e-6)
        if name == "k3":
            k.sum().backward()
            assert lp.grad is not None and lp.grad.item() == pytest.approx(0.5, rel=1e-6)


def test_kl_in_the_loss_by_hand() -> None:
    # A = 0, so the loss is the KL term alone: 0.1 * k3 = 0.1 * 0.1931 over one token (token-mean)
    lp, ref = torch.tensor([[math.log(0.5)]]), torch.tensor([[math.log(0.25)]])
    algo = dataclasses.replace(ALGO, kl_coef=0.1, kl_estimator="k3")
    terms = policy_loss(lp, lp, torch.zeros(1), torch.ones(1, 1), torch.ones(1), algo, ref_logprobs=ref)
    assert terms.loss.item() == pytest.approx(0.1 * (0.5 + math.log(2.0) - 1), rel=1e-6)
    in_reward = policy_loss(lp, lp, torch.zeros(1), torch.ones(1, 1), torch.ones(1),
                            dataclasses.replace(algo, kl_in="reward"), ref_logprobs=ref)
    assert in_reward.loss.item() == 0.0  # in the reward, not the loss (train_step subtracts it from rewards)


def test_importance_correction_by_hand() -> None:
    # three tokens, A = +1 each, on-policy to the trainer's old log-probs (ratio 1 -> per-token -1), with
    # old/engine probability ratios k = 3, e^0.4 = 1.4918 and 0.25.
    old = torch.zeros(3, 1)
    behaviour = -torch.log(torch.tensor([[3.0], [math.exp(0.4)], [0.25]]))
    adv, mask, w = torch.ones(3), torch.ones(3, 1), torch.ones(3)
    # tis (cap 2): weights min(k, 2) = 2, 1.4918, 0.25 -> loss -(2 + 1.4918 + 0.25); one truncated
    tis = policy_loss(old, behaviour, adv, mask, w, dataclasses.replace(ALGO, is_correction="tis", tis_cap=2.0))
    assert tis.loss.item() == pytest.approx(-(2 + math.exp(0.4) + 0.25), rel=1e-6)
    assert tis.stats["tis_truncated"] == 1.0 and tis.stats["is_masked"] == 0.0
    # mask (band [0.5, 2]): k = 3 and 0.25 are outside -> weight 0; 1.4918 inside keeps its weight
    masked = policy_loss(old, behaviour, adv, mask, w, dataclasses.replace(ALGO, is_correction="mask"))
    assert masked.loss.item() == pytest.approx(-math.exp(0.4), rel=1e-6)
    assert masked.stats["is_masked"] == 2.0
    # none: the ratio is against the engine's log-probs, pi/pi_engine = k -> clipped: -(1.2 + 1.2 + 0.25)
    none = policy_loss(old, behaviour, adv, mask, w, ALGO)
    assert none.loss.item() == pytest.approx(-(1.2 + 1.2 + 0.25), rel=1e-6)


def test_ratio_is_against_the_old_log_probs_of_the_step() -> None:
    # a second update: the current log-prob moved +0.5 from the step's old one: ratio e^0.5 -> clipped to
    # 1.2 with A = +1 (loss -1.2, clip active, |ratio - 1| = 0.6487); the engine's log-prob plays no part
    # in the ratio under tis (it gives the weight min(e^(0 - 0), 2) = 1)
    old = torch.zeros(1, 1)
    lp = (old + 0.5).requires_grad_(True)
    algo = dataclasses.replace(ALGO, is_correction="tis")
    terms = policy_loss(lp, old, torch.ones(1), torch.ones(1, 1), torch.ones(1), algo, old_logprobs=old)
    assert terms.loss.item() == pytest.approx(-1.2, rel=1e-6)
    assert terms.stats["clip_frac"] == 1.0 and terms.stats["ratio_dev"] == pytest.approx(math.exp(0.5) - 1, rel=1e-6)
    terms.loss.backward()
    assert lp.grad is not None and lp.grad.item() == 0.0  # clipped: no gradient


def test_entropy_bonus_by_hand() -> None:
    # A = 0; entropy 0.7 nats on one token with coefficient 0.1 -> loss -0.07
    lp = torch.zeros(1, 1)
    algo = dataclasses.replace(ALGO, entropy_coef=0.1)
    terms = policy_loss(lp, lp, torch.zeros(1), torch.ones(1, 1), torch.ones(1), algo, entropy=torch.full((1, 1), 0.7))
    assert terms.loss.item() == pytest.approx(-0.07, rel=1e-6) and terms.stats["entropy"] == pytest.approx(0.7)


def test_lr_schedule_by_hand() -> None:
    # warm-up over 4 steps: 1/4, 2/4, 3/4, then 1 (constant)
    warm = AlgoConfig(warmup_steps=4, lr_schedule="constant")
    assert [lr_factor(warm, s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    # cosine after 2 warm-up steps to step 6, floor 0.1: step 4 is half-way -> 0.1 + 0.9 * (1 + cos(pi/2)) / 2
    cos = AlgoConfig(warmup_steps=2, lr_schedule="cosine", lr_decay_steps=6, min_lr_ratio=0.1)
    got = [lr_factor(cos, s) for s in (0, 1, 2, 4, 6, 10)]
    assert got == pytest.approx([0.5, 1.0, 1.0, 0.55, 0.1, 0.1])
    # the run's steps end the cosine when lr_decay_steps is 0
    assert lr_factor(AlgoConfig(lr_schedule="cosine", lr_decay_steps=0, min_lr_ratio=0.0), 5,
                     run_steps=10) == pytest.approx(0.5)
    # the default: cosine from 1 at step 0 to 0.1 at step 400, constant after
    default = AlgoConfig()
    assert [lr_factor(default, s) for s in (0, 200, 400, 10_000)] == pytest.approx([1.0, 0.55, 0.1, 0.1])
    # the KL weight: constant by default; with kl_decay_steps=4 it falls 1, 3/4, 1/2, 1/4, then 0 for good
    assert kl_factor(AlgoConfig(kl_coef=0.1), 10_000) == 1.0
    assert [kl_factor(AlgoConfig(kl_coef=0.1, kl_decay_steps=4), s) for s in range(7)] == [1, .75, .5, .25, 0, 0, 0]
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.2)
    assert apply_lr(opt, 0.5) == pytest.approx(0.1) and opt.param_groups[0]["lr"] == pytest.approx(0.1)
    assert apply_lr(opt, 1.0) == pytest.approx(0.2)
    assert set(opt.param_groups[0]) == set(torch.optim.SGD([torch.zeros(1)], lr=0.2).param_groups[0])  # no extra key


def test_gradient_norm_clipping_by_hand() -> None:
    # gradients (3, 4) and (12,): global norm sqrt(9 + 16 + 144) = 13 -> scaled by 1/13 to norm 1
    a, b = torch.zeros(2, requires_grad=True), torch.zeros(1, requires_grad=True)
    model = torch.nn.Module()
    model.a, model.b = torch.nn.Parameter(a), torch.nn.Parameter(b)
    model.a.grad, model.b.grad = torch.tensor([3.0, 4.0]), torch.tensor([12.0])
    assert clip_gradients(model, 1.0, Placement.single()) == pytest.approx(13.0)
    np.testing.assert_allclose(model.a.grad.numpy(), [3 / 13, 4 / 13], rtol=1e-5)
    assert clip_gradients(model, 0.0, Placement.single()) == pytest.approx(1.0, rel=1e-5)  # 0 = report only


def test_token_logprobs_alignment() -> None:
    logits = torch.log(torch.tensor([[[0.25, 0.75], [0.5, 0.5], [0.1, 0.9]]]))
    out = token_logprobs(logits, torch.tensor([[0, 1, 0]]))
    np.testing.assert_allclose(out.numpy(), [[0.0, math.log(0.75), math.log(0.5)]], rtol=1e-6)
