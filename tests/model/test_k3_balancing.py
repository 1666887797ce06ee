"""Quantile Balancing: the exact single-process quantile, the histogram estimate, the two-process
all_reduce, and that the updates actually even out expert loads."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from posttrain.model import QuantileBalancer
from posttrain.model.balancing import update_router_bias
from posttrain.model.configuration_kimi_k3 import KimiK3Config
from posttrain.model.moe import KimiK3MoEGate

E, K = 8, 2


def skewed_scores(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, E, generator=g) + torch.linspace(-1.5, 1.5, E)  # later experts favoured
    return torch.sigmoid(logits)


def reference_bias(scores: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The spec, independently: margins alpha_i - s_ij, k/E quantile per expert, mean-centred."""
    alpha = (scores + bias).sort(dim=-1, descending=True).values[:, K]
    margins = alpha[:, None] - scores
    q = torch.quantile(margins, K / E, dim=0)
    return q - q.mean()


def observe(balancer: QuantileBalancer, scores: torch.Tensor, bias: torch.Tensor) -> None:
    balancer.observe(scores, (scores + bias).topk(K, dim=-1).indices, bias)


def test_exact_mode_is_torch_quantile() -> None:
    scores, bias = skewed_scores(501), torch.linspace(-0.1, 0.1, E)
    balancer = QuantileBalancer(E, K, mode="exact")
    observe(balancer, scores[:200], bias)  # two micro-batches pool into one quantile
    observe(balancer, scores[200:], bias)
    torch.testing.assert_close(balancer.next_bias(bias), reference_bias(scores, bias), atol=1e-6, rtol=0)


def test_histogram_mode_is_within_one_bin_of_the_exact_quantile() -> None:
    scores, bias = skewed_scores(4000, seed=1), torch.linspace(-0.2, 0.2, E)
    balancer = QuantileBalancer(E, K, num_bins=1000, mode="histogram")
    observe(balancer, scores, bias)
    bin_width = (0.4 + 2.0) / 1000
    assert (balancer.next_bias(bias) - reference_bias(scores, bias)).abs().max() < bin_width


def test_updates_even_out_expert_loads() -> None:
    config = KimiK3Config(
        hidden_size=16, num_experts=E, num_experts_per_token=K, routed_expert_hidden_size=None
    )
    gate = KimiK3MoEGate(config).train()
    torch.manual_seed(0)
    with torch.no_grad():
        gate.weight.normal_(0, 0.3)
        gate.weight[:, 0] += torch.linspace(-1.0, 1.0, E)  # a feature most tokens share favours late experts
    x = torch.randn(2048, 16) + torch.tensor([2.0] + [0.0] * 15)

    def loads() -> torch.Tensor:
        return torch.bincount(gate(x)[0].flatten(), minlength=E).float() / (2048 * K / E)

    with torch.no_grad():
        before = loads()
        update_router_bias(gate)
        for _ in range(15):
            gate(x)
            metrics = update_router_bias(gate)
        after = loads()
    assert before.max() > 2.0  # badly imbalanced to start with
    assert (after - 1).abs().max() < 0.06  # every expert within 6% of k/E of the tokens
    assert abs(float(gate.e_score_correction_bias.mean())) < 1e-6
    assert metrics["router_load_imbalance"] < 1.06


def _two_rank_worker(rank: int, workdir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{workdir}/store", rank=rank, world_size=2)
    scores, bias = skewed_scores(3000, seed=2), torch.linspace(-0.3, 0.3, E)
    balancer = QuantileBalancer(E, K, mode="auto")
    assert balancer.resolved_mode() == "histogram"
    observe(balancer, scores[rank::2], bias)  # each rank sees half of the tokens
    torch.save(balancer.next_bias(bias), f"{workdir}/rank{rank}.pt")
    dist.destroy_process_group()


def test_two_processes_pool_histograms_with_one_all_reduce(tmp_path) -> None:
    # spawn, not fork: a child forked after torch started its OpenMP pool can deadlock in its
    # first parallel op (seen in CI: both ranks hung inside observe()).
    mp.start_processes(
        _two_rank_worker, args=(os.fspath(tmp_path),), nprocs=2, join=True, start_method="spawn"
    )
    scores, bias = skewed_scores(3000, seed=2), torch.linspace(-0.3, 0.3, E)
    pooled = QuantileBalancer(E, K, mode="histogram")
    observe(pooled, scores, bias)
    expected = pooled.next_bias(bias)
    for rank in (0, 1):
        torch.testing.assert_close(torch.load(tmp_path / f"rank{rank}.pt"), expected, atol=1e-6, rtol=0)
