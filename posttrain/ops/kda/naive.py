"""The spec of Kimi Delta Attention: a token-by-token recurrence, slow and obviously right.

Every faster KDA path (`chunk_kda`, `fused_recurrent_kda`, fla's Triton kernels) is tested against
this function, forward and gradients.
"""

from __future__ import annotations

import torch


def naive_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA by its definition, one step per token.

    Per head, with state S in R^{K x V}:
        S_t = Diag(exp(g_t)) S_{t-1}                      (channel-wise decay)
        S_t = S_t + beta_t k_t (v_t - S_t^T k_t)^T        (delta rule: write only the error)
        o_t = S_t^T (scale * q_t)

    Args:
        q, k: [B, T, H, K]. Callers L2-normalise them (the K3 layer does).
        v: [B, T, H, V].
        g: [B, T, H, K] natural-log decay (<= 0), e.g. from `kda_gate`.
        beta: [B, T, H] write strength in (0, 1).
        scale: query scale, default K ** -0.5.
        initial_state: [B, H, K, V] (float32), default zeros.
        output_final_state: also return the state after the last token.

    Returns:
        o: [B, T, H, V] in v's dtype; final_state: [B, H, K, V] float32 or None.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    if scale is None:
        scale = K**-0.5
    dtype = v.dtype
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.float()
    outputs = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None]
        k_t = k[:, t]
        error = v[:, t] - torch.einsum("bhk,bhkv->bhv", k_t, S)
        S = S + torch.einsum("bhk,bhv->bhkv", beta[:, t, :, None] * k_t, error)
        outputs.append(torch.einsum("bhk,bhkv->bhv", q[:, t] * scale, S))
    o = torch.stack(outputs, dim=1) if T > 0 else v.new_zeros(B, 0, H, V)
    return o.to(dtype), (S if output_final_state else None)
