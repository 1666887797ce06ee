"""KDA's training path: chunkwise, so a sequence costs T / 16 small sequential steps, not T.

Inside a chunk of C tokens the delta rule is a unit lower-triangular system (the WY / UT form of
fla's chunk gated delta rule): with G the in-chunk cumulative log-decay, S0 the state entering the
chunk and delta_i = beta_i * (v_i - k_i^T S_{i-1}) the error each token writes,

    (I + A) delta = diag(beta) (v - (k * exp(G)) S0),  A_ij = beta_i <k_i exp(G_i - G_j), k_j>, j < i
    o_i           = (scale q_i * exp(G_i)) S0 + sum_{j <= i} scale <q_i exp(G_i - G_j), k_j> delta_j
    S_C           = Diag(exp(G_C)) S0 + sum_j (k_j exp(G_C - G_j)) delta_j^T

Solving that system once per chunk gives delta = u - w S0 with u, w independent of S0, so the only
sequential work is S_C = Diag(exp(G_C)) S0 + k_end^T (u - w S0): two small matmuls per chunk, with a
hand-written backward (`_StateScan`). Everything else is dense batched matmuls over all chunks,
differentiated by torch autograd.

On CUDA with flash-linear-attention installed, `backend="auto"` hands the call to fla's Triton
kernel instead (same layout and semantics; see `_fla_chunk_kda`). `backend="triton"` runs our own
forward-only kernels (`triton_fwd`), for rollouts and teacher prefill; "auto" takes them on a GPU
without fla when no gradient is needed (`_auto_picks_triton`).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F

from posttrain.ops.kda.inputs import check_kda_inputs

# K3's gate (`kda_gate`) never decays a channel by more than e^-5 per token.
GATE_LOWER_BOUND = -5.0
# The dense tiles hold exp(G_i - G_j) split as exp(G_i + c) * exp(-G_j - c). The bounded gate
# (g >= -5 per token) keeps a 16-token chunk's cumulative log-decay G in [-80, 0]; with c = 40 both
# factors stay in [e^-40, e^40], far from float32's e^88 overflow even in the masked (acausal) half
# of a tile. c is a constant, not a token's G, so rounding cannot leak a later token's gate into an
# earlier output. Steeper gates shrink the tile to keep G >= -80 (`_tile_size`).
MAX_CHUNK_LOG_DECAY = 80.0


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    chunk_size: int = 16,
    backend: Literal["auto", "torch", "fla", "triton"] = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunkwise KDA, equal to `naive_recurrent_kda` up to float rounding, for any T.

    Args:
        q, k: [B, T, H, K] (the K3 layer L2-normalises them).
        v: [B, T, H, V].
        g: [B, T, H, K] natural-log decay in [-5, 0] (`kda_gate`'s range). The torch path also takes
            steeper gates down to -80 (with smaller tiles); fla's kernel is told g >= -5.
        beta: [B, T, H].
        scale: query scale, default K ** -0.5.
        initial_state: [N, H, K, V]; N = B, or the number of documents with cu_seqlens.
        output_final_state: also return the state after each sequence's last token.
        cu_seqlens: LongTensor [N+1] of document boundaries in a packed row (B == 1); the state
            restarts from initial_state[n] (or zeros) at each document.
        chunk_size: tokens per tile of the torch path; capped so a tile's cumulative log-decay
            stays >= -80 (16 for K3's gate). The triton backend always uses 16.
        backend: "auto" (fla's kernel for CUDA inputs when fla imports; without fla, our Triton
            forward for CUDA inputs that need no gradient; else torch), "torch", "fla", or
            "triton": our forward-only kernels (`triton_fwd`), for rollouts and prefill under
            torch.no_grad(); CUDA inputs (or TRITON_INTERPRET=1), g >= -5.

    Returns:
        o: [B, T, H, V] in v's dtype; final_state: [N, H, K, V] float32, or None.
    """
    if backend not in ("auto", "torch", "fla", "triton"):
        raise ValueError(f"chunk_kda: backend must be 'auto', 'torch', 'fla' or 'triton', got {backend!r}")
    if backend == "auto" and _auto_picks_triton(q, k, v, g, beta, initial_state):
        backend = "triton"
    if backend == "triton":
        # Imported on use: it imports Triton, which the torch and fla paths do not need here. It
        # checks the inputs itself (once: with cu_seqlens the check reads them back from the GPU).
        from posttrain.ops.kda.triton_fwd import triton_chunk_kda

        return triton_chunk_kda(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
    N = check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    fla_kernel = _fla_chunk_kda() if backend != "torch" and q.is_cuda else None
    if backend == "fla" and fla_kernel is None:
        raise ImportError(
            "chunk_kda(backend='fla') needs CUDA inputs and flash-linear-attention "
            "(pip install flash-linear-attention); use backend='torch' otherwise"
        )
    if fla_kernel is not None:
        o, final_state = fla_kernel(
            q,
            k,
            v,
            g,
            beta,
            scale=scale,
            initial_state=None if initial_state is None else initial_state.float(),
            output_final_state=output_final_state,
            # g is already the log-decay: fla must not apply its own gate (use_gate_in_kernel
            # stays False); safe_gate only tells fla the gate is bounded below by lower_bound.
            safe_gate=True,
            lower_bound=GATE_LOWER_BOUND,
            cu_seqlens=None if cu_seqlens is None else cu_seqlens.to(q.device),
        )
        return o.to(v.dtype), final_state
    return _torch_chunk_kda(
        q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_size, N
    )


def _auto_picks_triton(*tensors: torch.Tensor | None) -> bool:
    """backend="auto" on a GPU without fla: our forward-only Triton kernels for a forward that
    needs no gradient (rollouts, evaluations, MOPD's teacher prefill). On an H200 at K3's head
    shape they take 3.5 ms against the torch chunk path's 34-38 ms (bench/RESULTS.md); training
    (a gradient is needed) keeps the torch path. Like fla's branch, this trusts K3's gate (g >= -5)."""
    present = [t for t in tensors if t is not None]
    if not present[0].is_cuda or _fla_chunk_kda() is not None:
        return False
    from posttrain.ops.kda.triton_fwd import refusal  # imports Triton: only asked on a GPU

    return refusal(present) is None


@functools.cache
def _fla_chunk_kda() -> Callable | None:
    try:
        from fla.ops.kda import chunk_kda as fla_chunk_kda
    except ImportError:
        return None
    return fla_chunk_kda


def _torch_chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    cu_seqlens: torch.Tensor | None,
    chunk_size: int,
    N: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    B, T, H, K = q.shape
    V = v.shape[-1]
    if chunk_size < 1:
        raise ValueError(f"chunk_kda: chunk_size must be >= 1, got {chunk_size}")
    scale = K**-0.5 if scale is None else scale
    out_dtype = v.dtype
    q, k, v, g = (x.float() for x in (q, k, v, g))
    beta = beta.float().unsqueeze(-1)
    C, shift = _tile_size(g, chunk_size)
    h0 = q.new_zeros(N, H, K, V) if initial_state is None else initial_state.float()
    if T == 0:
        return v.new_zeros(B, 0, H, V, dtype=out_dtype), (h0 if output_final_state else None)

    if cu_seqlens is None:
        T_pad = math.ceil(T / C) * C
        padded = [F.pad(x, (0, 0, 0, 0, 0, T_pad - T)) for x in (q, k, v, g, beta)]
        segments = [(0, T_pad // C)]
        segment_h0 = h0[None]  # one segment spanning every row
    else:
        # Each document starts on a tile boundary; zero tokens (k = 0, beta = 0, g = 0) fill the
        # tail of its last tile and leave the state untouched.
        src, dst, segments = _varlen_layout(cu_seqlens.tolist(), C, T)
        src_index = torch.tensor(src, device=q.device)
        padded = [
            torch.cat([x, x.new_zeros(1, 1, *x.shape[2:])], 1)[:, src_index] for x in (q, k, v, g, beta)
        ]
        segment_h0 = h0[:, None]  # one segment per document, in the single packed row

    tiles = [x.unflatten(1, (-1, C)).permute(1, 0, 3, 2, 4).contiguous() for x in padded]  # [NT, R, H, C, D]
    o, final_states = _chunk_forward(*tiles, scale, shift, segments, segment_h0)
    o = o.permute(1, 0, 3, 2, 4).flatten(1, 2)  # [R, T_pad, H, V]
    o = o[:, :T] if cu_seqlens is None else o[:, torch.tensor(dst, device=q.device)]
    final_state = final_states.flatten(0, 1) if output_final_state else None
    return o.to(out_dtype), final_state


def _tile_size(g: torch.Tensor, chunk_size: int) -> tuple[int, float]:
    """Largest tile <= chunk_size whose cumulative log-decay stays within MAX_CHUNK_LOG_DECAY, and
    the constant that centres the tile's range of G on 0."""
    decay_bound = max(-GATE_LOWER_BOUND, -float(g.detach().amin())) if g.numel() else -GATE_LOWER_BOUND
    if decay_bound > MAX_CHUNK_LOG_DECAY:
        raise ValueError(
            f"chunk_kda: g holds a per-token log-decay of {-decay_bound:.3g}, below "
            f"-{MAX_CHUNK_LOG_DECAY:g}; compute g with kda_gate (bounded by lower_bound=-5) "
            f"or use fused_recurrent_kda for unbounded gates"
        )
    C = min(chunk_size, int(MAX_CHUNK_LOG_DECAY // decay_bound))
    return C, decay_bound * C / 2


def _varlen_layout(bounds: list[int], C: int, T: int) -> tuple[list[int], list[int], list[tuple[int, int]]]:
    """For packed documents: the source token of every padded slot (T = a zero token), the padded
    slot of every real token, and each document's [first, last) tile."""
    src: list[int] = []
    dst: list[int] = []
    segments = []
    for start, end in itertools.pairwise(bounds):
        length = end - start
        padded_length = math.ceil(length / C) * C
        first = len(src)
        segments.append((first // C, (first + padded_length) // C))
        dst.extend(range(first, first + length))
        src.extend(range(start, end))
        src.extend([T] * (padded_length - length))
    return src, dst, segments


def _chunk_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    shift: float,
    segments: list[tuple[int, int]],
    segment_h0: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tiles [NT, R, H, C, D] (beta with D = 1) -> o [NT, R, H, C, V] and final states [S, R', H, K, V].

    Segment s covers tiles segments[s] and starts from segment_h0[s] [R', H, K, V]: R' = R for one
    segment over all rows, R' = 1 for documents packed in one row.
    """
    NT, R, H, C, K = q.shape
    V = v.shape[-1]
    G = g.cumsum(-2)
    decay = G.exp()
    q = q * scale
    ahead = (G + shift).exp()
    q_in = q * ahead
    k_in = k * ahead
    k_out = k * (-G - shift).exp()
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    strictly_causal = causal.tril(-1)
    A_qk = (q_in @ k_out.mT).masked_fill(~causal, 0.0)
    A_kk = (beta * (k_in @ k_out.mT)).masked_fill(~strictly_causal, 0.0)
    rhs = beta * torch.cat([v, k * decay], -1)
    uw = torch.linalg.solve_triangular(A_kk, rhs, upper=False, unitriangular=True)
    u, w = uw.split([V, K], -1)

    G_last = G[..., -1:, :]
    chunk_decay = G_last.mT.exp()  # [NT, R, H, K, 1]
    k_to_end = k * (G_last - G).exp()
    S_in, delta, final_states = _StateScan.apply(
        *(x.flatten(1, 2) for x in (chunk_decay, k_to_end, w, u, segment_h0)), segments
    )
    S_in = S_in.unflatten(1, (R, H))  # [NT, R, H, K, V]: the state entering each tile
    o = (q * decay) @ S_in + A_qk @ delta.unflatten(1, (R, H))
    return o, final_states.unflatten(1, (-1, H))


class _StateScan(torch.autograd.Function):
    """The only sequential part, per tile n:  delta_n = u_n - w_n S_n,
    S_{n+1} = decay_n * S_n + k_to_end_n^T delta_n.  Returns every S_n, every delta_n and the states
    after each segment.

    Autograd through a Python loop would record every step and redo the matmuls; here backward
    carries only dL/dS back through the tiles (two small matmuls a tile) and forms the gradients of
    decay, k_to_end and w as batched matmuls over all tiles at once.
    Tensors are [NT, R*H, ...]; h0 is [segments, R*H, K, V].
    """

    @staticmethod
    def forward(ctx, chunk_decay, k_to_end, w, u, h0, segments):
        S_in = u.new_empty(w.shape[0], *h0.shape[1:])
        delta = u.clone()
        final_states = torch.empty_like(h0)
        # Per-tile views made once, and results written in place: at 16-token tiles the loop's cost
        # is per-op overhead, not arithmetic.
        decay_n, k_n, w_n, S_n, delta_n = (x.unbind(0) for x in (chunk_decay, k_to_end, w, S_in, delta))
        for s, (first, last) in enumerate(segments):
            if first == last:
                final_states[s] = h0[s]
                continue
            S_n[first].copy_(h0[s])
            for n in range(first, last):
                delta_n[n].baddbmm_(w_n[n], S_n[n], alpha=-1)
                S_next = S_n[n + 1] if n + 1 < last else final_states[s]
                torch.mul(decay_n[n], S_n[n], out=S_next).baddbmm_(k_n[n].mT, delta_n[n])
        ctx.segments = segments
        ctx.save_for_backward(chunk_decay, k_to_end, w, S_in, delta)
        return S_in, delta, final_states

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dS_in, d_delta_out, d_final_states):
        chunk_decay, k_to_end, w, S_in, delta = ctx.saved_tensors
        dS_out = torch.empty_like(S_in)  # dL/dS after each tile
        d_delta = d_delta_out.clone()  # total dL/d delta, through the outputs and the state
        dh0 = torch.empty_like(d_final_states)
        decay_n, k_n, w_n, dS_in_n, dS_out_n, d_delta_n = (
            x.unbind(0) for x in (chunk_decay, k_to_end, w, dS_in, dS_out, d_delta)
        )
        for s, (first, last) in enumerate(ctx.segments):
            if first == last:
                dh0[s] = d_final_states[s]
                continue
            dS_out_n[last - 1].copy_(d_final_states[s])
            for n in reversed(range(first, last)):
                d_delta_n[n].baddbmm_(k_n[n], dS_out_n[n])
                dS_prev = dS_out_n[n - 1] if n > first else dh0[s]
                torch.mul(decay_n[n], dS_out_n[n], out=dS_prev).add_(dS_in_n[n])
                dS_prev.baddbmm_(w_n[n].mT, d_delta_n[n], alpha=-1)
        d_chunk_decay = (dS_out * S_in).sum(-1, keepdim=True)
        d_k_to_end = delta @ dS_out.mT
        d_w = -(d_delta @ S_in.mT)
        return d_chunk_decay, d_k_to_end, d_w, d_delta, dh0, None
