"""Quantile Balancing's histogram path against the exact one, with the bound balancing.py states:
|histogram quantile - exact quantile| <= one bin width + the gap between the two order statistics the
exact quantile interpolates. Histograms of shards are summed as the all-reduce sums them (integer
counts, so the pooled histogram is that of the whole batch, bit for bit)."""

from __future__ import annotations

import pytest
import torch

from posttrain.model.balancing import QuantileBalancer, exact_quantile

E, K = 8, 2


def margins_of(scores: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    cutoff = (scores + bias).topk(K + 1, dim=-1).values[:, -1:]
    return cutoff - scores


@pytest.mark.parametrize("n", [1, 2, 7, 100, 5000])
@pytest.mark.parametrize("num_bins", [37, 1000])
def test_pooled_histogram_quantile_is_within_the_stated_bound(n: int, num_bins: int) -> None:
    g = torch.Generator().manual_seed(n * num_bins)
    scores = torch.sigmoid(torch.randn(n, E, generator=g) * 2 + torch.linspace(-1, 1, E))
    bias = torch.randn(E, generator=g) * 0.3
    topk = (scores + bias).topk(K, dim=-1).indices
    shards = [QuantileBalancer(E, K, num_bins=num_bins, mode="histogram") for _ in range(3)]
    for rank, balancer in enumerate(shards):
        balancer.observe(scores[rank::3], topk[rank::3], bias)  # a rank with no token is fine
    pooled, whole = shards[0], QuantileBalancer(E, K, num_bins=num_bins, mode="histogram")
    for other in shards[1:]:
        if other.histogram is not None:
            pooled._init_histogram(bias)
            pooled.histogram += other.histogram
    whole.observe(scores, topk, bias)
    assert torch.equal(pooled.histogram, whole.histogram)

    q = K / E
    estimate = pooled.histogram_quantile(q)
    margins = margins_of(scores, bias)
    exact = exact_quantile(margins, q)
    ordered = margins.sort(dim=0).values
    lo = int(q * (n - 1))
    gap = ordered[min(lo + 1, n - 1)] - ordered[lo]
    bound = pooled.bin_width + gap + 1e-6  # 1e-6: a margin on a bin edge may round into its neighbour
    assert ((estimate - exact).abs() <= bound).all()
    if n == 5000 and num_bins == 1000:  # dense data: the gap term is negligible, one bin remains
        assert float((estimate - exact).abs().max()) <= 1.5 * pooled.bin_width


def test_histogram_mode_leaves_exact_mode_unchanged() -> None:
    """One process without torch.distributed: "auto" is exact, the margins themselves."""
    g = torch.Generator().manual_seed(0)
    scores, bias = torch.rand(33, E, generator=g), torch.zeros(E)
    balancer = QuantileBalancer(E, K)
    assert balancer.resolved_mode() == "exact"
    balancer.observe(scores, scores.topk(K, dim=-1).indices, bias)
    quantiles = exact_quantile(margins_of(scores, bias), K / E)
    assert torch.equal(balancer.next_bias(bias), quantiles - quantiles.mean())
