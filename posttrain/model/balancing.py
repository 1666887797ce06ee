"""Quantile Balancing: K3's loss-free setting of the router's selection bias.

Each routed-MoE gate has a bias b (`e_score_correction_bias`) that enters top-k selection only. For a
token i let alpha_i be its (k+1)-th largest biased score; expert j would enter token i's top-k once
b_j exceeds the margin r_ij = alpha_i - s_ij (s the raw sigmoid score). Expert j receives the target
share k/E of the tokens when b_j is the k/E quantile of r_{:,j}; the new biases are those quantiles,
mean-centred. The update runs outside autograd, after the optimizer step, from statistics gathered
during the training forwards since the previous update.

On one process the quantile is exact (the margins are kept). Across processes each rank keeps
per-expert histograms (`num_bins` uniform bins over [min b - 1, max b + 1], which contains every
margin because scores lie in [0, 1]) and one all_reduce sums them; the quantile is then read off the
pooled histogram with linear interpolation inside the target bin. That bin holds the order statistic
ceil(qn) (1-based), one of the two the exact quantile interpolates between, so the two paths differ by
at most one bin width plus the gap between those two margins (mean-centring at most doubles it);
tests/parallel/test_quantile_histogram.py checks the bound.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

BalancerMode = Literal["auto", "exact", "histogram"]


def exact_quantile(values: torch.Tensor, q: float) -> torch.Tensor:
    """Column-wise quantile of values [N, E] with torch.quantile's linear interpolation (no size cap)."""
    n = values.shape[0]
    ordered = values.sort(dim=0).values
    pos = q * (n - 1)
    lo = int(pos)
    hi = min(lo + 1, n - 1)
    return ordered[lo] + (pos - lo) * (ordered[hi] - ordered[lo])


class QuantileBalancer:
    """Per-gate statistics for Quantile Balancing (plain object: nothing here belongs in a checkpoint).

    Args:
        num_experts: E; top_k: k (needs k < E: with k == E every expert already gets every token).
        num_bins: histogram resolution for the distributed path.
        mode: "exact" keeps the margins; "histogram" keeps per-expert histograms (what the
            distributed path needs); "auto" picks histogram when torch.distributed runs with more than
            one process, else exact.
    """

    def __init__(
        self, num_experts: int, top_k: int, num_bins: int = 1000, mode: BalancerMode = "auto"
    ) -> None:
        self.num_experts = num_experts
        self.top_k = top_k
        self.num_bins = num_bins
        self.mode: BalancerMode = mode
        self.reset()

    def reset(self) -> None:
        """Forget the statistics gathered since the last update."""
        self.margins: list[torch.Tensor] = []
        self.histogram: torch.Tensor | None = None
        self.bin_lower: float | None = None
        self.bin_width: float | None = None
        self.loads: torch.Tensor | None = None
        self.num_tokens = 0

    def resolved_mode(self) -> Literal["exact", "histogram"]:
        if self.mode != "auto":
            return self.mode
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        return "histogram" if distributed else "exact"

    @torch.no_grad()
    def observe(self, scores: torch.Tensor, topk_idx: torch.Tensor, bias: torch.Tensor) -> None:
        """Record one micro-batch: scores [N, E] raw router scores of real tokens, topk_idx [N, k] the
        experts they chose, bias [E] the selection bias in force."""
        if self.top_k >= self.num_experts or scores.shape[0] == 0:
            return
        scores = scores.float()
        biased = scores + bias.float()
        cutoff = biased.topk(self.top_k + 1, dim=-1).values[:, -1:]
        margins = cutoff - scores  # [N, E]: the bias expert j needs to enter token i's top-k
        chosen = topk_idx.flatten()
        # scatter_add, not bincount: bincount sizes its output from the data (a host sync on CUDA)
        loads = torch.zeros(self.num_experts, dtype=torch.long, device=chosen.device)
        loads.scatter_add_(0, chosen, torch.ones_like(chosen))
        self.loads = loads if self.loads is None else self.loads + loads
        self.num_tokens += scores.shape[0]
        if self.resolved_mode() == "exact":
            self.margins.append(margins)
            return
        self._init_histogram(bias)
        bins = ((margins - self.bin_lower) / self.bin_width).floor().long().clamp_(0, self.num_bins - 1)
        self.histogram.scatter_add_(1, bins.t(), torch.ones_like(bins.t()))

    def _init_histogram(self, bias: torch.Tensor) -> None:
        # The bias is replicated across ranks, so every rank derives the same bins.
        if self.histogram is None:
            self.bin_lower = float(bias.min()) - 1.0
            self.bin_width = (float(bias.max()) - float(bias.min()) + 2.0) / self.num_bins
            self.histogram = torch.zeros(
                self.num_experts, self.num_bins, dtype=torch.int64, device=bias.device
            )

    def histogram_quantile(self, q: float) -> torch.Tensor:
        """Per-expert q-quantile [E] read from the (pooled) histogram."""
        hist = self.histogram
        counts = hist.sum(-1)
        target = counts.double() * q
        cum = hist.cumsum(-1)
        target_bin = (cum < target.ceil().long()[:, None]).sum(-1).clamp_(max=self.num_bins - 1)
        in_bin = hist.gather(-1, target_bin[:, None]).squeeze(-1)
        before = cum.gather(-1, target_bin[:, None]).squeeze(-1) - in_bin
        fraction = ((target - before.double()) / in_bin.clamp(min=1).double()).clamp(0, 1)
        return (self.bin_lower + (target_bin.double() + fraction) * self.bin_width).float()

    @torch.no_grad()
    def next_bias(self, bias: torch.Tensor) -> torch.Tensor | None:
        """The mean-centred k/E quantiles of the margins, or None when no token was observed.

        In histogram mode every rank must call this (it all-reduces the histograms when
        torch.distributed is initialised, also from a rank that saw no token)."""
        q = self.top_k / self.num_experts
        if self.top_k >= self.num_experts:
            return None
        if self.resolved_mode() == "exact":
            if not self.margins:
                return None
            quantiles = exact_quantile(torch.cat(self.margins), q)
        else:
            self._init_histogram(bias)
            if dist.is_available() and dist.is_initialized():
                dist.all_reduce(self.histogram, op=dist.ReduceOp.SUM)
            if int(self.histogram.sum()) == 0:
                return None
            quantiles = self.histogram_quantile(q)
        return quantiles - quantiles.mean()


@torch.no_grad()
def update_router_bias(model: nn.Module) -> dict[str, float]:
    """Set every MoE gate's `e_score_correction_bias` from the statistics of the training forwards
    since the last call, then clear them. Call after each optimizer step.

    Returns:
        metrics: `router_load_imbalance` (largest expert load / mean load over all gates, local
        tokens) and `router_bias_abs_max`; empty when no gate observed any token.
    """
    imbalance, bias_max = 0.0, 0.0
    updated = False
    for module in model.modules():
        balancer = getattr(module, "balancer", None)
        if not isinstance(balancer, QuantileBalancer):
            continue
        new_bias = balancer.next_bias(module.e_score_correction_bias)
        if new_bias is not None:
            module.e_score_correction_bias.copy_(new_bias)
            bias_max = max(bias_max, float(new_bias.abs().max()))
            updated = True
        if balancer.loads is not None:
            loads = balancer.loads.float()
            imbalance = max(imbalance, float(loads.max() / loads.mean().clamp(min=1e-9)))
        balancer.reset()
    return {"router_load_imbalance": imbalance, "router_bias_abs_max": bias_max} if updated else {}
