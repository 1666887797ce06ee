"""Stacked input projections (`posttrain.model.projections`): one GEMM over several modules'
weights gives each module's output, in a KDA layer and in an MoE block (forward and gradients,
float64, the stacking forced on the CPU); a wrapped projection (as LoRA wraps one) is never
stacked, and the CPU does not stack by default."""

from __future__ import annotations

import pytest
import torch

from posttrain.model.kda import KimiK3DeltaAttention
from posttrain.model.moe import KimiK3SparseMoeBlock
from posttrain.model.projections import stacked_projection, stacks_projections


class Wrapped(torch.nn.Module):
    """Stands in for a LoRA layer around a projection: its own forward must run."""

    def __init__(self, inner: torch.nn.Linear) -> None:
        super().__init__()
        self.inner, self.out_features = inner, inner.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) + 1.0


def seeded(module: torch.nn.Module) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.3)
    return module


def test_cpu_does_not_stack_and_wrapped_layers_are_refused():
    x = torch.randn(3, 8)
    assert not stacks_projections(x)
    a, b = torch.nn.Linear(8, 4, bias=False), torch.nn.Linear(8, 5, bias=False)
    out = stacked_projection(x, [a, b])
    torch.testing.assert_close(out, torch.cat([a(x), b(x)], -1))
    assert stacked_projection(x, [a, Wrapped(b)]) is None
    assert stacked_projection(x, [a, torch.nn.Linear(8, 5)]) is None  # a bias


@pytest.mark.parametrize("full_rank_gate", [True, False])
def test_kda_stacked_projections_equal_the_modules(tiny_config, monkeypatch, full_rank_gate):
    monkeypatch.setattr("posttrain.model.kda.stacks_projections", lambda t: True)
    tiny_config.linear_attn_config = dict(tiny_config.linear_attn_config, use_full_rank_gate=full_rank_gate)
    layer = seeded(KimiK3DeltaAttention(tiny_config, 0).double())
    x = torch.randn(2, 5, tiny_config.hidden_size, dtype=torch.float64)
    gate = layer.g_proj(x) if full_rank_gate else layer.g_b_proj(layer.g_a_proj(x))
    qkv = torch.cat([layer.q_proj(x), layer.k_proj(x), layer.v_proj(x)], -1)
    for got, want in zip(
        layer._input_projections(x), (qkv, gate, layer.f_a_proj(x), layer.b_proj(x)), strict=True
    ):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    layer.q_proj = Wrapped(layer.q_proj)
    width = qkv.shape[-1] // 3
    torch.testing.assert_close(layer._input_projections(x)[0][..., :width], qkv[..., :width] + 1.0)


def test_moe_block_stacked_equals_unstacked(tiny_config, monkeypatch):
    block = seeded(KimiK3SparseMoeBlock(tiny_config).double())
    assert block.use_latent and block.shared_experts is not None
    x = torch.randn(2, 7, tiny_config.hidden_size, dtype=torch.float64)

    def run(stack: bool) -> list[torch.Tensor]:
        monkeypatch.setattr("posttrain.model.moe.stacks_projections", lambda t: stack)
        xr = x.clone().requires_grad_(True)
        out = block(xr)
        params = [xr, *(p for p in block.parameters() if p.requires_grad)]
        return [out, *torch.autograd.grad(out, params, torch.ones_like(out))]

    for got, want in zip(run(True), run(False), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("padded", [False, True])
def test_kda_layer_stacked_equals_unstacked(tiny_config, monkeypatch, padded):
    layer = seeded(KimiK3DeltaAttention(tiny_config, 0).double())
    with torch.no_grad():
        layer.A_log.copy_(torch.linspace(0.0, 2.0, layer.A_log.numel()))
    x = torch.randn(2, 9, tiny_config.hidden_size, dtype=torch.float64)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1], [1] * 9]) if padded else None

    def run(stack: bool) -> list[torch.Tensor]:
        monkeypatch.setattr("posttrain.model.kda.stacks_projections", lambda t: stack)
        xr = x.clone().requires_grad_(True)
        out = layer(xr, mask)
        return [out, *torch.autograd.grad(out, [xr, *layer.parameters()], torch.ones_like(out))]

    for got, want in zip(run(True), run(False), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
