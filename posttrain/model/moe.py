"""Stable LatentMoE: K3's feed-forward block in every layer after the first.

The router (`gate`) reads the full-width x: sigmoid scores, top-k picked on scores plus the selection
bias `e_score_correction_bias` (noaux_tc: the bias never enters the mixture weights, so router
gradients are untouched), weights renormalised over the picked k and scaled by
routed_scaling_factor. The routed path projects x down to the latent width
(`routed_expert_down_proj`, 7168 -> 3584 at full size), runs the picked experts there, aggregates,
applies `routed_expert_norm` (RMSNorm, the "stable" fix for activation outliers) and projects back up
(`routed_expert_up_proj`); the shared experts run at full width and are added. Names follow vLLM's
`KimiMoE` and the released checkpoint (`block_sparse_moe.*`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from posttrain.model.balancing import QuantileBalancer
from posttrain.model.configuration_kimi_k3 import KimiK3Config
from posttrain.model.mlp import KimiMLP, RMSNorm, glu_activation

FakeQuant = Callable[[torch.Tensor], torch.Tensor]


class KimiK3MoEGate(nn.Module):
    """Router: weight [E, D] (trained) and e_score_correction_bias [E] (a float32 buffer set by
    Quantile Balancing, saved in checkpoints). Computes in float32, as vLLM's GateLinear does."""

    def __init__(self, config: KimiK3Config) -> None:
        super().__init__()
        self.num_experts = E = config.num_experts
        self.top_k = config.num_experts_per_token
        self.activation = config.moe_router_activation_func
        self.renormalize = config.moe_renormalize
        self.routed_scaling_factor = config.routed_scaling_factor
        self.num_groups = config.num_expert_group if config.use_grouped_topk else 1
        self.topk_group = config.topk_group if config.use_grouped_topk else 1
        self.weight = nn.Parameter(torch.empty(E, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(E, dtype=torch.float32))
        self.balancer = QuantileBalancer(E, self.top_k)

    def forward(
        self, x: torch.Tensor, token_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, D] -> (topk_idx [N, k] long, topk_weight [N, k] float32).

        In training mode the balancing statistics of the real tokens (token_mask [N] bool) are
        recorded, except during an activation-checkpointing recompute (already counted once).
        """
        logits = x.float() @ self.weight.float().t()
        scores = torch.sigmoid(logits) if self.activation == "sigmoid" else torch.softmax(logits, dim=-1)
        biased = scores.detach() + self.e_score_correction_bias
        if self.num_groups > 1:
            N = biased.shape[0]
            grouped = biased.view(N, self.num_groups, -1)
            group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, group_scores.topk(self.topk_group, dim=-1).indices, True)
            biased = grouped.masked_fill(~keep[..., None], float("-inf")).view(N, -1)
        topk_idx = biased.topk(self.top_k, dim=-1).indices
        topk_weight = scores.gather(-1, topk_idx)
        if self.renormalize:
            topk_weight = topk_weight / (topk_weight.sum(-1, keepdim=True) + 1e-20)
        topk_weight = topk_weight * self.routed_scaling_factor
        # -1 outside a backward pass; anything else means this forward is a checkpoint recompute.
        if self.training and torch._C._current_graph_task_id() == -1:
            real = slice(None) if token_mask is None else token_mask
            self.balancer.observe(scores.detach()[real], topk_idx[real], self.e_score_correction_bias)
        return topk_idx, topk_weight


class KimiK3Experts(nn.Module):
    """The routed experts as 3-D batched weights (SiTU-GLU each), on the latent width.

    w1 [E, I, D] gate, w3 [E, I, D] up, w2 [E, D, I] down (the released per-expert w1/w3/w2): the
    last dim of every weight is its matmul's reduction dim, so MX blocks of 32 run along it.
    QAT hooks: `weight_fake_quant` is applied to each 3-D weight and `act_fake_quant` to the input
    activation of each expert matmul (the tokens entering w1/w3 and the SiTU output entering w2);
    None means identity. `posttrain.qat.apply_qat` sets them.
    """

    def __init__(self, config: KimiK3Config, hidden_size: int) -> None:
        super().__init__()
        self.config = config
        E, I = config.num_experts, config.moe_intermediate_size
        self.num_experts = E
        self.w1 = nn.Parameter(torch.empty(E, I, hidden_size))
        self.w3 = nn.Parameter(torch.empty(E, I, hidden_size))
        self.w2 = nn.Parameter(torch.empty(E, hidden_size, I))
        self.weight_fake_quant: FakeQuant | None = None
        self.act_fake_quant: FakeQuant | None = None

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor) -> torch.Tensor:
        """x [N, D], topk_idx [N, k], topk_weight [N, k] -> sum_k weight * expert_k(x) [N, D]."""
        wq = self.weight_fake_quant or (lambda w: w)
        aq = self.act_fake_quant or (lambda a: a)
        w1, w3, w2 = wq(self.w1), wq(self.w3), wq(self.w2)
        x = aq(x)
        N, k = topk_idx.shape
        flat_expert = topk_idx.flatten()
        order = flat_expert.argsort(stable=True)
        token = torch.arange(N, device=x.device).repeat_interleave(k)[order]
        weight = topk_weight.flatten()[order]
        counts = torch.bincount(flat_expert, minlength=self.num_experts).tolist()
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows = token[start : start + n]
            xe = x[rows]
            h = aq(glu_activation(self.config, xe @ w1[e].t(), xe @ w3[e].t()))
            y = (h @ w2[e].t()) * weight[start : start + n, None].to(x.dtype)
            out = out.index_add(0, rows, y)
            start += n
        return out


class KimiK3SparseMoeBlock(nn.Module):
    """Stable LatentMoE block. Module path in a checkpoint: `model.layers.{i}.block_sparse_moe`."""

    def __init__(self, config: KimiK3Config) -> None:
        super().__init__()
        D = config.hidden_size
        latent = config.routed_expert_hidden_size
        self.gate = KimiK3MoEGate(config)
        self.use_latent = latent is not None
        if self.use_latent:
            self.routed_expert_down_proj = nn.Linear(D, latent, bias=False)
            self.routed_expert_norm = (
                RMSNorm(latent, config.rms_norm_eps) if config.latent_moe_use_norm else None
            )
            self.routed_expert_up_proj = nn.Linear(latent, D, bias=False)
        self.experts = KimiK3Experts(config, latent if self.use_latent else D)
        shared = config.num_shared_experts or 0
        self.shared_experts = KimiMLP(config, D, config.moe_intermediate_size * shared) if shared else None

    def forward(self, x: torch.Tensor, token_mask: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, T, D] -> [B, T, D]; token_mask [B, T] marks the real tokens for balancing."""
        B, T, D = x.shape
        flat = x.reshape(B * T, D)
        topk_idx, topk_weight = self.gate(flat, None if token_mask is None else token_mask.reshape(-1).bool())
        routed_in = self.routed_expert_down_proj(flat) if self.use_latent else flat
        routed = self.experts(routed_in, topk_idx, topk_weight)
        if self.use_latent:
            if self.routed_expert_norm is not None:
                routed = self.routed_expert_norm(routed)
            routed = self.routed_expert_up_proj(routed)
        if self.shared_experts is not None:
            routed = routed + self.shared_experts(flat)
        return routed.view(B, T, D)
