"""K3's bounded forget gate: g = lower_bound * sigmoid(exp(A_log) * (f + dt_bias)).

The bound keeps the cumulative log-decay of a 16-token chunk inside (-80, 0), which is what lets
`chunk_kda` use dense matmuls on both the diagonal and the off-diagonal tiles without overflow.
"""

from __future__ import annotations

import torch


def kda_gate(
    f: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    lower_bound: float = -5.0,
) -> torch.Tensor:
    """Map the forget projection to a per-channel log-decay in (lower_bound, 0).

    Args:
        f: [..., H * K] output of the low-rank forget projection.
        A_log: [H] per-head log of the gate's slope.
        dt_bias: [H * K] per-channel bias.
        lower_bound: the smallest log-decay a token can apply (K3: -5.0).

    Returns:
        g: [..., H, K] float32 natural-log decay.
    """
    H = A_log.shape[0]
    if f.shape[-1] % H != 0:
        raise ValueError(f"kda_gate: last dim of f ({f.shape[-1]}) is not a multiple of H={H}")
    K = f.shape[-1] // H
    z = (f.float() + dt_bias.float()).unflatten(-1, (H, K))
    return lower_bound * torch.sigmoid(A_log.float().exp()[:, None] * z)
