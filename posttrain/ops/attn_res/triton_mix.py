"""The Block Attention Residual mix as one Triton kernel forward and one backward.

Under torch.compile (`fused.mix_by_sources`) inductor splits a mix into reductions and pointwise
passes that each re-read the S sources (forward + backward ran at ~1.8 TB/s of the traffic lower
bound on an H200, these kernels at ~2.6-2.9 TB/s: bench/attn_res_gpu.py). Here a program
takes a row and makes two passes over D in chunks: the first reduces each source's row
(sum of squares, dot with u; in backward also the dot with grad_out), the second writes (the mix,
or each source's gradient). The second pass re-reads rows the same program read a moment before,
so DRAM sees each source and grad_out about once. Arithmetic in float32, as in `fused._AttnResMix`,
which is the spec of these kernels; backward keeps what it keeps (sources, weights and rstd [S, M]).
grad_u is summed per program (a run of rows) into a private [programs, D] float32 row, then over programs by
torch: deterministic, no atomics. The S sources travel as a tuple of pointers (each its own dtype).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from posttrain.ops.triton_support import triton_serves

try:  # Triton ships with CUDA builds of torch, not always with the CPU build
    import triton
    import triton.language as tl
except ImportError:
    triton = None

# Widest chunk of D a program holds per source (a module setting so tests can force several chunks).
MAX_BLOCK_D = 2048

if triton is not None:

    @triton.jit
    def _column(values, src, i):
        """values[:, i] of a [rows, S_PAD] tile (i is a compile-time source index)."""
        return tl.sum(tl.where(src == i, values, 0.0), 1)

    @triton.jit
    def _forward_kernel(
        xs, u_ptr, out_ptr, w_ptr, r_ptr, M, D, eps,
        S: tl.constexpr, S_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < M
        base = rows.to(tl.int64)[:, None] * D
        src = tl.arange(0, S_PAD)[None, :]
        sum_sq = tl.zeros([BLOCK_M, S_PAD], tl.float32)
        dot_u = tl.zeros([BLOCK_M, S_PAD], tl.float32)
        for start in range(0, D, BLOCK_D):
            cols = start + tl.arange(0, BLOCK_D)
            mask = row_ok[:, None] & (cols < D)[None, :]
            u = tl.load(u_ptr + cols, mask=cols < D, other=0.0)[None, :]
            for i in tl.static_range(S):
                x = tl.load(xs[i] + base + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                sum_sq += tl.where(src == i, tl.sum(x * x, 1)[:, None], 0.0)
                dot_u += tl.where(src == i, tl.sum(x * u, 1)[:, None], 0.0)
        rstd = tl.rsqrt(sum_sq / D + eps)
        logit = tl.where(src < S, dot_u * rstd, float("-inf"))
        weight = tl.exp(logit - tl.max(logit, 1)[:, None])
        weight = weight / tl.sum(weight, 1)[:, None]
        at = src.to(tl.int64) * M + rows[:, None]  # [S, M] layout, as _AttnResMix saves them
        tl.store(w_ptr + at, weight, mask=row_ok[:, None] & (src < S))
        tl.store(r_ptr + at, rstd, mask=row_ok[:, None] & (src < S))
        for start in range(0, D, BLOCK_D):
            cols = start + tl.arange(0, BLOCK_D)
            mask = row_ok[:, None] & (cols < D)[None, :]
            acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
            for i in tl.static_range(S):
                x = tl.load(xs[i] + base + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                acc += _column(weight, src, i)[:, None] * x
            tl.store(out_ptr + base + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _backward_kernel(
        xs, gxs, g_ptr, u_ptr, w_ptr, r_ptr, gu_ptr, M, D, rows_per_program,
        S: tl.constexpr, S_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        first = pid * rows_per_program
        end = tl.minimum(first + rows_per_program, M)
        src = tl.arange(0, S_PAD)[None, :]
        gu_row = gu_ptr + pid.to(tl.int64) * D  # this program's private partial sum of grad_u
        for block in range(first, end, BLOCK_M):
            rows = block + tl.arange(0, BLOCK_M)
            row_ok = rows < end
            base = rows.to(tl.int64)[:, None] * D
            at = src.to(tl.int64) * M + rows[:, None]
            # Rows past the end get weight 0, hence zero coefficients and no grad_u contribution.
            weight = tl.load(w_ptr + at, mask=row_ok[:, None] & (src < S), other=0.0)
            rstd = tl.load(r_ptr + at, mask=row_ok[:, None] & (src < S), other=0.0)
            dot_g = tl.zeros([BLOCK_M, S_PAD], tl.float32)
            dot_u = tl.zeros([BLOCK_M, S_PAD], tl.float32)
            for start in range(0, D, BLOCK_D):
                cols = start + tl.arange(0, BLOCK_D)
                mask = row_ok[:, None] & (cols < D)[None, :]
                u = tl.load(u_ptr + cols, mask=cols < D, other=0.0)[None, :]
                g = tl.load(g_ptr + base + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                for i in tl.static_range(S):
                    x = tl.load(xs[i] + base + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                    dot_g += tl.where(src == i, tl.sum(g * x, 1)[:, None], 0.0)
                    dot_u += tl.where(src == i, tl.sum(x * u, 1)[:, None], 0.0)
            grad_logit = weight * (dot_g - tl.sum(weight * dot_g, 1)[:, None])
            # gx_i = w_i g + b_i u - c_i x_i, from d logit / d x = u r - (x . u) r^3 x / D
            coef_u = grad_logit * rstd
            coef_x = coef_u * dot_u * rstd * rstd / D
            for start in range(0, D, BLOCK_D):
                cols = start + tl.arange(0, BLOCK_D)
                mask = row_ok[:, None] & (cols < D)[None, :]
                u = tl.load(u_ptr + cols, mask=cols < D, other=0.0)[None, :]
                g = tl.load(g_ptr + base + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                grad_u = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
                for i in tl.static_range(S):
                    x = tl.load(xs[i] + base + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                    b = _column(coef_u, src, i)[:, None]
                    gx = _column(weight, src, i)[:, None] * g + b * u - _column(coef_x, src, i)[:, None] * x
                    tl.store(gxs[i] + base + cols[None, :], gx.to(gxs[i].dtype.element_ty), mask=mask)
                    grad_u += b * x
                partial = tl.load(gu_row + cols, mask=cols < D, other=0.0) + tl.sum(grad_u, 0)
                tl.store(gu_row + cols, partial, mask=cols < D)


def available(sources: Sequence[torch.Tensor], *params: torch.Tensor) -> bool:
    """The kernels take these tensors (`posttrain.ops.triton_support`); tracing under
    torch.compile keeps the torch paths."""
    return triton_serves(*sources, *params) and not torch.compiler.is_compiling()


def _tiles(D: int, S: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_D): one row of up to MAX_BLOCK_D columns of every source per step keeps the
    rows a program re-reads in its second pass few enough to still be in L1/L2."""
    return 1, min(MAX_BLOCK_D, triton.next_power_of_2(max(D, 16)))


def _num_warps(block_d: int) -> int:
    # 4 warps over a 2048-wide row beat 8 on the H200 (S = 5: forward 166 vs 195 us, backward 349
    # vs 416 us at M = 16384): more rows in flight per SM for the same registers.
    return max(1, min(4, block_d // 256))


def mix_forward(
    xs: Sequence[torch.Tensor], u: torch.Tensor, eps: float, out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """xs: S contiguous [M, D]; u: float32 [D] -> (out [M, D] out_dtype, weights [S, M], rstd [S, M])."""
    M, D = xs[0].shape
    S = len(xs)
    out = torch.empty(M, D, dtype=out_dtype, device=xs[0].device)
    weights = torch.empty(S, M, dtype=torch.float32, device=xs[0].device)
    rstd = torch.empty_like(weights)
    if M and D:
        block_m, block_d = _tiles(D, S)
        _forward_kernel[(triton.cdiv(M, block_m),)](
            tuple(xs), u, out, weights, rstd, M, D, eps,
            S=S, S_PAD=triton.next_power_of_2(S), BLOCK_M=block_m, BLOCK_D=block_d,
            num_warps=_num_warps(block_d),
        )  # fmt: skip
    return out, weights, rstd


@functools.cache
def _sm_count(index: int) -> int:
    # Cached: the launch, not the GPU, bounds a mix's time when the step waits on Python.
    return torch.cuda.get_device_properties(index).multi_processor_count


def _programs(M: int, block_m: int, device: torch.device) -> int:
    """Backward programs: a few per SM, each over a contiguous run of rows (fewer partial rows of
    grad_u to sum than one program per row block)."""
    blocks = triton.cdiv(M, block_m)
    if device.type != "cuda":
        return min(blocks, 3)  # the interpreter: still several programs, each over several blocks
    return min(
        blocks, 8 * _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    )


def mix_backward(
    xs: Sequence[torch.Tensor], g: torch.Tensor, u: torch.Tensor, weights: torch.Tensor, rstd: torch.Tensor
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """-> (grad of each source [M, D] in its dtype, grad_u float32 [D])."""
    M, D = xs[0].shape
    S = len(xs)
    gxs = [torch.empty_like(x) for x in xs]
    if not (M and D):
        return gxs, u.new_zeros(D)
    block_m, block_d = _tiles(D, S)
    programs = _programs(M, block_m, g.device)
    rows_per_program = triton.cdiv(triton.cdiv(M, programs), block_m) * block_m
    programs = triton.cdiv(M, rows_per_program)
    partial = torch.zeros(programs, D, dtype=torch.float32, device=g.device)
    _backward_kernel[(programs,)](
        tuple(xs), tuple(gxs), g, u, weights, rstd, partial, M, D, rows_per_program,
        S=S, S_PAD=triton.next_power_of_2(S), BLOCK_M=block_m, BLOCK_D=block_d,
        num_warps=_num_warps(block_d),
    )  # fmt: skip
    return gxs, partial.sum(0)


class TritonAttnResMix(torch.autograd.Function):
    """`fused._AttnResMix` with its passes as the two kernels above; the same saved tensors."""

    @staticmethod
    def forward(ctx, norm_weight, query, eps, *sources):
        D = sources[0].shape[-1]
        u = norm_weight.float() * query.float()
        xs = [s.reshape(-1, D).contiguous() for s in sources]
        out, weights, rstd = mix_forward(xs, u, eps, sources[-1].dtype)
        ctx.save_for_backward(norm_weight, query, weights, rstd, *sources)
        return out.view(sources[-1].shape)

    @staticmethod
    def backward(ctx, grad_out):
        norm_weight, query, weights, rstd, *sources = ctx.saved_tensors
        D = sources[0].shape[-1]
        u = norm_weight.float() * query.float()
        xs = [s.reshape(-1, D).contiguous() for s in sources]
        gxs, grad_u = mix_backward(xs, grad_out.reshape(-1, D).contiguous(), u, weights, rstd)
        grads = [gx.view(s.shape) for gx, s in zip(gxs, sources, strict=True)]
        grad_w = (grad_u * query.float()).to(norm_weight.dtype)
        grad_q = (grad_u * norm_weight.float()).to(query.dtype)
        return (grad_w, grad_q, None, *grads)
