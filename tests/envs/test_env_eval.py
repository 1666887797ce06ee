"""The held-out evaluation's statistics: standard errors of a mean and of a paired change, checked
against hand-computed values, and the refusal to pair evaluations of different episodes."""

from __future__ import annotations

import math

import pytest

from posttrain.envs.env_eval import (
    eval_family,
    mean_standard_error,
    paired_changes,
    paired_standard_error,
    summary,
)


def test_mean_standard_error_is_the_sample_sd_over_root_n():
    # values 0, 1, 1, 0: mean 0.5, sample variance 1/3, se sqrt(1/3 / 4)
    assert mean_standard_error([0.0, 1.0, 1.0, 0.0]) == pytest.approx(math.sqrt(1 / 12))
    assert mean_standard_error([3.0, 3.0, 3.0]) == 0.0
    assert mean_standard_error([1.0]) == 0.0 and mean_standard_error([]) == 0.0


def test_paired_error_is_the_error_of_the_differences_and_ignores_shared_difficulty():
    before = [0.0, 0.0, 1.0, 1.0, 0.0, 1.0]
    after = [1.0, 0.0, 1.0, 1.0, 1.0, 1.0]
    # differences 1, 0, 0, 0, 1, 0: mean 1/3, sample variance (4/9*2 + 1/9*4)/5 = 4/15
    assert paired_standard_error(before, after) == pytest.approx(math.sqrt(4 / 15 / 6))
    # a uniform shift has no error, although each evaluation's own error is large
    shifted = [b + 2.0 for b in before]
    assert paired_standard_error(before, shifted) == 0.0 and mean_standard_error(before) > 0
    with pytest.raises(ValueError, match="equal lengths"):
        paired_standard_error([1.0], [1.0, 2.0])


def test_paired_changes_and_summary_on_episode_rows():
    before = {"uid": ["a", "b", "c"], "reward": [0.0, 1.0, 0.0], "tokens": [10.0, 20.0, 30.0]}
    after = {"uid": ["a", "b", "c"], "reward": [1.0, 1.0, 0.0], "tokens": [12.0, 20.0, 25.0]}
    changes = paired_changes(before, after)
    assert changes["accuracy_change"] == pytest.approx(1 / 3)
    assert changes["mean_response_tokens_change"] == pytest.approx(-1.0)
    assert changes["accuracy_change_se"] == pytest.approx(paired_standard_error([0, 1, 0], [1, 1, 0]))
    assert changes["mean_response_tokens_change_se"] == pytest.approx(mean_standard_error([2.0, 0.0, -5.0]))
    stats = summary(after, "after")
    assert stats["accuracy_after"] == pytest.approx(2 / 3)
    assert stats["mean_response_tokens_se_after"] == pytest.approx(mean_standard_error([12.0, 20.0, 25.0]))
    with pytest.raises(ValueError, match="different episodes"):
        paired_changes(before, {**after, "uid": ["a", "b", "d"]})


def test_eval_family_reads_the_family_from_episode_and_group_uids():
    assert eval_family("eval/general/ordering-677fd05656/0") == "general/ordering"
    assert eval_family("eval/agent/order_total-0f3a170d35") == "agent/order_total"
