"""Triton kernels for `fused.py`: a k-row weighted gather-sum and the combine's backward.

Both are memory-bound passes over [R, D] bf16 rows: each reads its rows once and writes once,
accumulating in float32. Tested against the torch twin in `fused.py` and the spec in `naive.py`
(on the GPU, and on the CPU under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch

from posttrain.ops.triton_support import triton_serves

try:  # Triton ships with CUDA builds of torch, not always with the CPU build
    import triton
    import triton.language as tl
except ImportError:
    triton = None

_BLOCK_D = 1024

if triton is not None:

    @triton.jit
    def _sum_rows_kernel(
        src_ptr,
        inverse_ptr,
        weight_ptr,
        out_ptr,
        D,
        K: tl.constexpr,
        HAS_WEIGHT: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        n = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        mask = cols < D
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for j in tl.static_range(K):
            row = tl.load(inverse_ptr + n * K + j).to(tl.int64)
            values = tl.load(src_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_WEIGHT:
                values = values * tl.load(weight_ptr + row).to(tl.float32)
            acc += values
        tl.store(out_ptr + n * D + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _scatter_grad_kernel(
        grad_ptr, y_ptr, weight_ptr, token_ptr, grad_y_ptr, grad_weight_ptr, D, BLOCK_D: tl.constexpr
    ):
        r = tl.program_id(0).to(tl.int64)
        n = tl.load(token_ptr + r).to(tl.int64)
        w = tl.load(weight_ptr + r).to(tl.float32)
        dot = tl.zeros([BLOCK_D], dtype=tl.float32)
        for start in range(0, D, BLOCK_D):
            cols = start + tl.arange(0, BLOCK_D)
            mask = cols < D
            go = tl.load(grad_ptr + n * D + cols, mask=mask, other=0.0).to(tl.float32)
            y = tl.load(y_ptr + r * D + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(grad_y_ptr + r * D + cols, (go * w).to(grad_y_ptr.dtype.element_ty), mask=mask)
            dot += go * y
        tl.store(grad_weight_ptr + r, tl.sum(dot, axis=0))


def available(t: torch.Tensor) -> bool:
    """The kernels take `t` (`posttrain.ops.triton_support`)."""
    return triton_serves(t)


def _block(D: int) -> int:
    return min(_BLOCK_D, triton.next_power_of_2(max(D, 16)))


def sum_rows(src: torch.Tensor, inverse: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    """out[n] = sum_j (weight[inverse[n, j]] or 1) * src[inverse[n, j]]; src [R, D] contiguous."""
    N, K = inverse.shape
    D = src.shape[1]
    out = src.new_empty(N, D)
    if N and D:
        block = _block(D)
        inverse = inverse.contiguous()
        has_weight = weight is not None
        _sum_rows_kernel[(N, triton.cdiv(D, block))](
            src, inverse, weight if has_weight else inverse, out, D, K=K, HAS_WEIGHT=has_weight, BLOCK_D=block
        )
    return out


def scatter_grad(
    grad: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, token: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The combine's backward: grad_y[r] = weight[r] * grad[token[r]] (y's dtype) and
    grad_weight[r] = <grad[token[r]], y[r]> (float32)."""
    R, D = y.shape
    grad_y = torch.empty_like(y)
    grad_weight = torch.empty(R, dtype=torch.float32, device=y.device)
    if R and D:
        _scatter_grad_kernel[(R,)](grad, y, weight, token, grad_y, grad_weight, D, BLOCK_D=_block(D))
    return grad_y, grad_weight
