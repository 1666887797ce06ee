"""KimiK3Experts against the per-token spec (`naive_moe_experts`), forward and gradients.

Routings are built by hand so that experts are uneven (one takes most rows) and some are empty,
on odd sizes. The CPU tests exercise the per-expert path; the `gpu` tests the grouped-GEMM path
(bf16 on sm90+), including that its forward and backward make no host sync.
"""

from __future__ import annotations

import pytest
import torch

from posttrain.model import KimiK3Config
from posttrain.model.moe import KimiK3Experts, KimiK3SparseMoeBlock, grouped_mm_dtype
from posttrain.model.moe_naive import naive_moe_experts
from posttrain.qat import MXFakeQuant

EMPTY = (2, 5)  # experts no token picks


def experts_config(tiny_config: KimiK3Config, E: int, k: int, I: int) -> KimiK3Config:
    tiny_config.num_experts, tiny_config.num_experts_per_token, tiny_config.moe_intermediate_size = E, k, I
    return tiny_config


def uneven_routing(N: int, E: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """k distinct experts per token, expert 0 favoured 20:1, the EMPTY experts never picked."""
    odds = torch.ones(E, dtype=torch.float64)
    odds[0] = 20.0
    odds[[e for e in EMPTY if e < E]] = 0.0
    idx = torch.multinomial(odds.expand(N, E), k, replacement=False, generator=gen)
    weight = torch.rand(N, k, generator=gen, dtype=torch.float64) + 0.1
    return idx, weight


def make_experts(config: KimiK3Config, D: int, dtype: torch.dtype, gen: torch.Generator) -> KimiK3Experts:
    module = KimiK3Experts(config, D).to(dtype)
    with torch.no_grad():
        for w in (module.w1, module.w3, module.w2):
            w.copy_(torch.randn(w.shape, generator=gen, dtype=torch.float64) / w.shape[-1] ** 0.5)
    return module


def grads(out: torch.Tensor, g: torch.Tensor, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return list(torch.autograd.grad(out, tensors, g))


@pytest.mark.parametrize(
    ("N", "E", "k", "D", "I"), [(13, 7, 3, 24, 40), (1, 4, 1, 8, 8), (29, 9, 2, 40, 16), (64, 6, 4, 16, 24)]
)
def test_per_expert_path_matches_naive(tiny_config, N, E, k, D, I):
    gen = torch.Generator().manual_seed(N * 100 + E)
    config = experts_config(tiny_config, E, k, I)
    module = make_experts(config, D, torch.float64, gen)
    x = torch.randn(N, D, generator=gen, dtype=torch.float64, requires_grad=True)
    idx, weight = uneven_routing(N, E, k, gen)
    weight.requires_grad_(True)
    out = module(x, idx, weight)
    ref = naive_moe_experts(config, x, idx, weight, module.w1, module.w3, module.w2)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    g = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    params = [x, weight, module.w1, module.w3, module.w2]
    got = grads(out, g, params)
    for a, b in zip(got, grads(ref, g, params), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    for e in EMPTY:
        if e < E:
            assert all(torch.equal(w[e], torch.zeros_like(w[e])) for w in got[2:])


def test_per_expert_path_with_qat_hooks_matches_naive(tiny_config):
    gen = torch.Generator().manual_seed(7)
    config = experts_config(tiny_config, 8, 2, 64)
    module = make_experts(config, 32, torch.float32, gen)
    module.weight_fake_quant = MXFakeQuant("mxfp4", "floor")
    module.act_fake_quant = aq = MXFakeQuant("mxfp8_e4m3", "rceil")
    x = torch.randn(21, 32, generator=gen, requires_grad=True)
    idx, weight = uneven_routing(21, 8, 2, gen)
    weight = weight.float()
    out = module(x, idx, weight)
    wq = module.weight_fake_quant
    ref = naive_moe_experts(config, x, idx, weight, wq(module.w1), wq(module.w3), wq(module.w2), aq)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    g = torch.randn(out.shape, generator=gen)
    params = [x, module.w1, module.w3, module.w2]
    for got, want in zip(grads(out, g, params), grads(ref, g, params), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_no_token_gives_empty_output(tiny_config):
    module = make_experts(experts_config(tiny_config, 4, 2, 8), 8, torch.float32, torch.Generator())
    out = module(torch.zeros(0, 8), torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2))
    assert out.shape == (0, 8)


def test_weight_gradients_are_not_zero_filled_per_expert(tiny_config):
    """Indexing w1[e] per expert adds a zero-filled [E, I, D] gradient per expert (SelectBackward);
    the experts' graph must have none of those nodes."""
    gen = torch.Generator().manual_seed(3)
    config = experts_config(tiny_config, 6, 2, 16)
    module = make_experts(config, 8, torch.float32, gen)
    idx, weight = uneven_routing(10, 6, 2, gen)
    names = graph_nodes(module(torch.randn(10, 8, generator=gen), idx, weight.float()))
    assert "SelectBackward0" not in names and "UnbindBackward0" in names


def graph_nodes(out: torch.Tensor) -> set[str]:
    """Class names of every autograd node behind out."""
    seen, stack = set(), [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        stack.extend(next_fn for next_fn, _ in node.next_functions)
    return {type(node).__name__ for node in seen}


@pytest.mark.parametrize(("N", "E", "k", "D", "I"), [(41, 7, 3, 24, 40), (5, 6, 1, 8, 16), (64, 9, 4, 16, 8)])
def test_grouped_path_on_cpu_matches_naive(tiny_config, monkeypatch, N, E, k, D, I):
    """The grouped path's sorting, device-side offsets, gathered gradient and un-permutation,
    run on the CPU: torch._grouped_mm computes bf16 forward and backward there too, and the
    dispatch is pointed at it (on CPU the module otherwise takes the per-expert path)."""
    monkeypatch.setattr("posttrain.model.moe.grouped_mm_dtype", lambda x, w: torch.bfloat16)
    gen = torch.Generator().manual_seed(N * 7 + k)
    config = experts_config(tiny_config, E, k, I)
    module = make_experts(config, D, torch.bfloat16, gen)
    x = torch.randn(N, D, generator=gen).to(torch.bfloat16).requires_grad_(True)
    idx, weight = uneven_routing(N, E, k, gen)
    weight = weight.float().requires_grad_(True)
    out = module(x, idx, weight)
    assert {"GroupedMmBackward0", "_GatherRowsBackward", "_CombineRowsBackward"} <= graph_nodes(out)
    params = [x, weight, module.w1, module.w3, module.w2]
    ref_params = [p.detach().double().requires_grad_(True) for p in params]
    ref = naive_moe_experts(config, ref_params[0], idx, *ref_params[1:])
    assert out.dtype == torch.bfloat16 and rel(out, ref) < 1e-2
    g = torch.randn(out.shape, generator=gen).to(torch.bfloat16)
    got = grads(out, g, params)
    for name, a, b in zip(
        ("x", "weight", "w1", "w3", "w2"), got, grads(ref, g.double(), ref_params), strict=True
    ):
        assert rel(a, b) < 1e-2, name
    for e in EMPTY:
        if e < E:
            assert all(torch.equal(w[e], torch.zeros_like(w[e])) for w in got[2:])


# --- GPU: the grouped-GEMM path ----------------------------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
sm90 = pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.get_device_capability()[0] < 9,
    reason="the grouped path needs sm90+ (Hopper)",
)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.gpu
@gpu
@sm90
@pytest.mark.parametrize("master", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("N", "E", "k", "D", "I"), [(300, 16, 4, 256, 128), (77, 7, 3, 40, 24)])
def test_grouped_path_matches_naive(tiny_config, master, N, E, k, D, I):
    """bf16 grouped GEMMs (autocast over fp32 masters, or bf16 weights) against the spec in
    float64 on the same bf16-rounded inputs: bf16 operand rounding, so relative error < 1e-2."""
    gen = torch.Generator().manual_seed(N + E)
    config = experts_config(tiny_config, E, k, I)
    module = make_experts(config, D, master, gen).cuda()
    x = torch.randn(N, D, generator=gen).to(torch.bfloat16).cuda().requires_grad_(True)
    idx, weight = uneven_routing(N, E, k, gen)
    idx, weight = idx.cuda(), weight.float().cuda().requires_grad_(True)
    with torch.autocast("cuda", torch.bfloat16, enabled=master == torch.float32):
        assert grouped_mm_dtype(x, module.w1) == torch.bfloat16
        out = module(x, idx, weight)
    params = [x, weight, module.w1, module.w3, module.w2]
    ref_params = [p.detach().cpu().to(torch.bfloat16).double().requires_grad_(True) for p in params]
    ref_params[1] = weight.detach().cpu().double().requires_grad_(True)
    ref = naive_moe_experts(config, ref_params[0], idx.cpu(), *ref_params[1:])
    assert rel(out.cpu(), ref) < 1e-2
    g = torch.randn(out.shape, generator=gen).to(out.dtype)
    got = grads(out, g.cuda(), params)
    want = grads(ref, g.double(), ref_params)
    for name, a, b in zip(("x", "weight", "w1", "w3", "w2"), got, want, strict=True):
        assert a.dtype == params[["x", "weight", "w1", "w3", "w2"].index(name)].dtype
        assert rel(a.cpu(), b) < 1e-2, name
    for e in EMPTY:
        assert torch.equal(got[2][e].cpu(), torch.zeros_like(got[2][e].cpu()))  # empty expert: 0


@pytest.mark.gpu
@gpu
@sm90
def test_moe_block_trains_without_host_sync(tiny_config):
    """A whole MoE block (router with balancing statistics, grouped experts with QAT hooks, shared
    expert) forward and backward under autocast, with CUDA's sync debug mode raising on any sync."""
    config = experts_config(tiny_config, 16, 4, 64)
    torch.manual_seed(0)
    block = KimiK3SparseMoeBlock(config)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.05)
    block = block.cuda().train()
    block.experts.weight_fake_quant = MXFakeQuant("mxfp4", "floor")
    block.experts.act_fake_quant = MXFakeQuant("mxfp8_e4m3", "rceil")
    x = torch.randn(4, 96, config.hidden_size, device="cuda", requires_grad=True)
    for sync_mode in ("default", "error"):  # first pass compiles kernels outside the check
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode(sync_mode)
        try:
            with torch.autocast("cuda", torch.bfloat16):
                out = block(x)
            out.float().square().mean().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert block.experts.w1.grad is not None and torch.isfinite(block.experts.w1.grad).all()


@pytest.mark.gpu
@gpu
@sm90
def test_grouped_path_takes_no_token(tiny_config):
    module = make_experts(experts_config(tiny_config, 4, 2, 16), 16, torch.float32, torch.Generator()).cuda()
    x = torch.zeros(0, 16, device="cuda", requires_grad=True)
    with torch.autocast("cuda", torch.bfloat16):
        out = module(x, torch.zeros(0, 2, dtype=torch.long, device="cuda"), torch.zeros(0, 2, device="cuda"))
    assert out.shape == (0, 16)
