"""The KDA (Kimi Delta Attention) layer of K3: 69 of the 93 layers at full size.

Per token: q, k, v projections pass a causal depthwise conv (kernel 4) and SiLU; q, k are
L2-normalised; a low-rank forget projection (f_a_proj -> f_b_proj) feeds the bounded gate
`g = gate_lower_bound * sigmoid(exp(A_log) * (f + dt_bias))`; beta = sigmoid(b_proj(x)); the
recurrence runs in `posttrain.ops.kda` (`chunk_kda` for sequences, `fused_recurrent_kda` for one-token
decode); the output passes an RMSNorm gated by sigmoid(g_proj(x)) (full-rank gate, K3) and o_proj.
Parameter names are vLLM's K3 checkpoint names (`KimiK3DeltaAttention` load mapping).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from posttrain.model.cache import KimiK3Cache
from posttrain.model.configuration_kimi_k3 import KimiK3Config
from posttrain.model.projections import stacked_projection, stacks_projections
from posttrain.ops.fusion import region
from posttrain.ops.kda import chunk_kda, fused_recurrent_kda, kda_gate
from posttrain.ops.kda.fla_layer import fla_kda_core, fla_layer_available

# fla's l2norm epsilon (vLLM's kernels normalise q/k with use_qk_l2norm_in_kernel=True).
L2NORM_EPS = 1e-6
# vLLM's K3 o_norm is FusedRMSNormGated with its default eps, independent of rms_norm_eps.
O_NORM_EPS = 1e-5


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, in float32, returned in x's dtype."""
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


def document_positions(cu_seqlens: torch.Tensor, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For a packed row: (document id [T], position inside its document [T]) from cu_seqlens [N+1]."""
    pos = torch.arange(T, device=cu_seqlens.device)
    doc = torch.searchsorted(cu_seqlens[1:], pos, right=True)
    return doc, pos - cu_seqlens[doc]


def causal_short_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor | None,
    pos_in_doc: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv over time, resumable and document-aware.

    Args:
        x: [B, T, C] inputs (padding positions already zeroed).
        weight: [C, W] taps, the last tap multiplies the current token.
        conv_state: [B, C, W-1] the previous W-1 inputs (oldest first), or None for zeros.
        pos_in_doc: [T] position of each token inside its packed document (taps that would read
            across a document start read zero), or None.

    Returns:
        (y [B, T, C] before the activation, new conv_state [B, C, W-1]).
    """
    B, T, C = x.shape
    W = weight.shape[-1]
    past = x.new_zeros(B, W - 1, C) if conv_state is None else conv_state.transpose(1, 2).to(x.dtype)
    full = torch.cat([past, x], dim=1)  # [B, W-1+T, C]
    y = torch.zeros_like(x)
    # Tap j as a contiguous row: broadcasting the strided column weight[:, j] took the slow path
    # of the elementwise kernel (2.7x the time on the CPU).
    taps = weight.to(x.dtype).t().contiguous()
    for j in range(W):
        tap = full[:, j : j + T] * taps[j]
        if pos_in_doc is not None:
            tap = tap * (pos_in_doc >= W - 1 - j).to(x.dtype)[None, :, None]
        y = y + tap
    return y, full[:, T:].transpose(1, 2).contiguous()


def conv_qkv(
    qkv: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_state: torch.Tensor | None,
    pos_in_doc: torch.Tensor | None,
    num_heads: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The short conv, SiLU and q/k l2norm of KDA's fused q|k|v projection [B, T, 3 H K]: one
    elementwise region (`posttrain.ops.fusion`). Returns (q, k, v [B, T, H, K], new conv_state)."""
    B, T, C = qkv.shape
    y, new_state = causal_short_conv(qkv, conv_weight, conv_state, pos_in_doc)
    q, k, v = F.silu(y).view(B, T, 3, num_heads, C // (3 * num_heads)).unbind(2)
    return l2norm(q), l2norm(k), v, new_state


class ShortConvolution(nn.Module):
    """Depthwise causal conv taps, stored as nn.Conv1d's weight [C, 1, W] (the released
    `q_conv1d.weight` layout); applied by `causal_short_conv`, which also handles state and packing."""

    def __init__(self, channels: int, kernel_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size))


class KimiK3DeltaAttention(nn.Module):
    """KDA token mixer. Module path in a checkpoint: `model.layers.{i}.self_attn`."""

    def __init__(self, config: KimiK3Config, layer_idx: int) -> None:
        super().__init__()
        lac = config.linear_attn_config
        self.layer_idx = layer_idx
        self.num_heads = H = lac["num_heads"]
        self.head_dim = K = lac["head_dim"]
        self.conv_size = W = lac["short_conv_kernel_size"]
        self.gate_lower_bound = float(lac["gate_lower_bound"])
        self.use_full_rank_gate = bool(lac.get("use_full_rank_gate", True))
        D, P = config.hidden_size, H * K
        self.q_proj = nn.Linear(D, P, bias=False)
        self.k_proj = nn.Linear(D, P, bias=False)
        self.v_proj = nn.Linear(D, P, bias=False)
        self.q_conv1d = ShortConvolution(P, W)
        self.k_conv1d = ShortConvolution(P, W)
        self.v_conv1d = ShortConvolution(P, W)
        self.f_a_proj = nn.Linear(D, K, bias=False)
        self.f_b_proj = nn.Linear(K, P, bias=False)
        self.A_log = nn.Parameter(torch.zeros(H))
        self.dt_bias = nn.Parameter(torch.zeros(P))
        self.b_proj = nn.Linear(D, H, bias=False)
        if self.use_full_rank_gate:
            self.g_proj = nn.Linear(D, P, bias=False)
        else:
            self.g_a_proj = nn.Linear(D, K, bias=False)
            self.g_b_proj = nn.Linear(K, P, bias=False)
        self.compile_regions = config.compile_regions
        self.o_norm = _GatedRMSNorm(K, compile_regions=config.compile_regions)
        self.o_proj = nn.Linear(P, D, bias=False)

    def fuse_on_fla(
        self,
        x: torch.Tensor,
        token_mask: torch.Tensor | None,
        cu_seqlens: torch.Tensor | None,
        cache: KimiK3Cache | None,
    ) -> bool:
        """Whether this forward runs its conv, l2norm, gate and recurrence in fla's fused kernels
        (`posttrain.ops.kda.fla_layer`): CUDA training forwards under bf16 autocast, without padding,
        packing or a cache, when fla is installed. Only that configuration has been checked against
        the unfused path on a GPU; packed rows (fla's varlen kernels) and float32 compute keep the
        unfused path until theirs are (tests/model/test_kda_fla_layer.py)."""
        return (
            token_mask is None
            and cu_seqlens is None
            and cache is None
            and torch.is_grad_enabled()
            and torch.is_autocast_enabled("cuda")
            and torch.get_autocast_dtype("cuda") == torch.bfloat16
            and fla_layer_available(x)
        )

    def _input_projections(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(q|k|v [.., 3P], output gate [.., P], f_a [.., K], beta logits [.., H]) of x: one stacked
        GEMM in CUDA training forwards where the projections allow it (`posttrain.model.projections`),
        else one call per module."""
        gate_proj = self.g_proj if self.use_full_rank_gate else self.g_a_proj
        layers = (self.q_proj, self.k_proj, self.v_proj, gate_proj, self.f_a_proj, self.b_proj)
        out = stacked_projection(x, layers) if stacks_projections(x) else None
        if out is None:
            q, k, v, gate, f_a, beta_logits = (m(x) for m in layers)
            qkv = torch.cat([q, k, v], dim=-1)
        else:
            qkv_width = sum(m.out_features for m in layers[:3])
            qkv = out[..., :qkv_width]
            gate, f_a, beta_logits = out[..., qkv_width:].split([m.out_features for m in layers[3:]], dim=-1)
        if not self.use_full_rank_gate:
            gate = self.g_b_proj(gate)
        return qkv, gate, f_a, beta_logits

    def forward(
        self,
        x: torch.Tensor,
        token_mask: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        cache: KimiK3Cache | None = None,
    ) -> torch.Tensor:
        """x [B, T, D] -> [B, T, D].

        token_mask [B, T] (1 real, 0 padding) makes padding positions neither decay nor write the
        state and feed zeros to the conv, so real tokens see exactly the unpadded sequence.
        cu_seqlens [N+1] (B == 1) restarts the state and the conv at each document. `cache` (not with
        cu_seqlens) supplies and receives this layer's conv and recurrent state.
        """
        B, T, _ = x.shape
        H, K = self.num_heads, self.head_dim
        qkv, gate, f_a, beta_logits = self._input_projections(x)
        if token_mask is not None:
            qkv = qkv * token_mask[..., None].to(qkv.dtype)
        conv_weight = torch.cat([c.weight[:, 0] for c in (self.q_conv1d, self.k_conv1d, self.v_conv1d)])
        if self.fuse_on_fla(x, token_mask, cu_seqlens, cache):
            f = self.f_b_proj(f_a)
            o = fla_kda_core(
                qkv,
                conv_weight,
                f,
                beta_logits,
                self.A_log,
                self.dt_bias,
                H,
                self.gate_lower_bound,
            )
            o = self.o_norm(o, gate.view(B, T, H, K))
            return self.o_proj(o.reshape(B, T, H * K))
        pos_in_doc = None if cu_seqlens is None else document_positions(cu_seqlens, T)[1]
        conv_state = None if cache is None else cache.conv_states[self.layer_idx]
        q, k, v, new_conv_state = region(conv_qkv, self.compile_regions, qkv)(
            qkv, conv_weight, conv_state, pos_in_doc, H
        )
        beta = torch.sigmoid(beta_logits.float())
        f = self.f_b_proj(f_a)
        g = region(kda_gate, self.compile_regions, f)(f, self.A_log, self.dt_bias, self.gate_lower_bound)
        if token_mask is not None:
            keep = token_mask.to(torch.float32)
            beta = beta * keep[..., None]
            g = g * keep[..., None, None]
        state = None if cache is None else cache.recurrent_states[self.layer_idx]
        if T == 1 and state is not None:
            o, final = fused_recurrent_kda(q, k, v, g, beta, initial_state=state, output_final_state=True)
        else:
            o, final = chunk_kda(
                q,
                k,
                v,
                g,
                beta,
                initial_state=state,
                output_final_state=cache is not None,
                cu_seqlens=cu_seqlens,
            )
        if cache is not None:
            cache.conv_states[self.layer_idx] = new_conv_state
            cache.recurrent_states[self.layer_idx] = final
        o = self.o_norm(o, gate.view(B, T, H, K))
        return self.o_proj(o.reshape(B, T, H * K))


def gated_rms_norm(o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(o) * weight * sigmoid(gate) in float32, returned in gate's dtype."""
    h = o.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return (h * torch.sigmoid(gate.float())).to(gate.dtype)


class _GatedRMSNorm(nn.Module):
    """fla's FusedRMSNormGated with activation="sigmoid": RMSNorm(o) * weight * sigmoid(gate)."""

    def __init__(self, dim: int, eps: float = O_NORM_EPS, compile_regions: bool | None = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.compile_regions = compile_regions

    def forward(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return region(gated_rms_norm, self.compile_regions, o)(o, gate, self.weight, self.eps)
