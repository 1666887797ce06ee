"""MOPD reward (posttrain.algos.mopd_reward, a pure tensor function of the engine rather than a reward
plug-in): the spec's sign examples, clip bounds, stop-gradient, masking of non-student tokens, and
the batch helper the `mopd` stage applies to its trajectories."""

import math

import pytest
import torch

from posttrain.algos import (
    exact_reverse_kl,
    mopd_token_rewards,
    paired_change_standard_error,
    reverse_kl,
    token_mean_standard_error,
)
from posttrain.algos.mopd_reward import NonFiniteLogprobError
from posttrain.algos.policy_loss import policy_loss
from posttrain.data.sample import Sample
from posttrain.trainers.mopd import token_rewards


def test_spec_sign_examples():
    teacher = torch.log(torch.tensor([[0.6, 0.05]], dtype=torch.float64))
    student = torch.log(torch.tensor([[0.2, 0.2]], dtype=torch.float64))
    r = mopd_token_rewards(teacher, student, torch.ones(1, 2), r_max=5.0)
    assert r[0, 0].item() == pytest.approx(math.log(3.0), rel=1e-12)  # +1.0986...
    assert r[0, 1].item() == pytest.approx(math.log(0.25), rel=1e-12)  # -1.3863...
    assert round(r[0, 0].item(), 2) == 1.10 and round(r[0, 1].item(), 2) == -1.39


def test_clip_bounds():
    teacher = torch.tensor([[-0.01, -12.0, -1.0, -3.0, float("-inf")]])
    student = torch.tensor([[-9.0, -0.5, -1.0, -1.0, -0.3]])
    r = mopd_token_rewards(teacher, student, torch.ones(1, 5), r_max=2.0)
    torch.testing.assert_close(r, torch.tensor([[2.0, -2.0, 0.0, -2.0, -2.0]]))
    with pytest.raises(ValueError, match="r_max must be > 0"):
        mopd_token_rewards(teacher, student, torch.ones(1, 5), r_max=0.0)


def test_no_gradient_reaches_teacher_or_student_through_the_reward():
    teacher = torch.tensor([[-0.5, -2.0, -1.0]], requires_grad=True)
    student = torch.tensor([[-1.0, -1.0, -1.5]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0]])
    r = mopd_token_rewards(teacher, student, mask, r_max=3.0)
    assert r.grad_fn is None and not r.requires_grad
    # used as the policy loss's per-token advantage, the only gradient is the policy gradient
    # through the student's log-probs: -r_t / n on sampled tokens; the teacher gets none
    out = policy_loss(student, student.detach(), r, mask)
    out.loss.backward()
    assert teacher.grad is None
    torch.testing.assert_close(student.grad, torch.tensor([[-0.5 / 2, 1.0 / 2, 0.0]]))


def test_prompt_and_tool_result_tokens_get_zero_whatever_their_logprobs():
    teacher = torch.tensor([[float("nan"), -1.0, -0.2, float("-inf"), -0.7]])
    student = torch.tensor([[0.0, -2.0, -0.4, 0.0, -0.7]])
    mask = torch.tensor([[0, 1, 1, 0, 1]])  # prompt, gen, gen, tool result, gen
    r = mopd_token_rewards(teacher, student, mask, r_max=5.0)
    torch.testing.assert_close(r, torch.tensor([[0.0, 1.0, 0.2, 0.0, 0.0]]))


def test_nan_on_a_sampled_token_is_an_error():
    teacher = torch.tensor([[-1.0, float("nan")]])
    with pytest.raises(ValueError, match=r"\[\[0, 1\]\]"):
        mopd_token_rewards(teacher, torch.zeros(1, 2), torch.ones(1, 2), r_max=1.0)


def test_sample_rewards_cover_only_student_tokens():
    s = Sample(uid="m", domain="agent", effort="low")
    s.append([5, 6, 7], generated=False)
    s.prompt_length = 3
    s.append([8, 9], generated=True, logprobs=[math.log(0.2), math.log(0.5)])
    s.append([10], generated=False)  # tool result
    s.append([11], generated=True, logprobs=[math.log(0.9)])
    s.teacher_logprobs = [None, -1.0, -1.0, math.log(0.6), math.log(0.5), -0.1, math.log(0.45)]
    short = Sample(uid="n", domain="agent", effort="low", prompt_length=1)
    short.append([5], generated=False)
    short.append([8], generated=True, logprobs=[math.log(0.5)])
    short.teacher_logprobs = [None, math.log(0.25)]
    rewards, mask = token_rewards([s, short], r_max=1.0)
    # log 0.6 - log 0.2 = log 3 is clipped at r_max = 1; log 0.45 - log 0.9 = log 0.5
    expected = [0.0, 0.0, 0.0, 1.0, 0.0, 0.0, math.log(0.5)]
    assert rewards[0].tolist() == pytest.approx(expected, abs=1e-12)
    assert rewards[1].tolist() == pytest.approx([0.0] * 5 + [0.0, math.log(0.5)], abs=1e-12)  # left-padded
    assert mask.tolist() == [[0, 0, 0, 1, 1, 0, 1], [0] * 6 + [1]]
    s.teacher_logprobs = None
    with pytest.raises(ValueError, match="sample m has no teacher_logprobs"):
        token_rewards([s], r_max=1.0)


def test_a_nan_log_prob_says_whether_the_student_diverged_or_the_teacher_failed():
    teacher, student = torch.tensor([[-1.0, -2.0]]), torch.tensor([[0.0, float("nan")]])
    with pytest.raises(
        NonFiniteLogprobError, match=r"NaN student log-prob .*\[\[0, 1\]\]: the student diverged"
    ) as error:
        mopd_token_rewards(teacher, student, torch.ones(1, 2), r_max=1.0)
    assert error.value.rows == [0] and "train.lr" in str(error.value)
    # the teacher's NaN names the teacher (its engine), not the student's learning rate
    teacher, student = torch.tensor([[-1.0, float("nan")]]), torch.tensor([[0.0, -1.0]])
    with pytest.raises(
        NonFiniteLogprobError,
        match=r"NaN teacher log-prob on sampled tokens at \[row, position\] \[\[0, 1\]\]",
    ):
        mopd_token_rewards(teacher, student, torch.ones(1, 2), r_max=1.0)


def test_reverse_kl_is_the_mean_student_minus_teacher_on_student_tokens():
    student = torch.tensor([[-1.0, -0.5, -2.0]])
    teacher = torch.tensor([[-3.0, -1.0, -2.5]])
    assert reverse_kl(student, teacher, torch.tensor([[0, 1, 1]])) == pytest.approx((0.5 + 0.5) / 2)
    assert reverse_kl(student, teacher, torch.zeros(1, 3)) == 0.0


def test_exact_reverse_kl_sums_the_student_weighted_log_ratio_over_the_vocabulary():
    student = torch.tensor([[0.5, 0.25, 0.25], [1.0, 0.0, 0.0], [0.2, 0.3, 0.5]]).log()
    teacher = torch.tensor([[0.25, 0.5, 0.25], [0.5, 0.25, 0.25], [0.2, 0.3, 0.5]]).log()
    kl = exact_reverse_kl(student, teacher)
    ln2 = math.log(2)
    # 0.5 ln 2 + 0.25 ln 0.5; a token the student never samples adds 0, not NaN; equal -> 0
    assert kl.tolist() == pytest.approx([0.5 * ln2 - 0.25 * ln2, ln2, 0.0], abs=1e-7)
    # it is the expectation of reverse_kl's one-draw estimate: enumerate the student's next token
    draws = [reverse_kl(student[0, v : v + 1], teacher[0, v : v + 1], torch.ones(1)) for v in range(3)]
    assert sum(p * d for p, d in zip(student[0].exp().tolist(), draws, strict=True)) == pytest.approx(
        float(kl[0])
    )


def test_token_mean_standard_error_clusters_tokens_by_episode():
    # sums 1, 3, 2 over 2, 2, 4 tokens: mean 6/8; residuals S - m N = -0.5, 1.5, -1.0
    se = token_mean_standard_error(torch.tensor([1.0, 3.0, 2.0]), torch.tensor([2, 2, 4]))
    assert se == pytest.approx(math.sqrt(3.5 * 3 / 2) / 8)
    # equal-length episodes: the standard error of the episodes' means, sd / sqrt(n)
    means = torch.tensor([0.1, 0.4, -0.2, 0.3], dtype=torch.float64)
    se = token_mean_standard_error(means * 5, torch.full((4,), 5))
    assert se == pytest.approx(float(means.std() / 2))
    with pytest.raises(ValueError, match="at least 2 episodes"):
        token_mean_standard_error(torch.tensor([1.0]), torch.tensor([3]))


def test_paired_change_standard_error_uses_the_episodes_differences():
    before_sums, before_tokens = torch.tensor([1.0, 3.0, 2.0]), torch.tensor([2, 2, 4])
    after_sums, after_tokens = torch.tensor([0.5, 2.0, 2.5]), torch.tensor([2, 3, 5])
    # before: mean 6/8, residuals -0.5, 1.5, -1.0 over 8 tokens; after: mean 5/10, residuals
    # -0.5, 0.5, 0.0 over 10 tokens; w = after/10 - before/8 per episode
    w = [-0.05 + 0.0625, 0.05 - 0.1875, 0.0 + 0.125]
    expected = math.sqrt(sum(x * x for x in w) * 3 / 2)
    se = paired_change_standard_error(before_sums, before_tokens, after_sums, after_tokens)
    assert se == pytest.approx(expected)
    # the same episodes unchanged: no change, no error; a constant shift of every episode's mean
    # moves every episode alike: no error either, however large the change
    assert paired_change_standard_error(before_sums, before_tokens, before_sums, before_tokens) == 0.0
    shifted = before_sums + 0.3 * before_tokens
    assert paired_change_standard_error(before_sums, before_tokens, shifted, before_tokens) == pytest.approx(
        0, abs=1e-6
    )
    # nothing before: the after estimate's own error
    alone = paired_change_standard_error(torch.zeros(3), before_tokens, after_sums, after_tokens)
    assert alone == pytest.approx(token_mean_standard_error(after_sums, after_tokens))
    with pytest.raises(ValueError, match="one entry each"):
        paired_change_standard_error(before_sums, before_tokens, after_sums[:2], after_tokens[:2])
    with pytest.raises(ValueError, match="at least 2 episodes"):
        paired_change_standard_error(before_sums[:1], before_tokens[:1], after_sums[:1], after_tokens[:1])
