"""The token exchange of expert parallelism: an all-to-all with uneven splits that autograd sees.

Every rank sends a variable number of rows to every other rank (the (token, choice) pairs routed to
that rank's experts) and receives a variable number back, so the split sizes are data and have to be
exchanged first (`exchange_counts`). The backward of a dispatch is the same exchange run the other
way: the gradient of row j sent to rank d comes back from d in the position d received it, so
`AllToAll.backward` is the forward with the two split lists swapped. `torch.distributed`'s gloo
backend runs `all_to_all_single` with uneven splits on CPU tensors (torch 2.13), which is what the
CPU tests use; NCCL runs the same call on GPUs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup


def exchange_counts(send_counts: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """send_counts [R] int64 (rows this rank sends to each rank of the group) -> recv_counts [R]
    (rows each rank of the group sends to this one). One all-to-all of R integers."""
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts.contiguous(), group=group)
    return recv_counts


def all_to_all_rows(
    x: torch.Tensor, recv_splits: list[int], send_splits: list[int], group: ProcessGroup
) -> torch.Tensor:
    """x [sum(send_splits), ...] -> [sum(recv_splits), ...], no autograd: rows send_splits[d] go to
    rank d of the group, rows from rank s arrive in block s of the output, in the order s sent them."""
    out = x.new_empty((sum(recv_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
    return out


class AllToAll(torch.autograd.Function):
    """`all_to_all_rows` whose backward is the reverse exchange (the gradient goes back to the rank
    and row it came from). Every rank of the group must run the backward too: it is a collective."""

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, recv_splits: list[int], send_splits: list[int], group: ProcessGroup
    ) -> torch.Tensor:
        ctx.recv_splits, ctx.send_splits, ctx.group = recv_splits, send_splits, group
        return all_to_all_rows(x, recv_splits, send_splits, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return all_to_all_rows(grad, ctx.send_splits, ctx.recv_splits, ctx.group), None, None, None
