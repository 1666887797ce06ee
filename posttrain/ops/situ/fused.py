"""SiTU-GLU as one autograd node that saves only its two inputs.

The naive composition keeps every intermediate (two tanh, one sigmoid, the products) alive for the
backward pass; on the widest activations of the model (the dense MLP, 33792 wide at full size) that
is several copies of the largest tensor per layer. This version recomputes them in backward from
`gate` and `up`, the same trade activation checkpointing makes, at the scale of one op. On CUDA
both passes are one Triton kernel each (`triton_glu`).
"""

from __future__ import annotations

import torch

from posttrain.ops.situ import triton_glu
from posttrain.ops.situ.naive import upcast


def _values(g: torch.Tensor, u: torch.Tensor, beta: float, linear_beta: float | None):
    """Forward values of both branches, the same arithmetic as `_branches` without the
    derivatives (on the CPU each is a pass over the widest activations)."""
    a = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    return a, u if linear_beta is None else linear_beta * torch.tanh(u / linear_beta)


def _branches(g: torch.Tensor, u: torch.Tensor, beta: float, linear_beta: float | None):
    """Forward values and derivatives of both branches (in the upcast dtype)."""
    t = torch.tanh(g / beta)
    s = torch.sigmoid(g)
    a = beta * t * s
    # d/dg [beta tanh(g/beta) sigmoid(g)] = (1 - t^2) s + beta t s (1 - s)
    da = (1.0 - t * t) * s + beta * t * s * (1.0 - s)
    if linear_beta is None:
        return a, da, u, torch.ones_like(u)
    tu = torch.tanh(u / linear_beta)
    return a, da, linear_beta * tu, 1.0 - tu * tu


class _SituGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, beta, linear_beta):
        ctx.save_for_backward(gate, up)
        ctx.beta, ctx.linear_beta = beta, linear_beta
        if triton_glu.triton_available(gate) and up.dtype == gate.dtype:
            return triton_glu.situ_glu_forward(gate, up, beta, linear_beta)
        a, b = _values(upcast(gate), upcast(up), beta, linear_beta)
        return (a * b).to(gate.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        gate, up = ctx.saved_tensors
        if triton_glu.triton_available(gate) and up.dtype == gate.dtype:
            return (*triton_glu.situ_glu_backward(gate, up, grad_out, ctx.beta, ctx.linear_beta), None, None)
        a, da, b, db = _branches(upcast(gate), upcast(up), ctx.beta, ctx.linear_beta)
        go = upcast(grad_out)
        return (go * b * da).to(gate.dtype), (go * a * db).to(up.dtype), None, None


def situ_glu(
    gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0, linear_beta: float | None = 25.0
) -> torch.Tensor:
    """SiTU-GLU with recompute-in-backward; same signature and values as `naive_situ_glu`.

    Args:
        gate, up: [..., I] gate and up projections (same shape and dtype).
        beta: `activation_situ_beta`; linear_beta: `activation_situ_linear_beta` or None.

    Returns:
        [..., I] in `gate`'s dtype.
    """
    return _SituGLU.apply(gate, up, float(beta), None if linear_beta is None else float(linear_beta))
