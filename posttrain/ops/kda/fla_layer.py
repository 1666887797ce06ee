"""KDA's whole token-mixing core on fla's fused kernels, for CUDA training forwards.

From the q|k|v projections, the forget projection and the beta logits to the recurrence output,
our layer runs a short conv + SiLU + l2norm region, the bounded gate, a sigmoid and then
`chunk_kda`: each an extra pass over [B, T, H, K] activations in float32, forward and backward
(profiled on an H200: about 2.5 ms a layer against 0.3 for the traffic they need). fla fuses the
same arithmetic into its kernels: `causal_conv1d` applies the SiLU, and `chunk_kda` computes q/k
l2norm (`use_qk_l2norm_in_kernel`), K3's bounded gate `lower_bound * sigmoid(exp(A_log) * (f +
dt_bias))` (`use_gate_in_kernel` with `safe_gate`) and beta's sigmoid inside the chunk kernels, with
their gradients. The unfused path (posttrain.model.kda) stays the spec: padding masks, caches and
the CPU use it, and the `gpu` tests compare the two, forward and every gradient.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from posttrain.ops.kda.chunk import GATE_LOWER_BOUND, _fla_chunk_kda


@functools.cache
def _fla_causal_conv1d() -> Callable | None:
    try:
        from fla.modules.causal_conv1d import causal_conv1d
    except ImportError:
        return None
    return causal_conv1d


def fla_layer_available(x: torch.Tensor) -> bool:
    """fla's fused kernels can take this input (a CUDA tensor, fla installed)."""
    return x.is_cuda and _fla_chunk_kda() is not None and _fla_causal_conv1d() is not None


def fla_kda_core(
    qkv: torch.Tensor,
    conv_weight: torch.Tensor,
    f: torch.Tensor,
    beta_logits: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    num_heads: int,
    lower_bound: float,
) -> torch.Tensor:
    """The recurrence output of one KDA layer without a cache, padding or packing (fla's varlen
    kernels are not yet checked against the unfused path on a GPU).

    Args:
        qkv: [B, T, 3 H K] the q|k|v projections. conv_weight: [3 H K, W] their depthwise taps.
        f: [B, T, H K] the forget projection (before dt_bias and the gate).
        beta_logits: [B, T, H] b_proj's output (before the sigmoid).
        A_log: [H]; dt_bias: [H K]; lower_bound: the gate's floor (K3: -5; fla's safe range [-5, 0)).

    Returns:
        o: [B, T, H, K] in qkv's dtype.
    """
    causal_conv1d, chunk_kda = _fla_causal_conv1d(), _fla_chunk_kda()
    if not GATE_LOWER_BOUND <= lower_bound < 0:
        raise ValueError(f"fla's bounded gate needs -5 <= lower_bound < 0, got {lower_bound}")
    B, T, C = qkv.shape
    K = C // (3 * num_heads)
    y, _ = causal_conv1d(qkv, weight=conv_weight.to(qkv.dtype), activation="silu")
    q, k, v = y.view(B, T, 3, num_heads, K).unbind(2)
    o, _ = chunk_kda(
        q,
        k,
        v,
        f.view(B, T, num_heads, K),
        beta_logits,
        use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True,
        safe_gate=True,
        lower_bound=lower_bound,
        A_log=A_log,
        dt_bias=dt_bias,
    )
    return o.to(qkv.dtype)
