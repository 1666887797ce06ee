"""Train/rollout mismatch: how far the trainer's log-probs are from the behaviour log-probs the
rollout engine recorded, per token.

The two differ for two reasons: staleness (a partial rollout's tokens were sampled by older policy
versions) and numerics (the rollout engine's kernels, batch shapes and precision are not the
trainer's). RL losses correct for both with truncated importance weights; the statistics here are
logged every step so a growing gap is seen before it breaks training.

Sign convention: log_ratio = train_logp - rollout_logp = log(pi_train / pi_rollout), on tokens
sampled from pi_rollout.
"""

from __future__ import annotations

import torch


def _check(train_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> None:
    if train_logp.shape != rollout_logp.shape or mask.shape != train_logp.shape:
        raise ValueError(
            f"train_logp, rollout_logp and mask must share a shape; got {tuple(train_logp.shape)}, "
            f"{tuple(rollout_logp.shape)}, {tuple(mask.shape)}"
        )


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of values where mask is set; 0 when the mask is empty."""
    mask = mask.bool()
    total = torch.where(mask, values, torch.zeros_like(values)).sum()
    return total / mask.sum().clamp(min=1)


def log_ratio(train_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, T] log(pi_train / pi_rollout) on masked tokens, 0 elsewhere (no gradient)."""
    _check(train_logp, rollout_logp, mask)
    dtype = torch.promote_types(train_logp.dtype, torch.float32)
    delta = train_logp.detach().to(dtype) - rollout_logp.detach().to(dtype)
    return torch.where(mask.bool(), delta, torch.zeros_like(delta))


def truncated_importance_weights(
    train_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, cap: float
) -> torch.Tensor:
    """Truncated importance sampling (TIS) weights, [B, T], no gradient:
        w_t = min(exp(train_logp_t - rollout_logp_t), cap)  on masked tokens, 0 elsewhere.
    Truncation bounds the variance a token sampled by a now-unlikely behaviour policy could add;
    the bias it costs is confined to tokens whose ratio exceeds `cap`.
    """
    if cap <= 0:
        raise ValueError(f"importance-weight cap must be > 0, got {cap}")
    weights = torch.exp(log_ratio(train_logp, rollout_logp, mask)).clamp(max=cap)
    return torch.where(mask.bool(), weights, torch.zeros_like(weights))


def mismatch_stats(
    train_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, cap: float
) -> dict[str, float]:
    """Statistics of the per-token log-ratio d_t = train_logp_t - rollout_logp_t on masked tokens.

    Keys:
        log_ratio_mean, log_ratio_abs_mean, log_ratio_abs_max: of d_t.
        truncated_fraction: share of tokens with exp(d_t) > cap.
        is_weight_mean: mean truncated weight min(exp(d_t), cap).
        kl_k1, kl_k3: estimates of KL(pi_rollout || pi_train) from tokens sampled by pi_rollout:
            k1 = -d_t (unbiased, can be negative); k3 = exp(d_t) - 1 - d_t (unbiased, >= 0).
        num_tokens: masked tokens counted.
    """
    d = log_ratio(train_logp, rollout_logp, mask)
    mask = mask.bool()
    num = int(mask.sum())
    if num == 0:
        keys = (
            "log_ratio_mean",
            "log_ratio_abs_mean",
            "log_ratio_abs_max",
            "truncated_fraction",
            "is_weight_mean",
            "kl_k1",
            "kl_k3",
        )
        return {**dict.fromkeys(keys, 0.0), "num_tokens": 0.0}
    ratio = torch.exp(d)
    return {
        "log_ratio_mean": float(masked_mean(d, mask)),
        "log_ratio_abs_mean": float(masked_mean(d.abs(), mask)),
        "log_ratio_abs_max": float(d.abs()[mask].max()),
        "truncated_fraction": float(masked_mean((ratio > cap).float(), mask)),
        "is_weight_mean": float(masked_mean(ratio.clamp(max=cap), mask)),
        "kl_k1": float(masked_mean(-d, mask)),
        "kl_k3": float(masked_mean(ratio - 1 - d, mask)),
        "num_tokens": float(num),
    }


def staleness_stats(
    policy_version: torch.Tensor, current_version: int, mask: torch.Tensor
) -> dict[str, float]:
    """How many policy versions old each trained token is (partial rollouts resume under newer
    policies). policy_version: [B, T] version that sampled each token (Sample.policy_version).
    Keys: staleness_mean, staleness_max, stale_fraction (tokens older than current_version)."""
    if policy_version.shape != mask.shape:
        raise ValueError(f"policy_version {tuple(policy_version.shape)} and mask {tuple(mask.shape)} differ")
    mask = mask.bool()
    if not mask.any():
        return {"staleness_mean": 0.0, "staleness_max": 0.0, "stale_fraction": 0.0}
    age = (current_version - policy_version).float()
    if (age[mask] < 0).any():
        raise ValueError(
            f"tokens carry policy versions newer than the current version {current_version}; "
            "the trainer's version counter and the engine's are out of step"
        )
    return {
        "staleness_mean": float(masked_mean(age, mask)),
        "staleness_max": float(age[mask].max()),
        "stale_fraction": float(masked_mean((age > 0).float(), mask)),
    }
