"""The per-token policy-gradient loss shared by RL and MOPD, with per-token regularisation that
keeps each update local when rollouts are stale (partial rollouts) or were sampled by an engine
whose numerics differ from the trainer's.

Three log-probs per token (docs/algorithms.md has the derivation and defaults):
  logp          pi_theta, the policy being optimised (carries the gradient);
  old_logp      pi_prox, the trainer's own policy before this optimisation step (recomputed, no
                gradient); the PPO trust region is measured against it;
  rollout_logp  pi_behav, what the rollout engine recorded while sampling (possibly several policy
                versions old, and from different kernels).
Loss per policy-generated token t:
  l_t = w_t * -min(rho_t A_t, clip(rho_t, 1 - eps_low, 1 + eps_high) A_t) + beta * pen(delta_t)
  rho_t = exp(logp - old_logp), w_t = min(exp(old_logp - rollout_logp), C) (truncated IS, detached),
  delta_t = logp - rollout_logp, pen = delta^2 / 2 ("sq") or exp(delta) - 1 - delta ("k3").
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from posttrain.algos.mismatch import masked_mean, truncated_importance_weights


class PolicyLossConfig(BaseModel):
    """Knobs of `policy_loss`; a trainer's stage config embeds this as is."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    clip_eps_low: float = Field(0.2, ge=0.0, lt=1.0, description="PPO clip below: rho >= 1 - eps_low")
    clip_eps_high: float = Field(0.2, ge=0.0, description="PPO clip above: rho <= 1 + eps_high")
    tis_cap: float = Field(
        2.0, gt=0.0, description="C: truncated importance weight min(pi_prox / pi_behav, C)"
    )
    penalty: Literal["sq", "k3", "none"] = Field(
        "sq", description="per-token log-ratio penalty: sq delta^2 / 2, k3 exp(delta) - 1 - delta, none"
    )
    penalty_coef: float = Field(0.1, ge=0.0, description="beta, the penalty's weight")
    reduction: Literal["mean", "sum"] = Field(
        "mean", description="mean over trained tokens or their sum (the policy step sums, then divides once)"
    )

    @model_validator(mode="after")
    def _penalty_consistent(self) -> PolicyLossConfig:
        if self.penalty == "none" and self.penalty_coef != 0.0:
            raise ValueError(
                f"penalty is 'none' but penalty_coef is {self.penalty_coef}; set penalty to 'sq' or 'k3', "
                "or penalty_coef to 0"
            )
        return self


class PolicyLoss(NamedTuple):
    """loss: scalar to backpropagate; num_tokens: trained tokens; stats: floats for logging."""

    loss: torch.Tensor
    num_tokens: torch.Tensor
    stats: dict[str, float]


def log_ratio_penalty(delta: torch.Tensor, kind: Literal["sq", "k3", "none"]) -> torch.Tensor:
    """Per-token penalty on delta = log pi_theta - log pi_behav: both are 0 at delta = 0 with zero
    slope there, so they leave on-policy tokens alone and grow with distance from the behaviour
    policy. "sq": delta^2 / 2 (gradient delta); "k3": exp(delta) - 1 - delta (gradient
    exp(delta) - 1), the k3 estimator of KL(pi_behav || pi_theta)."""
    if kind == "sq":
        return 0.5 * delta**2
    if kind == "k3":
        return torch.exp(delta) - 1 - delta
    return torch.zeros_like(delta)


def policy_loss(
    logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    old_logp: torch.Tensor | None = None,
    token_weights: torch.Tensor | None = None,
    config: PolicyLossConfig | None = None,
) -> PolicyLoss:
    """Per-token clipped policy-gradient loss with truncated importance correction and a per-token
    log-ratio penalty (formula in the module docstring).

    Args:
        logp: [B, T] log pi_theta of the sampled tokens (requires grad).
        rollout_logp: [B, T] behaviour log-probs recorded by the rollout engine.
        advantages: [B, T] per-token advantages: a trajectory advantage broadcast over its tokens
            (`token_advantages`) for RL, or the dense per-token reward for MOPD.
        mask: [B, T] 1 on policy-generated tokens (Sample.loss_mask after the prompt); prompt,
            tool-result and padding tokens are 0 and contribute nothing.
        old_logp: [B, T] log pi_prox recomputed by the trainer before this step. None means one
            optimisation step per batch: pi_prox = pi_theta (detached), so rho = 1, the clip never
            binds, and w_t = min(pi_theta / pi_behav, C).
        token_weights: [B, T] a non-negative weight on each token's loss (None: 1), e.g. MOPD's
            weighting that gives every (domain, effort) pair the same share of a step's loss.
        config: PolicyLossConfig (defaults when None).

    Returns:
        PolicyLoss(loss, num_tokens, stats) with stats keys pg_loss, penalty, clip_fraction (share
        of tokens whose gradient the clip removed), ratio_mean (rho), log_ratio_abs_mean
        (|log pi_theta - log pi_behav|), is_weight_mean, is_truncated_fraction, num_tokens.
    """
    cfg = config or PolicyLossConfig()
    shape = logp.shape
    for name, tensor in (("rollout_logp", rollout_logp), ("advantages", advantages), ("mask", mask)):
        if tensor.shape != shape:
            raise ValueError(f"policy_loss: {name} has shape {tuple(tensor.shape)}, logp has {tuple(shape)}")
    for name, optional in (("old_logp", old_logp), ("token_weights", token_weights)):
        if optional is not None and optional.shape != shape:
            raise ValueError(
                f"policy_loss: {name} has shape {tuple(optional.shape)}, logp has {tuple(shape)}"
            )
    mask = mask.bool()
    dtype = torch.promote_types(logp.dtype, torch.float32)
    logp = logp.to(dtype)
    rollout_logp = rollout_logp.detach().to(dtype)
    advantages = advantages.detach().to(dtype)
    prox = logp.detach() if old_logp is None else old_logp.detach().to(dtype)

    # Masked positions are made neutral before any exp or product: a NaN advantage or -inf
    # log-prob on a padding token would otherwise turn its zero gradient into NaN.
    zero = torch.zeros_like(logp)
    advantages = torch.where(mask, advantages, zero)
    ratio = torch.exp(torch.where(mask, logp - prox, zero))
    unclipped = -ratio * advantages
    clipped = -ratio.clamp(1 - cfg.clip_eps_low, 1 + cfg.clip_eps_high) * advantages
    pg = torch.maximum(unclipped, clipped)
    weights = truncated_importance_weights(prox, rollout_logp, mask, cfg.tis_cap)
    delta = torch.where(mask, logp - rollout_logp, zero)
    penalty = cfg.penalty_coef * log_ratio_penalty(delta, cfg.penalty)
    per_token = torch.where(mask, weights * pg + penalty, zero)
    if token_weights is not None:
        per_token = per_token * token_weights.detach().to(dtype)

    num_tokens = mask.sum()
    total = per_token.sum()
    loss = total if cfg.reduction == "sum" else total / num_tokens.clamp(min=1)
    with torch.no_grad():
        stats = {
            "pg_loss": float(masked_mean(weights * pg, mask)),
            "penalty": float(masked_mean(penalty, mask)),
            "clip_fraction": float(masked_mean((clipped > unclipped).float(), mask)),
            "ratio_mean": float(masked_mean(ratio, mask)),
            "log_ratio_abs_mean": float(masked_mean(delta.abs(), mask)),
            "is_weight_mean": float(masked_mean(weights, mask)),
            "is_truncated_fraction": float(
                masked_mean((torch.exp(prox - rollout_logp) > cfg.tis_cap).float(), mask)
            ),
            "num_tokens": float(num_tokens),
        }
    return PolicyLoss(loss, num_tokens, stats)
