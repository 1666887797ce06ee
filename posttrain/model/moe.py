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

import itertools
from collections.abc import Callable

import torch
from torch import nn

from posttrain.model.balancing import QuantileBalancer
from posttrain.model.configuration_kimi_k3 import KimiK3Config
from posttrain.model.mlp import KimiMLP, RMSNorm, glu_activation
from posttrain.model.projections import stacked_projection, stacks_projections
from posttrain.ops.expert_rows import combine_rows, gather_rows

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
        with torch.autocast(x.device.type, enabled=False):  # autocast would run it in bf16
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

    The (token, choice) rows are sorted by expert once per call. On a Hopper-or-newer GPU in bf16
    (autocast or bf16 weights) the three projections are grouped GEMMs over the sorted rows
    (`torch._grouped_mm`, group ends computed on the device): no loop over experts, no host sync,
    and the 3-D weight gradients come out of one grouped GEMM each. Elsewhere (the CPU) the experts
    run one matmul each; `naive_moe_experts` in `moe_naive` is the spec both paths are tested against.
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
        flat_expert = topk_idx.flatten()
        order = flat_expert.argsort(stable=True)  # rows of one expert together, token order inside
        token = order // topk_idx.shape[1]
        weight = topk_weight.flatten()[order]
        dtype = grouped_mm_dtype(x, w1)
        if dtype is not None and x.shape[0]:
            k = topk_idx.shape[1]
            return self._grouped(x, w1, w3, w2, flat_expert[order], order, token, weight, k, dtype, aq)
        return self._per_expert(x, w1, w3, w2, flat_expert, token, weight, aq)

    def _grouped(self, x, w1, w3, w2, sorted_expert, order, token, weight, k, dtype, aq) -> torch.Tensor:
        # ends[e] = rows of experts 0..e: the grouped GEMM's offsets, computed without a host sync.
        ends = torch.searchsorted(
            sorted_expert, torch.arange(1, self.num_experts + 1, device=x.device), out_int32=True
        )
        # inverse[n, j]: the sorted row of choice j of token n, so both directions are gathers.
        inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=x.device))
        inverse = inverse.view(x.shape[0], k)
        xs = gather_rows(x.to(dtype), token, inverse)
        gate = torch._grouped_mm(xs, w1.to(dtype).transpose(-2, -1), offs=ends)
        up = torch._grouped_mm(xs, w3.to(dtype).transpose(-2, -1), offs=ends)
        h = aq(glu_activation(self.config, gate, up))
        y = torch._grouped_mm(h, w2.to(dtype).transpose(-2, -1), offs=ends)
        return combine_rows(y, weight.float(), token, inverse)

    def _per_expert(self, x, w1, w3, w2, flat_expert, token, weight, aq) -> torch.Tensor:
        # unbind: one backward node stacks the E weight gradients (indexing w1[e] would add a
        # zero-filled [E, I, D] gradient per expert).
        w1s, w3s, w2s = w1.unbind(0), w3.unbind(0), w2.unbind(0)
        counts = torch.bincount(flat_expert, minlength=self.num_experts).tolist()
        spans = [(e, n) for e, n in enumerate(counts) if n]
        if not spans:
            return torch.zeros_like(x)
        xs = x[token]  # every (token, choice) row's input, sorted by expert
        bounds = [0, *itertools.accumulate(n for _, n in spans)]
        pieces = [xs[a:b] for a, b in itertools.pairwise(bounds)]
        gate = torch.cat([xe @ w1s[e].t() for (e, _), xe in zip(spans, pieces, strict=True)])
        up = torch.cat([xe @ w3s[e].t() for (e, _), xe in zip(spans, pieces, strict=True)])
        # SiTU and the activation fake-quant act row by row, so one call over all experts' rows is
        # the per-expert calls' result; on a CPU decode step those calls were most of the MoE's time.
        h = aq(glu_activation(self.config, gate, up))
        y = torch.cat(
            [h[a:b] @ w2s[e].t() for (e, _), (a, b) in zip(spans, itertools.pairwise(bounds), strict=True)]
        )
        y = y * weight[:, None].to(x.dtype)
        # Rows are in expert order, so each token's choices are added in expert order, as before.
        return torch.zeros_like(x).index_add(0, token, y)


def grouped_mm_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype | None:
    """bf16 when the experts can run as grouped GEMMs (CUDA sm90+, bf16 by autocast or by the
    tensors themselves, widths 16-byte aligned), else None (per-expert matmuls)."""
    if not (x.is_cuda and hasattr(torch, "_grouped_mm")) or torch.cuda.get_device_capability(x.device)[0] < 9:
        return None
    autocast_bf16 = torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda") == torch.bfloat16
    if not (autocast_bf16 or (x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16)):
        return None
    return torch.bfloat16 if weight.shape[-1] % 8 == 0 and weight.shape[-2] % 8 == 0 else None


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
            norm = config.latent_moe_use_norm
            self.routed_expert_norm = (
                RMSNorm(latent, config.rms_norm_eps, config.compile_regions) if norm else None
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
        routed_in, shared = self._input_projections(flat)
        routed = self.experts(routed_in, topk_idx, topk_weight)
        if self.use_latent:
            if self.routed_expert_norm is not None:
                routed = self.routed_expert_norm(routed)
            routed = self.routed_expert_up_proj(routed)
        if shared is not None:
            routed = routed + shared
        return routed.view(B, T, D)

    def _input_projections(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the experts' input, the shared experts' output) of flat [N, D]; the latent down
        projection and the shared experts' gate and up as one stacked GEMM where allowed
        (`posttrain.model.projections`)."""
        if self.use_latent and self.shared_experts is not None and stacks_projections(flat):
            mlp = self.shared_experts
            layers = (self.routed_expert_down_proj, mlp.gate_proj, mlp.up_proj)
            out = stacked_projection(flat, layers)
            if out is not None:
                routed_in, gate, up = out.split([m.out_features for m in layers], dim=-1)
                return routed_in, mlp.from_projections(gate, up)
        routed_in = self.routed_expert_down_proj(flat) if self.use_latent else flat
        return routed_in, None if self.shared_experts is None else self.shared_experts(flat)
