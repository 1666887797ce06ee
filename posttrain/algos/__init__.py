"""Pure tensor functions the trainers share: the SFT loss, group-relative advantages, the per-token
policy loss with its staleness regularisation, train/rollout mismatch accounting, and the MOPD
log-ratio reward with the reverse KL it estimates (sampled, and exact from full distributions).

No loops, no I/O, no model: each function maps tensors to tensors so it can be tested exactly.
"""

from posttrain.algos.advantages import group_advantages, token_advantages
from posttrain.algos.mismatch import mismatch_stats, staleness_stats, truncated_importance_weights
from posttrain.algos.mopd_reward import (
    exact_reverse_kl,
    mopd_token_rewards,
    paired_change_standard_error,
    reverse_kl,
    token_mean_standard_error,
)
from posttrain.algos.policy_loss import PolicyLoss, PolicyLossConfig, policy_loss
from posttrain.algos.sft import SFTLoss, sft_loss

__all__ = [
    "PolicyLoss",
    "PolicyLossConfig",
    "SFTLoss",
    "exact_reverse_kl",
    "group_advantages",
    "mismatch_stats",
    "mopd_token_rewards",
    "paired_change_standard_error",
    "policy_loss",
    "reverse_kl",
    "sft_loss",
    "staleness_stats",
    "token_mean_standard_error",
    "token_advantages",
    "truncated_importance_weights",
]
