"""Gated multi-head latent attention with NoPE: K3's full-attention layers (24 of 93 at full size).

DeepSeek-style MLA: q through a low-rank bottleneck (q_a_proj -> q_a_layernorm -> q_b_proj); keys and
values from a compressed latent (kv_a_proj_with_mqa emits the `kv_lora_rank` latent, normalised by
kv_a_layernorm, plus a `qk_rope_head_dim`-wide key part shared by all heads) expanded by kv_b_proj.
K3 applies no rotary embedding anywhere (mla_use_nope: KDA layers supply order), so the shared key
part is used as is. The attention output is multiplied by sigmoid(g_proj(x)) before o_proj
(mla_use_output_gate). The cache keeps the normalised latent and the shared key part, not per-head
keys and values. Names follow vLLM's `KimiMLAAttention`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from posttrain.model.cache import KimiK3Cache
from posttrain.model.configuration_kimi_k3 import KimiK3Config
from posttrain.model.mlp import RMSNorm


class KimiK3MLAAttention(nn.Module):
    """Gated NoPE MLA. Module path in a checkpoint: `model.layers.{i}.self_attn`."""

    def __init__(self, config: KimiK3Config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        D = config.hidden_size
        self.num_heads = H = config.num_attention_heads
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.q_lora_rank = config.q_lora_rank
        self.scaling = self.qk_head_dim**-0.5
        if self.q_lora_rank is not None:
            self.q_a_proj = nn.Linear(D, self.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, config.rms_norm_eps, config.compile_regions)
            self.q_b_proj = nn.Linear(self.q_lora_rank, H * self.qk_head_dim, bias=False)
        else:
            self.q_proj = nn.Linear(D, H * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, self.kv_lora_rank + self.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, config.rms_norm_eps, config.compile_regions)
        self.kv_b_proj = nn.Linear(
            self.kv_lora_rank, H * (self.qk_nope_head_dim + self.v_head_dim), bias=False
        )
        self.use_output_gate = bool(config.mla_use_output_gate)
        if self.use_output_gate:
            self.g_proj = nn.Linear(D, H * self.v_head_dim, bias=False)
        self.o_proj = nn.Linear(H * self.v_head_dim, D, bias=False)

    def forward(
        self, x: torch.Tensor, attn_mask: torch.Tensor | None, cache: KimiK3Cache | None = None
    ) -> torch.Tensor:
        """x [B, T, D] -> [B, T, D].

        attn_mask: bool [B, 1, T, S] (True = may attend), S = cached + T keys; it carries causality,
        padding and document boundaries (built once per forward by the model). None: plain causal
        attention over this forward's T keys (S == T; the model passes None only then).
        """
        B, T, _ = x.shape
        H = self.num_heads
        if self.q_lora_rank is not None:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        q = q.view(B, T, H, self.qk_head_dim)
        latent, key_shared = self.kv_a_proj_with_mqa(x).split(
            [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1
        )
        latent = self.kv_a_layernorm(latent)
        if cache is not None:
            latent, key_shared = cache.update_latent(self.layer_idx, latent, key_shared)
        S = latent.shape[1]
        kv = self.kv_b_proj(latent).view(B, S, H, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k = torch.cat([k_nope, key_shared[:, :, None, :].expand(B, S, H, self.qk_rope_head_dim)], dim=-1)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=attn_mask,
            is_causal=attn_mask is None,
            scale=self.scaling,
        )
        out = out.transpose(1, 2).reshape(B, T, H * self.v_head_dim)
        if self.use_output_gate:
            out = out * torch.sigmoid(self.g_proj(x))
        return self.o_proj(out)


def build_mla_mask(
    key_mask: torch.Tensor,
    num_queries: int,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Boolean attention mask [B, 1, T, S] for the last T of S positions.

    Args:
        key_mask: [B, S] 1 for real tokens (cached and new), 0 for padding.
        num_queries: T, the new tokens (the last T key positions).
        cu_seqlens: [N+1] document boundaries of a packed row (B == 1, no cache), or None.

    Returns:
        allowed[b, 0, i, j] = key j is real, not after query i, and in the same document; every query
        may always see itself, so padding queries get finite (ignored) outputs rather than NaN.
    """
    B, S = key_mask.shape
    T = num_queries
    q_pos = torch.arange(S - T, S, device=key_mask.device)
    k_pos = torch.arange(S, device=key_mask.device)
    allowed = (k_pos[None, :] <= q_pos[:, None])[None] & key_mask.bool()[:, None, :]
    if cu_seqlens is not None:
        doc = torch.searchsorted(cu_seqlens[1:], k_pos, right=True)
        allowed = allowed & (doc[None, :] == doc[q_pos][:, None])[None]
    allowed = allowed | (k_pos[None, :] == q_pos[:, None])[None]
    return allowed[:, None]
