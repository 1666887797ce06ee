"""Group-relative advantages against the GRPO / RLOO definitions computed with `statistics`."""

import statistics

import pytest
import torch

from posttrain.algos.advantages import group_advantages, token_advantages


def test_grpo_advantage_is_reward_minus_group_mean_over_unbiased_std():
    rewards = [1.0, 0.0, 0.0, 1.0, 0.2, 0.8, 0.5]
    groups = ["a", "a", "a", "a", "b", "b", "b"]
    out = group_advantages(torch.tensor(rewards), groups, eps=0.0)
    for i, (r, g) in enumerate(zip(rewards, groups, strict=True)):
        members = [x for x, h in zip(rewards, groups, strict=True) if h == g]
        expected = (r - statistics.mean(members)) / statistics.stdev(members)
        assert out[i].item() == pytest.approx(expected, rel=1e-6)


def test_mean_only_advantage():
    out = group_advantages(torch.tensor([3.0, 1.0, 2.0, 10.0]), [0, 0, 1, 1], scale_by_std=False)
    torch.testing.assert_close(out, torch.tensor([1.0, -1.0, -4.0, 4.0]))


def test_leave_one_out_baseline_excludes_the_sample_itself():
    rewards = [1.0, 2.0, 3.0, 6.0]
    out = group_advantages(torch.tensor(rewards), ["p"] * 4, scale_by_std=False, leave_one_out=True)
    expected = [r - (sum(rewards) - r) / 3 for r in rewards]
    torch.testing.assert_close(out, torch.tensor(expected))
    assert out[0].item() == pytest.approx(-8 / 3)


def test_interleaved_groups_do_not_mix():
    rewards = torch.tensor([0.0, 5.0, 1.0, 7.0])
    out = group_advantages(rewards, ["x", "y", "x", "y"], scale_by_std=False)
    torch.testing.assert_close(out, torch.tensor([-0.5, -1.0, 0.5, 1.0]))


def test_singleton_and_constant_groups_get_zero():
    out = group_advantages(torch.tensor([4.0, 1.0, 1.0, 1.0]), ["solo", "c", "c", "c"])
    torch.testing.assert_close(out, torch.zeros(4))
    loo = group_advantages(torch.tensor([4.0]), ["solo"], leave_one_out=True)
    torch.testing.assert_close(loo, torch.zeros(1))


def test_tensor_group_ids_equal_string_ids():
    rewards = torch.tensor([0.3, 0.9, 0.1, 0.4, 0.4])
    a = group_advantages(rewards, torch.tensor([7, 7, 2, 2, 2]))
    b = group_advantages(rewards, ["g7", "g7", "g2", "g2", "g2"])
    torch.testing.assert_close(a, b)


def test_advantages_carry_no_gradient():
    rewards = torch.tensor([1.0, 0.0], requires_grad=True)
    assert group_advantages(rewards, [0, 0]).grad_fn is None


def test_non_finite_rewards_are_refused_by_index():
    with pytest.raises(ValueError, match=r"indices \[1\]"):
        group_advantages(torch.tensor([1.0, float("nan")]), [0, 0])
    with pytest.raises(ValueError, match="2 rewards but 3 group ids"):
        group_advantages(torch.tensor([1.0, 0.0]), [0, 0, 1])


def test_token_advantages_broadcast_under_the_mask():
    adv = torch.tensor([2.0, -1.0])
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 1, 1]])
    out = token_advantages(adv, mask)
    torch.testing.assert_close(out, torch.tensor([[0.0, 2.0, 2.0, 0.0], [0.0, 0.0, -1.0, -1.0]]))
    with pytest.raises(ValueError, match="advantages \\[N\\] and mask \\[N,T\\]"):
        token_advantages(adv, mask[:1])
