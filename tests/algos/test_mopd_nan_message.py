"""A NaN in MOPD's log-ratio reward says whose log-prob it is: the student's (it diverged: the fix is
the learning rate) or the teacher's (its engine)."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.algos.mopd_reward import mopd_token_rewards


def test_nan_student_logprobs_say_the_student_diverged() -> None:
    teacher = torch.zeros(2, 3)
    student = torch.zeros(2, 3)
    student[1, 2] = math.nan
    mask = torch.ones(2, 3)
    with pytest.raises(
        ValueError, match=r"NaN student log-prob on sampled tokens at \[row, position\] \[\[1, 2\]\]"
    ) as caught:
        mopd_token_rewards(teacher, student, mask, r_max=5.0)
    assert "the student diverged" in str(caught.value) and "train.lr" in str(caught.value)
    teacher[0, 1], student[1, 2] = math.nan, 0.0
    with pytest.raises(
        ValueError, match=r"NaN teacher log-prob on sampled tokens at \[row, position\] \[\[0, 1\]\]"
    ):
        mopd_token_rewards(teacher, student, mask, r_max=5.0)
