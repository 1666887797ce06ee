"""Block Attention Residual mix as one autograd node that keeps O(S) scalars per token.

Stacking the S sources into a float32 tensor (what the naive spec does) stores an extra [S, ..., D]
copy per sublayer for the backward pass: 2 L of them over the model, which undoes the O(N d) memory
that blocking buys. Here the scores come from `(x . (w * q)) * rsqrt(mean(x^2) + eps)` (the RMSNorm is
never materialised, as in vLLM's kernel), the mix is accumulated source by source, and backward keeps
only the softmax weights and reciprocal RMS values ([S, ...] each) next to the sources it was given.
With `compile_regions` on (`posttrain.ops.fusion`), `mix_by_sources`, the same computation
written for autograd, runs under torch.compile instead: inductor fuses it, forward and backward.
Where Triton serves the tensors (CUDA, or TRITON_INTERPRET=1 in tests), `triton_mix` runs this
node's passes as one kernel each, ahead of both: inductor's split of the mix re-reads the sources.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from posttrain.ops.attn_res import triton_mix
from posttrain.ops.attn_res.naive import upcast
from posttrain.ops.fusion import compiled, use_compiled


class _AttnResMix(torch.autograd.Function):
    @staticmethod
    def forward(ctx, norm_weight, query, eps, *sources):
        u = upcast(norm_weight) * upcast(query)
        dim = sources[0].shape[-1]
        rstd = torch.stack([torch.rsqrt(upcast(s).pow(2).sum(-1) / dim + eps) for s in sources])
        logits = torch.stack([(upcast(s) @ u) for s in sources]) * rstd
        weights = torch.softmax(logits, dim=0)
        out = torch.zeros_like(upcast(sources[0]))
        for i, s in enumerate(sources):
            out = out + weights[i].unsqueeze(-1) * upcast(s)
        ctx.save_for_backward(norm_weight, query, weights, rstd, *sources)
        return out.to(sources[-1].dtype)

    @staticmethod
    def backward(ctx, grad_out):
        norm_weight, query, weights, rstd, *sources = ctx.saved_tensors
        g = upcast(grad_out)
        u = upcast(norm_weight) * upcast(query)
        dim = sources[0].shape[-1]
        grad_p = torch.stack([(g * upcast(s)).sum(-1) for s in sources])
        grad_logit = weights * (grad_p - (weights * grad_p).sum(0, keepdim=True))
        grad_u = torch.zeros_like(u)
        grads = []
        for i, s in enumerate(sources):
            x = upcast(s)
            r = rstd[i].unsqueeze(-1)
            dl = grad_logit[i].unsqueeze(-1)
            xu = (x @ u).unsqueeze(-1)
            # d logit / d x = u r - (x . u) r^3 x / D
            gx = weights[i].unsqueeze(-1) * g + dl * (u * r - xu * r.pow(3) * x / dim)
            grads.append(gx.to(s.dtype))
            grad_u = grad_u + (dl * r * x).reshape(-1, dim).sum(0)
        grad_w = (grad_u * upcast(query)).to(norm_weight.dtype)
        grad_q = (grad_u * upcast(norm_weight)).to(query.dtype)
        return (grad_w, grad_q, None, *grads)


def mix_by_sources(
    sources: Sequence[torch.Tensor], norm_weight: torch.Tensor, query: torch.Tensor, eps: float
) -> torch.Tensor:
    """The mix source by source, differentiated by autograd: the region torch.compile fuses. The
    scores are elementwise products summed (a matmul would run in bf16 under autocast)."""
    u = upcast(norm_weight) * upcast(query)
    logits = torch.stack(
        [(upcast(s) * u).sum(-1) * torch.rsqrt(upcast(s).pow(2).mean(-1) + eps) for s in sources]
    )
    weights = torch.softmax(logits, dim=0)
    out = weights[0].unsqueeze(-1) * upcast(sources[0])
    for i in range(1, len(sources)):
        out = out + weights[i].unsqueeze(-1) * upcast(sources[i])
    return out.to(sources[-1].dtype)


def attn_res_mix(
    sources: Sequence[torch.Tensor],
    norm_weight: torch.Tensor,
    query: torch.Tensor,
    eps: float = 1e-5,
    compile_regions: bool | None = False,
) -> torch.Tensor:
    """Block Attention Residual mix; same arguments, values and gradients as `naive_attn_res`.

    Args:
        sources: S tensors [..., D] (embedding, completed blocks, current running sum last).
        norm_weight: [D] RMSNorm weight; query: [D] scoring vector; eps: RMSNorm epsilon.
        compile_regions: the config key of `posttrain.ops.fusion` (compiled `mix_by_sources`).

    Returns:
        [..., D] in the dtype of the last source.
    """
    if len(sources) == 1:
        # One source: the softmax weight is exactly 1 (vLLM short-circuits the same way).
        return sources[0]
    if triton_mix.available(sources, norm_weight, query):
        return triton_mix.TritonAttnResMix.apply(norm_weight, query, float(eps), *sources)
    if use_compiled(compile_regions, sources[0]):
        return compiled(mix_by_sources)(tuple(sources), norm_weight, query, float(eps))
    return _AttnResMix.apply(norm_weight, query, float(eps), *sources)
