"""The spec of K3's routed experts: one token and one chosen expert at a time.

out[n] = sum_j topk_weight[n, j] * w2[e] @ glu(w1[e] @ x[n], w3[e] @ x[n]), e = topk_idx[n, j],
with the input activations of each expert matmul passed through `act_quant` (the QAT hook; rows
are quantised independently, so quantising one row at a time is the same function). Slow on
purpose: `KimiK3Experts` (sorted rows, grouped GEMMs on GPU, one matmul per expert on CPU) is
tested against it, forward and gradients.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from posttrain.model.configuration_kimi_k3 import KimiK3Config
from posttrain.model.mlp import glu_activation


def naive_moe_experts(
    config: KimiK3Config,
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weight: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    act_quant: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """x [N, D], topk_idx/topk_weight [N, k], w1/w3 [E, I, D], w2 [E, D, I] -> [N, D]."""
    aq = act_quant or (lambda a: a)
    rows = []
    for n in range(x.shape[0]):
        xn = aq(x[n : n + 1])
        acc = torch.zeros_like(xn)
        for j in range(topk_idx.shape[1]):
            e = int(topk_idx[n, j])
            h = aq(glu_activation(config, xn @ w1[e].t(), xn @ w3[e].t()))
            acc = acc + topk_weight[n, j].to(x.dtype) * (h @ w2[e].t())
        rows.append(acc)
    return torch.cat(rows) if rows else x.new_zeros(x.shape)
