"""Several bias-free projections of one input as one GEMM, for CUDA training forwards.

In a K3 layer one normed input feeds several projections: six in a KDA layer (q, k, v, the output
gate, the forget projection's first factor, beta), three in an MoE block (the latent down
projection and the shared experts' gate and up). Run one by one, each is a GEMM and, in backward,
an input-gradient GEMM whose results autograd sums with bf16 adds over [tokens, hidden]. Stacked,
the input is read once, the narrow projections ride in one wide GEMM and the input gradient is one
GEMM. The stack is concatenated from the modules' own weights each forward, so the released names
and per-module parameters stay; the concat is small beside the activations.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn


def stacked_projection(x: torch.Tensor, layers: Sequence[nn.Module]) -> torch.Tensor | None:
    """x through `layers` as one GEMM: [..., sum of out_features], the outputs side by side in
    order; None when a layer is not a plain bias-free nn.Linear holding its whole weight (a LoRA
    wrapper, a ZeRO-3-partitioned weight): such layers must run their own forward."""
    if not all(type(m) is nn.Linear and m.bias is None and not hasattr(m.weight, "ds_id") for m in layers):
        return None
    return F.linear(x, torch.cat([m.weight for m in layers]))


def stacks_projections(x: torch.Tensor) -> bool:
    """Whether a forward fed `x` stacks its projections: CUDA training forwards (grad enabled).
    Elsewhere the modules run one by one, which keeps CPU results and inference unchanged."""
    return x.is_cuda and torch.is_grad_enabled()
