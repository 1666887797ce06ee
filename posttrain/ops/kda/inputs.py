"""Shape checks shared by every KDA path, so a wrong layout fails with the same clear message
whichever kernel the caller picked (fla's kernels would otherwise fail deep inside Triton)."""

from __future__ import annotations

import itertools

import torch


def check_kda_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
) -> int:
    """Raise ValueError naming the tensor and the expected layout; return the number of sequences.

    q, k [B,T,H,K]; v [B,T,H,V]; g [B,T,H,K]; beta [B,T,H]; initial_state [N,H,K,V] where N is B,
    or the number of documents when cu_seqlens [N+1] packs them into a single row (B == 1).
    """
    if q.dim() != 4:
        raise ValueError(f"KDA: q must be [B, T, H, K], got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"KDA: k must have q's shape {tuple(q.shape)}, got {tuple(k.shape)}")
    if v.dim() != 4 or v.shape[:3] != (B, T, H):
        raise ValueError(f"KDA: v must be [B, T, H, V] = [{B}, {T}, {H}, V], got {tuple(v.shape)}")
    if g.shape != q.shape:
        raise ValueError(f"KDA: g must be [B, T, H, K] like q {tuple(q.shape)}, got {tuple(g.shape)}")
    if beta.shape != (B, T, H):
        raise ValueError(f"KDA: beta must be [B, T, H] = [{B}, {T}, {H}], got {tuple(beta.shape)}")
    N = B
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"KDA: cu_seqlens needs the documents packed into one row (B == 1), got B={B}")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError(f"KDA: cu_seqlens must be a 1-D [N+1] tensor, got {tuple(cu_seqlens.shape)}")
        bounds = cu_seqlens.tolist()
        if bounds[0] != 0 or bounds[-1] != T or any(a > b for a, b in itertools.pairwise(bounds)):
            raise ValueError(f"KDA: cu_seqlens must rise from 0 to T={T}, got {bounds}")
        N = len(bounds) - 1
    V = v.shape[-1]
    if initial_state is not None and initial_state.shape != (N, H, K, V):
        raise ValueError(
            f"KDA: initial_state must be [N, H, K, V] = [{N}, {H}, {K}, {V}] "
            f"(N = {'documents in cu_seqlens' if cu_seqlens is not None else 'batch'}), "
            f"got {tuple(initial_state.shape)}"
        )
    return N
