"""The SFT objective: next-token cross-entropy on the tokens the loss mask trains.

Kept apart from the trainer so the same numbers come out whether a batch is padded, packed into
one row with document boundaries, or split over gradient-accumulation micro-batches.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F


class SFTLoss(NamedTuple):
    """loss: scalar (mean or sum over trained tokens); num_tokens: trained tokens (int64 scalar)."""

    loss: torch.Tensor
    num_tokens: torch.Tensor


def _at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def sft_loss(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    reduction: Literal["mean", "sum"] = "mean",
    cu_seqlens: torch.Tensor | None = None,
) -> SFTLoss:
    """Next-token cross-entropy: logits at position t predict tokens[t + 1], trained where
    loss_mask[t + 1] is 1 (the mask marks the tokens to learn, as the chat renderer emits it).

    Args:
        logits: [B, T, V] model outputs, any float dtype; the loss is computed in at least fp32.
        tokens: [B, T] int token ids.
        loss_mask: [B, T] 1/0 (or bool): 1 on tokens that are trained as targets.
        reduction: "mean" divides by the number of trained tokens in this batch; "sum" returns the
            token sum so gradient accumulation over packed or uneven micro-batches can divide once
            by the total count (sum_i loss_i / sum_i num_tokens_i), giving every token equal weight.
        cu_seqlens: [N + 1] cumulative document lengths of a packed row (B == 1). The first token
            of each document is never a target: the previous document's last position does not
            predict it.

    Returns:
        SFTLoss(loss, num_tokens). With no trained token the loss is 0 and still attached to the
        graph, so a distributed step where one rank has nothing to train does not hang.
    """
    if logits.dim() != 3 or tokens.shape != logits.shape[:2] or loss_mask.shape != tokens.shape:
        raise ValueError(
            f"sft_loss needs logits [B,T,V], tokens [B,T], loss_mask [B,T]; got "
            f"{tuple(logits.shape)}, {tuple(tokens.shape)}, {tuple(loss_mask.shape)}"
        )
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    target_mask = loss_mask[:, 1:].bool()
    if cu_seqlens is not None:
        if tokens.shape[0] != 1:
            raise ValueError(f"cu_seqlens describes one packed row (B == 1), got B = {tokens.shape[0]}")
        starts = cu_seqlens[1:-1].to(tokens.device)
        boundary = torch.zeros(tokens.shape[1], dtype=torch.bool, device=tokens.device)
        boundary[starts[starts < tokens.shape[1]]] = True
        target_mask = target_mask & ~boundary[1:].unsqueeze(0)
    per_token = F.cross_entropy(
        _at_least_fp32(logits[:, :-1]).transpose(1, 2), tokens[:, 1:].long(), reduction="none"
    )
    total = torch.where(target_mask, per_token, torch.zeros_like(per_token)).sum()
    num_tokens = target_mask.sum()
    if reduction == "sum":
        return SFTLoss(total, num_tokens)
    return SFTLoss(total / num_tokens.clamp(min=1), num_tokens)
