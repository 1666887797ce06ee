"""policy_loss against a token-by-token loop written from docs/algorithms.md, values and gradients,
plus the properties each term exists for."""

import math

import pytest
import torch
from pydantic import ValidationError

from posttrain.algos.policy_loss import PolicyLossConfig, policy_loss


def naive_policy_loss(logp, rollout, adv, mask, old, cfg: PolicyLossConfig) -> torch.Tensor:
    terms = []
    B, T = logp.shape
    for b in range(B):
        for t in range(T):
            if not mask[b, t]:
                continue
            lp = logp[b, t]
            prox = lp.detach() if old is None else old[b, t]
            rho = torch.exp(lp - prox)
            a = adv[b, t]
            clipped_rho = torch.clamp(rho, 1 - cfg.clip_eps_low, 1 + cfg.clip_eps_high)
            surrogate = torch.minimum(rho * a, clipped_rho * a)
            w = min(math.exp(float(prox - rollout[b, t])), cfg.tis_cap)
            d = lp - rollout[b, t]
            if cfg.penalty == "sq":
                pen = d**2 / 2
            elif cfg.penalty == "k3":
                pen = torch.exp(d) - 1 - d
            else:
                pen = torch.zeros(())
            terms.append(-w * surrogate + cfg.penalty_coef * pen)
    return torch.stack(terms).mean()


def random_inputs(seed: int, B: int = 3, T: int = 9):
    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    old = rollout + 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64)
    logp = (old + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)).requires_grad_(True)
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) > 0.3
    return logp, rollout, adv, mask, old


@pytest.mark.parametrize("penalty,coef", [("sq", 0.3), ("k3", 0.7), ("none", 0.0)])
@pytest.mark.parametrize("with_old", [True, False])
def test_matches_the_token_loop_in_value_and_gradient(penalty, coef, with_old):
    cfg = PolicyLossConfig(
        clip_eps_low=0.2, clip_eps_high=0.28, tis_cap=1.5, penalty=penalty, penalty_coef=coef
    )
    logp, rollout, adv, mask, old = random_inputs(11)
    old = old if with_old else None
    out = policy_loss(logp, rollout, adv, mask, old_logp=old, config=cfg)
    (grad,) = torch.autograd.grad(out.loss, logp)
    ref_logp = logp.detach().clone().requires_grad_(True)
    ref = naive_policy_loss(ref_logp, rollout, adv, mask, old, cfg)
    (ref_grad,) = torch.autograd.grad(ref, ref_logp)
    assert out.loss.item() == pytest.approx(ref.item(), rel=1e-10)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-12)
    assert int(out.num_tokens) == int(mask.sum())


def test_on_policy_step_is_plain_policy_gradient():
    logp = torch.tensor([[-1.0, -2.0, -0.5, -3.0]], requires_grad=True)
    adv = torch.tensor([[0.0, 1.5, -2.0, 4.0]])
    mask = torch.tensor([[0, 1, 1, 0]])
    out = policy_loss(logp, logp.detach(), adv, mask)
    out.loss.backward()
    # rho = 1, w = 1, delta = 0: loss = -mean(A), dloss/dlogp = -A / n on trained tokens
    assert out.loss.item() == pytest.approx(-(1.5 - 2.0) / 2)
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -0.75, 1.0, 0.0]]))
    assert out.stats["clip_fraction"] == 0.0
    assert out.stats["ratio_mean"] == pytest.approx(1.0)
    assert out.stats["penalty"] == 0.0
    assert out.stats["is_weight_mean"] == pytest.approx(1.0)


def test_clip_removes_the_gradient_only_where_the_ratio_left_the_trust_region_favourably():
    old = torch.zeros(1, 4)
    # ratios 1.5 (A>0: clipped), 0.5 (A>0: not clipped, min keeps the unclipped term),
    # 0.5 (A<0: clipped), 1.5 (A<0: not clipped)
    logp = torch.log(torch.tensor([[1.5, 0.5, 0.5, 1.5]])).requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    cfg = PolicyLossConfig(penalty="none", penalty_coef=0.0)
    out = policy_loss(logp, old, adv, torch.ones(1, 4), old_logp=old, config=cfg)
    out.loss.backward()
    # d(-rho*A)/dlogp = -rho*A, averaged over 4 tokens
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -0.5 / 4, 0.0, 1.5 / 4]]))
    assert out.stats["clip_fraction"] == pytest.approx(0.5)
    assert out.stats["ratio_mean"] == pytest.approx(1.0)


def test_truncated_importance_weight_caps_stale_tokens():
    rollout = torch.log(torch.tensor([[0.1, 0.4]]))
    old = torch.log(torch.tensor([[0.5, 0.2]]))  # pi_prox / pi_behav = 5.0 and 0.5
    logp = old.clone().requires_grad_(True)
    adv = torch.ones(1, 2)
    cfg = PolicyLossConfig(tis_cap=2.0, penalty="none", penalty_coef=0.0)
    out = policy_loss(logp, rollout, adv, torch.ones(1, 2), old_logp=old, config=cfg)
    out.loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-2.0 / 2, -0.5 / 2]]))
    assert out.loss.item() == pytest.approx(-(2.0 + 0.5) / 2)
    assert out.stats["is_truncated_fraction"] == pytest.approx(0.5)
    assert out.stats["is_weight_mean"] == pytest.approx(1.25)


@pytest.mark.parametrize("penalty", ["sq", "k3"])
def test_penalty_pulls_back_towards_the_behaviour_policy(penalty):
    rollout = torch.tensor([[-1.0, -1.0, -1.0]])
    logp = torch.tensor([[-1.0, -0.5, -1.7]], requires_grad=True)
    cfg = PolicyLossConfig(penalty=penalty, penalty_coef=0.4)
    out = policy_loss(logp, rollout, torch.zeros(1, 3), torch.ones(1, 3), config=cfg)
    out.loss.backward()
    delta = torch.tensor([0.0, 0.5, -0.7])
    slope = delta if penalty == "sq" else torch.exp(delta) - 1
    torch.testing.assert_close(logp.grad, 0.4 * slope.unsqueeze(0) / 3)
    # descending the gradient moves logp towards rollout_logp on both sides, not at all at delta 0
    assert logp.grad[0, 0] == 0 and logp.grad[0, 1] > 0 and logp.grad[0, 2] < 0
    assert out.stats["log_ratio_abs_mean"] == pytest.approx(1.2 / 3)


def test_masked_tokens_contribute_nothing():
    logp, rollout, adv, mask, old = random_inputs(12)
    out = policy_loss(logp, rollout, adv, mask, old_logp=old)
    (grad,) = torch.autograd.grad(out.loss, logp)
    assert torch.count_nonzero(grad[~mask]) == 0
    adv2, rollout2, old2 = adv.clone(), rollout.clone(), old.clone()
    adv2[~mask] = float("nan")
    rollout2[~mask] = float("-inf")
    old2[~mask] = -1e4
    for penalty, coef in (("sq", 0.1), ("k3", 0.1)):
        cfg = PolicyLossConfig(penalty=penalty, penalty_coef=coef)
        ref = policy_loss(logp, rollout, adv, mask, old_logp=old, config=cfg)
        again = policy_loss(logp, rollout2, adv2, mask, old_logp=old2, config=cfg)
        (grad2,) = torch.autograd.grad(again.loss, logp)
        assert again.loss.item() == ref.loss.item()
        assert torch.isfinite(grad2).all() and torch.count_nonzero(grad2[~mask]) == 0
        assert all(math.isfinite(v) for v in again.stats.values())


def test_sum_reduction_accumulates_to_the_mean():
    logp, rollout, adv, mask, old = random_inputs(13, B=4)
    full = policy_loss(logp, rollout, adv, mask, old_logp=old)
    cfg = PolicyLossConfig(reduction="sum")
    parts = [
        policy_loss(
            logp[i : i + 2],
            rollout[i : i + 2],
            adv[i : i + 2],
            mask[i : i + 2],
            old_logp=old[i : i + 2],
            config=cfg,
        )
        for i in (0, 2)
    ]
    total = sum(p.loss for p in parts) / sum(p.num_tokens for p in parts)
    assert total.item() == pytest.approx(full.loss.item(), rel=1e-12)


def test_config_and_shape_errors():
    with pytest.raises(ValidationError, match="penalty_coef"):
        PolicyLossConfig(penalty="none", penalty_coef=0.1)
    with pytest.raises(ValidationError, match="tis_cap"):
        PolicyLossConfig(tis_cap=0.0)
    with pytest.raises(ValidationError, match="extra"):
        PolicyLossConfig(clip_eps=0.2)
    logp, rollout, adv, mask, _ = random_inputs(14)
    with pytest.raises(ValueError, match="advantages has shape"):
        policy_loss(logp, rollout, adv[:, :-1], mask)


def test_token_weights_scale_each_tokens_loss_and_gradient():
    logp, rollout, adv, mask, old = random_inputs(15)
    cfg = PolicyLossConfig(reduction="sum", penalty="k3", penalty_coef=0.5)
    weights = torch.rand(logp.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 3
    out = policy_loss(logp, rollout, adv, mask, old_logp=old, token_weights=weights, config=cfg)
    (grad,) = torch.autograd.grad(out.loss, logp)
    # the token loop, each masked token's term (sum reduction: the loop's mean times its count) weighted
    ref_logp = logp.detach().clone().requires_grad_(True)
    ref = sum(
        weights[b, t] * naive_policy_loss(ref_logp[b : b + 1, t : t + 1], rollout[b : b + 1, t : t + 1],
                                          adv[b : b + 1, t : t + 1], mask[b : b + 1, t : t + 1],
                                          old[b : b + 1, t : t + 1], cfg)
        for b in range(logp.shape[0]) for t in range(logp.shape[1]) if mask[b, t]
    )  # fmt: skip
    (ref_grad,) = torch.autograd.grad(ref, ref_logp)
    assert out.loss.item() == pytest.approx(ref.item(), rel=1e-10)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-12)
    with pytest.raises(ValueError, match="token_weights has shape"):
        policy_loss(logp, rollout, adv, mask, token_weights=weights[:, :-1])
