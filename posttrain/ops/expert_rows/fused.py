"""The grouped MoE path's row gather and weighted combine as autograd ops that stay gathers.

Indexing (the spec, `naive.py`) has scattering backwards: x[token]'s gradient is an atomic
scatter-add over N x k rows, and putting the sorted outputs back in (token, choice) order before
summing the k choices writes every row twice. Both directions here are gathers: a token reads its k
sorted rows through `inverse` (the combine's forward, the gather's backward) and a sorted row reads
its token's row (the gather's forward, the combine's backward). The mixture weight is applied
inside the combine in float32 (no bf16 [R, D] product is materialised) and its gradient, a row dot
product, comes out of the same backward pass. On CUDA each pass is one Triton kernel
(`triton_rows`); elsewhere the same arithmetic runs as torch ops. Deterministic: no atomics.
"""

from __future__ import annotations

import torch

from posttrain.ops.expert_rows import triton_rows


def _sum_rows(src: torch.Tensor, inverse: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    """out[n] = sum_j w * src[inverse[n, j]] (w = weight[inverse[n, j]] or 1), float32 sum."""
    if triton_rows.available(src):
        return triton_rows.sum_rows(src, inverse, weight)
    acc = torch.promote_types(src.dtype, torch.float32)
    picked = src[inverse].to(acc)
    if weight is not None:
        picked = picked * weight[inverse][..., None].to(acc)
    return picked.sum(1).to(src.dtype)


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, token: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        return x.index_select(0, token)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        return _sum_rows(grad.contiguous(), inverse, None), None, None


class _CombineRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: torch.Tensor, weight: torch.Tensor, token: torch.Tensor, inverse: torch.Tensor):
        ctx.save_for_backward(y, weight, token)
        return _sum_rows(y, inverse, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        y, weight, token = ctx.saved_tensors
        grad = grad.contiguous()
        if triton_rows.available(y):
            grad_y, grad_weight = triton_rows.scatter_grad(grad, y, weight, token)
        else:
            acc = torch.promote_types(y.dtype, torch.float32)
            go = grad.index_select(0, token).to(acc)
            grad_y = (go * weight[:, None].to(acc)).to(y.dtype)
            grad_weight = (go * y.to(acc)).sum(-1)
        return grad_y, grad_weight.to(weight.dtype), None, None


def gather_rows(x: torch.Tensor, token: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """x [N, D] -> [R, D], row r = x[token[r]]; `naive_gather_rows`' value, a gather backward.

    Args:
        x: [N, D] token inputs. token: [R] long, each sorted row's token.
        inverse: [N, k] long, the sorted row of each (token, choice); R = N * k.
    """
    return _GatherRows.apply(x.contiguous(), token, inverse)


def combine_rows(
    y: torch.Tensor, weight: torch.Tensor, token: torch.Tensor, inverse: torch.Tensor
) -> torch.Tensor:
    """sum_j weight[inverse[n, j]] * y[inverse[n, j]] -> [N, D] in y's dtype (`naive_combine_rows`).

    Args:
        y: [R, D] expert outputs in sorted order. weight: [R] float32 mixture weights, same order.
        token: [R] long, each sorted row's token. inverse: [N, k] long, as in `gather_rows`.
    """
    return _CombineRows.apply(y.contiguous(), weight.contiguous(), token, inverse)
