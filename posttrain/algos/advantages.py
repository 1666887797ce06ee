"""Advantages, the one thing RL and MOPD compute differently before the shared policy step.

RL: group-relative outcome advantages, each trajectory's reward measured against the other samples
of its prompt, so RL needs no value network (GRPO; RLOO for the leave-one-out baseline). MOPD:
per-token, the discounted return of the teacher log-ratio rewards (posttrain.algos.mopd_reward),
optionally centred on its group's (a (domain, effort) pair's) mean, with per-row weights that give
every group the same share of a step's loss. Tensors in, tensors out; [B, T] tensors are aligned
with the tokens and `mask` marks the generated ones.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch


def group_indices(group_ids: Sequence[Hashable] | torch.Tensor) -> tuple[torch.Tensor, int]:
    """Map arbitrary group ids (Sample.group strings, ints) to dense indices 0..G-1 in order of
    first appearance. Returns (index [N] int64, G)."""
    if isinstance(group_ids, torch.Tensor):
        group_ids = group_ids.tolist()
    dense: dict[Hashable, int] = {}
    index = [dense.setdefault(g, len(dense)) for g in group_ids]
    return torch.tensor(index, dtype=torch.long), len(dense)


def group_advantages(
    rewards: torch.Tensor,
    group_ids: Sequence[Hashable] | torch.Tensor,
    *,
    scale_by_std: bool = True,
    leave_one_out: bool = False,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Per-trajectory advantages relative to the trajectory's prompt group.

    With n_g samples in group g, mean m_g and unbiased standard deviation s_g:
        baseline b_i = m_g                                   (GRPO)
                     = (sum_{j in g} r_j - r_i) / (n_g - 1)  (leave_one_out, RLOO)
        A_i = r_i - b_i, then A_i / (s_g + eps) when scale_by_std.
    A group of one sample has no baseline: its advantage is 0. A group whose rewards are all
    equal gets 0 (nothing to learn from it), never a division blow-up.

    Args:
        rewards: [N] float scalar rewards (finite).
        group_ids: N hashable ids or an [N] tensor; equal ids share a group.
    Returns:
        [N] float32 advantages (no gradient).
    """
    rewards = rewards.detach().float()
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be [N], got shape {tuple(rewards.shape)}")
    if not torch.isfinite(rewards).all():
        bad = torch.nonzero(~torch.isfinite(rewards)).flatten().tolist()
        raise ValueError(f"rewards at indices {bad} are not finite; score every trajectory before advantages")
    index, num_groups = group_indices(group_ids)
    if index.numel() != rewards.numel():
        raise ValueError(f"{rewards.numel()} rewards but {index.numel()} group ids")
    index = index.to(rewards.device)
    count = torch.zeros(num_groups, device=rewards.device).index_add_(0, index, torch.ones_like(rewards))
    total = torch.zeros(num_groups, device=rewards.device).index_add_(0, index, rewards)
    n = count[index]
    mean = total[index] / n
    if leave_one_out:
        baseline = (total[index] - rewards) / (n - 1).clamp(min=1)
    else:
        baseline = mean
    advantages = torch.where(n > 1, rewards - baseline, torch.zeros_like(rewards))
    if scale_by_std:
        sq = torch.zeros(num_groups, device=rewards.device).index_add_(0, index, (rewards - mean) ** 2)
        std = (sq[index] / (n - 1).clamp(min=1)).sqrt()
        advantages = advantages / (std + eps)
    return advantages


def token_advantages(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Broadcast per-trajectory advantages [N] over tokens: [N, T], zero where mask is 0 (prompt,
    tool results, padding)."""
    if advantages.dim() != 1 or mask.dim() != 2 or mask.shape[0] != advantages.shape[0]:
        raise ValueError(
            f"token_advantages needs advantages [N] and mask [N,T]; got {tuple(advantages.shape)}, "
            f"{tuple(mask.shape)}"
        )
    return advantages.unsqueeze(1) * mask.to(advantages.dtype)


def returns_to_go(rewards: torch.Tensor, mask: torch.Tensor, discount: float) -> torch.Tensor:
    """[B, T] per generated token the discounted sum of the rewards of it and the later generated
    tokens, A_t = sum_{k >= t, mask_k} discount^(#generated tokens between) r_k; tokens with mask 0
    (prompt, tool results, padding) carry 0 and do not count as steps. 0 discount: A_t = r_t."""
    if rewards.shape != mask.shape or rewards.dim() != 2:
        raise ValueError(f"rewards {tuple(rewards.shape)} and mask {tuple(mask.shape)} must be one [B, T]")
    mask = mask.bool()
    out = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in range(rewards.shape[1] - 1, -1, -1):
        running = torch.where(mask[:, t], rewards[:, t] + discount * running, running)
        out[:, t] = torch.where(mask[:, t], running, torch.zeros_like(running))
    return out


def subtract_group_mean(
    advantages: torch.Tensor, mask: torch.Tensor, group_ids: Sequence[Hashable]
) -> torch.Tensor:
    """[B, T] each generated token's advantage minus the mean advantage over the generated tokens
    of its row's group (MOPD: the (domain, effort) pair); other tokens 0. E[b grad log p(y_t)] = 0
    for a b that does not depend on y_t, so the gradient's expectation is kept and the noise of
    the mean return (about -KL / (1 - discount), pushing every sampled token down) removed. The mean
    includes the token's own row, which shrinks that row's expected gradient by about (return
    horizon) / (the group's generated tokens)."""
    mask = mask.bool()
    index, num_groups = group_indices(group_ids)
    masked = torch.where(mask, advantages, torch.zeros_like(advantages))
    totals = torch.zeros(num_groups, dtype=advantages.dtype).index_add_(0, index, masked.sum(-1))
    counts = torch.zeros(num_groups, dtype=advantages.dtype).index_add_(
        0, index, mask.sum(-1).to(advantages.dtype)
    )
    means = totals / counts.clamp(min=1)
    return torch.where(mask, advantages - means[index, None], torch.zeros_like(advantages))


def group_balance_weights(mask: torch.Tensor, group_ids: Sequence[Hashable]) -> torch.Tensor:
    """[B] float64 per row total / (groups x its group's generated tokens): a token-mean loss
    weighted by these is the mean over groups of each group's token mean."""
    index, num_groups = group_indices(group_ids)
    tokens = torch.zeros(num_groups, dtype=torch.float64).index_add_(
        0, index, mask.bool().sum(-1).to(torch.float64)
    )
    return tokens.sum() / (num_groups * tokens.clamp(min=1))[index]
