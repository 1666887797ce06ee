"""The spec of one Block Attention Residual mix, written the obvious way.

Before each attention and each MLP sublayer K3 replaces the plain residual stream by a softmax-weighted
mix of its sources (the token embedding, every completed block's sum, the running sum of the current
block). Each source is RMS-normalised (with a learned weight, vLLM's `*_res_norm`) and dotted with a
learned per-sublayer vector (`*_res_proj`, zero-initialised so the first mix is uniform); the softmax
over sources and the mix run in float32. The memory-lean `attn_res_mix` is tested against this.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def upcast(x: torch.Tensor) -> torch.Tensor:
    """x in float32, or float64 if it already is (lets gradcheck run in double precision)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def naive_attn_res(
    sources: Sequence[torch.Tensor],
    norm_weight: torch.Tensor,
    query: torch.Tensor,
    eps: float = 1e-5,
) -> torch.Tensor:
    """Mix `sources` by softmax(RMSNorm(source) . query) over the source axis.

    Args:
        sources: S tensors of equal shape [..., D]; the last one is the current block's running sum.
        norm_weight: [D] weight of the RMSNorm applied to each source before scoring.
        query: [D] learned scoring vector of this sublayer.
        eps: RMSNorm epsilon.

    Returns:
        [..., D] mix in the dtype of the last source.
    """
    values = torch.stack([upcast(s) for s in sources])  # [S, ..., D]
    normed = values * torch.rsqrt(values.pow(2).mean(-1, keepdim=True) + eps) * upcast(norm_weight)
    weights = torch.softmax(normed @ upcast(query), dim=0)  # [S, ...]
    return (weights.unsqueeze(-1) * values).sum(0).to(sources[-1].dtype)
