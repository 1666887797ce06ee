"""SiTU-GLU forward and backward as one Triton kernel each, for CUDA tensors.

On a GPU the composed op is a dozen elementwise launches per pass, each reading and writing the
widest activations of the model in float32 (the routed experts' [tokens x k, I] in every MoE layer):
the chain, not the matmuls, dominated the expert time. These kernels read gate and up once, compute
in float32 and write the result in the input dtype; backward recomputes the branches from the
saved inputs, as `fused.situ_glu` does. Tested against `naive_situ_glu` on the GPU (`gpu` tests).
"""

from __future__ import annotations

import torch

try:  # Triton ships with CUDA builds of torch, not with the CPU build
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:
    triton = None

_BLOCK = 2048

if triton is not None:

    @triton.jit
    def _branches(g, u, beta, linear_beta, HAS_LINEAR_BETA: tl.constexpr):
        t = libdevice.tanh(g / beta)
        s = 1.0 / (1.0 + libdevice.exp(-g))
        a = beta * t * s
        da = (1.0 - t * t) * s + beta * t * s * (1.0 - s)
        if HAS_LINEAR_BETA:
            tu = libdevice.tanh(u / linear_beta)
            b = linear_beta * tu
            db = 1.0 - tu * tu
        else:
            b = u
            db = tl.full(u.shape, 1.0, tl.float32)
        return a, da, b, db

    @triton.jit
    def _forward(
        g_ptr, u_ptr, out_ptr, n, beta, linear_beta, HAS_LINEAR_BETA: tl.constexpr, BLOCK: tl.constexpr
    ):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        a, _, b, _ = _branches(g, u, beta, linear_beta, HAS_LINEAR_BETA)
        tl.store(out_ptr + offs, (a * b).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _backward(
        g_ptr,
        u_ptr,
        go_ptr,
        dg_ptr,
        du_ptr,
        n,
        beta,
        linear_beta,
        HAS_LINEAR_BETA: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        go = tl.load(go_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        a, da, b, db = _branches(g, u, beta, linear_beta, HAS_LINEAR_BETA)
        tl.store(dg_ptr + offs, (go * b * da).to(dg_ptr.dtype.element_ty), mask=mask)
        tl.store(du_ptr + offs, (go * a * db).to(du_ptr.dtype.element_ty), mask=mask)


def triton_available(gate: torch.Tensor) -> bool:
    """True for CUDA tensors in float32/bf16/fp16 when Triton is installed."""
    return (
        triton is not None and gate.is_cuda and gate.dtype in (torch.float32, torch.bfloat16, torch.float16)
    )


def _grid(n: int) -> tuple[int]:
    return (-(-n // _BLOCK),)


def situ_glu_forward(
    gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float | None
) -> torch.Tensor:
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate)
    n = gate.numel()
    if n:
        _forward[_grid(n)](gate, up, out, n, beta, linear_beta or 1.0, linear_beta is not None, BLOCK=_BLOCK)
    return out


def situ_glu_backward(
    gate: torch.Tensor, up: torch.Tensor, grad_out: torch.Tensor, beta: float, linear_beta: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    gate, up, grad_out = gate.contiguous(), up.contiguous(), grad_out.contiguous()
    dg, du = torch.empty_like(gate), torch.empty_like(up)
    n = gate.numel()
    if n:
        _backward[_grid(n)](
            gate, up, grad_out, dg, du, n, beta, linear_beta or 1.0, linear_beta is not None, BLOCK=_BLOCK
        )
    return dg, du
