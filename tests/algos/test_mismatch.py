"""Mismatch statistics against hand-computed values and against the exact KL of a known pair of
distributions."""

import math

import pytest
import torch

from posttrain.algos.mismatch import mismatch_stats, staleness_stats, truncated_importance_weights


def test_stats_of_a_hand_example():
    train = torch.tensor([[0.0, -1.0, -2.0, -9.0]])
    rollout = torch.tensor([[0.0, -1.5, -0.5, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    d = [0.0, 0.5, -1.5]
    s = mismatch_stats(train, rollout, mask, cap=1.5)
    assert s["num_tokens"] == 3
    assert s["log_ratio_mean"] == pytest.approx(sum(d) / 3)
    assert s["log_ratio_abs_mean"] == pytest.approx(2.0 / 3)
    assert s["log_ratio_abs_max"] == pytest.approx(1.5)
    assert s["truncated_fraction"] == pytest.approx(1 / 3)  # exp(0.5) = 1.65 > 1.5
    assert s["is_weight_mean"] == pytest.approx((1.0 + 1.5 + math.exp(-1.5)) / 3)
    assert s["kl_k1"] == pytest.approx(-sum(d) / 3)
    assert s["kl_k3"] == pytest.approx(sum(math.exp(x) - 1 - x for x in d) / 3)


def test_k1_and_k3_recover_the_exact_kl_when_tokens_follow_the_rollout_distribution():
    # rollout distribution q = (1/2, 1/4, 1/4), train distribution p = (0.2, 0.3, 0.5); four tokens
    # in exact proportion to q stand in for the expectation over q
    q = [0.5, 0.25, 0.25]
    p = [0.2, 0.3, 0.5]
    outcomes = [0, 0, 1, 2]
    train = torch.log(torch.tensor([[p[i] for i in outcomes]], dtype=torch.float64))
    rollout = torch.log(torch.tensor([[q[i] for i in outcomes]], dtype=torch.float64))
    kl = sum(qi * math.log(qi / pi) for qi, pi in zip(q, p, strict=True))
    s = mismatch_stats(train, rollout, torch.ones(1, 4), cap=10.0)
    assert s["kl_k1"] == pytest.approx(kl, rel=1e-12)
    assert s["kl_k3"] == pytest.approx(kl, rel=1e-12)


def test_truncated_weights():
    train = torch.log(torch.tensor([[0.9, 0.2, 0.5]]))
    rollout = torch.log(torch.tensor([[0.3, 0.4, 0.5]]))
    w = truncated_importance_weights(train, rollout, torch.tensor([[1, 1, 0]]), cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.5, 0.0]]))
    with pytest.raises(ValueError, match="cap must be > 0"):
        truncated_importance_weights(train, rollout, torch.ones(1, 3), cap=0.0)
    with pytest.raises(ValueError, match="share a shape"):
        truncated_importance_weights(train, rollout[:, :2], torch.ones(1, 3), cap=2.0)


def test_empty_mask_gives_zero_stats():
    s = mismatch_stats(torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 3), cap=2.0)
    assert all(v == 0.0 for v in s.values())


def test_staleness():
    versions = torch.tensor([[-1, 3, 3, 5], [-1, -1, 5, 5]])
    mask = versions >= 0
    s = staleness_stats(versions, current_version=5, mask=mask)
    assert s == {
        "staleness_mean": pytest.approx(4 / 5),
        "staleness_max": 2.0,
        "stale_fraction": pytest.approx(2 / 5),
    }
    with pytest.raises(ValueError, match="newer than the current version 4"):
        staleness_stats(versions, current_version=4, mask=mask)
