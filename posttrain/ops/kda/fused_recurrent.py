"""KDA's decode path: the exact token-by-token recurrence, trimmed for T = 1.

Decoding feeds one token per step against a cached [B, H, K, V] state, where a chunked kernel only
adds padding work. Everything that does not depend on the state (decays, beta * k, scaled q) is
computed for all tokens at once, so each step is four small batched ops.
"""

from __future__ import annotations

import itertools

import torch

from posttrain.ops.kda.inputs import check_kda_inputs


def fused_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA by its recurrence (see `naive_recurrent_kda`), for short T; differentiable.

    Args:
        q, k: [B, T, H, K].
        v: [B, T, H, V].
        g: [B, T, H, K] natural-log decay (<= 0); any lower bound is fine here.
        beta: [B, T, H].
        scale: query scale, default K ** -0.5.
        initial_state: [N, H, K, V]; N = B, or the number of documents with cu_seqlens.
        output_final_state: also return the state after each sequence's last token.
        cu_seqlens: LongTensor [N+1] of document boundaries in a packed row (B == 1).

    Returns:
        o: [B, T, H, V] in v's dtype; final_state: [N, H, K, V] float32, or None.
    """
    N = check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    out_dtype = v.dtype
    h0 = q.new_zeros(N, H, K, V, dtype=torch.float32) if initial_state is None else initial_state.float()
    q_scaled = q.float() * scale
    k = k.float()
    beta_k = beta.float().unsqueeze(-1) * k
    decay = g.float().exp().unsqueeze(-1)
    v = v.float()

    if cu_seqlens is None:
        segments = [(0, T)]
        segment_h0 = [h0]
    else:
        bounds = cu_seqlens.tolist()
        segments = list(itertools.pairwise(bounds))
        segment_h0 = list(h0.split(1))

    outputs = []
    final_states = []
    for (start, end), S in zip(segments, segment_h0, strict=True):
        for t in range(start, end):
            S = S * decay[:, t]
            error = v[:, t] - (k[:, t].unsqueeze(-2) @ S).squeeze(-2)
            S = S + beta_k[:, t].unsqueeze(-1) * error.unsqueeze(-2)
            outputs.append((q_scaled[:, t].unsqueeze(-2) @ S).squeeze(-2))
        final_states.append(S)
    o = torch.stack(outputs, 1) if outputs else v.new_zeros(B, 0, H, V)
    final_state = torch.cat(final_states) if output_final_state else None
    return o.to(out_dtype), final_state
