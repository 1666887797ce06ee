"""The spec of SiTU-GLU, K3's bounded replacement for SwiGLU, written as plain tensor algebra.

`out = beta * tanh(gate / beta) * sigmoid(gate) * linear_beta * tanh(up / linear_beta)`: both factors
are soft-clipped, so |out| < beta * linear_beta (100 at K3's 4 and 25), while near zero it is SwiGLU.
This matches vLLM's `SituAndMul.forward_native` (`beta` defaults to 1 there; `linear_beta=None`
leaves `up` unclipped). The faster `situ_glu` is tested against this function.
"""

from __future__ import annotations

import torch


def upcast(x: torch.Tensor) -> torch.Tensor:
    """x in float32, or float64 if it already is (lets gradcheck run in double precision)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def naive_situ_glu(
    gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0, linear_beta: float | None = 25.0
) -> torch.Tensor:
    """SiTU-GLU of two equally shaped tensors, computed in float32 and returned in `gate`'s dtype.

    Args:
        gate: [..., I] output of the gate projection.
        up: [..., I] output of the up projection.
        beta: soft cap of the gate branch (`activation_situ_beta`).
        linear_beta: soft cap of the linear branch (`activation_situ_linear_beta`); None: no cap.

    Returns:
        [..., I] activations.
    """
    g = upcast(gate)
    u = upcast(up)
    g = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    if linear_beta is not None:
        u = linear_beta * torch.tanh(u / linear_beta)
    return (g * u).to(gate.dtype)
