"""pass@k (Chen et al. 2021's unbiased estimator) and the evaluation summary, by hand on tiny cases."""

from __future__ import annotations

import pytest

from earl_stream.evaluation.passk import EpisodeOutcome, pass_at_k, summarize


def test_pass_at_k_by_hand() -> None:
    # n = 3 samples, c = 1 correct: pass@1 = 1/3; pass@2 = 1 - C(2,2)/C(3,2) = 2/3; pass@3 = 1
    assert pass_at_k(3, 1, 1) == pytest.approx(1 / 3)
    assert pass_at_k(3, 1, 2) == pytest.approx(2 / 3)
    assert pass_at_k(3, 1, 3) == 1.0
    # n = 4, c = 2: pass@2 = 1 - C(2,2)/C(4,2) = 5/6
    assert pass_at_k(4, 2, 2) == pytest.approx(5 / 6)
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 4, 1) == 1.0
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 4)


def _ep(item: int, sample: int, ok: bool, reward: float, version: int = 0) -> EpisodeOutcome:
    return EpisodeOutcome(item, sample, reward, ok, "correct" if ok else "wrong", 5, version)


def test_summary_of_two_items() -> None:
    # item 0: 1 of 3 correct; item 1: 3 of 3 correct
    eps = [_ep(0, 0, True, 1.0), _ep(0, 1, False, 0.0), _ep(0, 2, False, 0.5, version=2),
           _ep(1, 0, True, 1.0), _ep(1, 1, True, 1.0), _ep(1, 2, True, 1.0, version=1)]
    s = summarize(eps)
    assert (s.problems, s.samples, s.episodes) == (2, 3, 6)
    assert s.success == pytest.approx(4 / 6)
    assert s.pass_at_k == pytest.approx({1: (1 / 3 + 1) / 2, 2: (2 / 3 + 1) / 2, 3: 1.0})
    assert s.mean_reward == pytest.approx(4.5 / 6)
    assert s.outcomes == {"correct": 4, "wrong": 2}
    assert s.versions == (0, 2) and s.generated_tokens == 30
    assert s.to_dict()["pass_at_k"]["1"] == pytest.approx(2 / 3)


def test_summary_refuses_ragged_samples() -> None:
    with pytest.raises(ValueError, match="different numbers of samples"):
        summarize([_ep(0, 0, True, 1.0), _ep(1, 0, True, 1.0), _ep(1, 1, False, 0.0)])
