"""KDA's fla-fused training path (`posttrain.ops.kda.fla_layer`: conv + SiLU in fla's
`causal_conv1d`, l2norm, the bounded gate and beta's sigmoid inside fla's `chunk_kda`) against the
layer's unfused path, which is tested against the naive spec on the CPU: forward and the gradient of
the input and of every parameter, on an odd length, with packed documents, in float32 and under
bf16 autocast (`gpu` tests). On the CPU the layer never takes the fused path."""

from __future__ import annotations

import pytest
import torch

from posttrain.model import KimiK3Config
from posttrain.model.kda import KimiK3DeltaAttention


def kda_layer(tiny_config: KimiK3Config, heads: int, head_dim: int) -> KimiK3DeltaAttention:
    tiny_config.linear_attn_config = dict(tiny_config.linear_attn_config, num_heads=heads, head_dim=head_dim)
    layer = KimiK3DeltaAttention(tiny_config, 0)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name == "A_log":
                p.copy_(torch.empty(p.shape).uniform_(1.0, 16.0, generator=gen).log())
            elif name == "dt_bias":
                p.copy_(torch.randn(p.shape, generator=gen) - 3.0)
            elif name == "o_norm.weight":
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    return layer


def test_cpu_forward_stays_unfused(tiny_config):
    layer = kda_layer(tiny_config, 2, 16)
    assert not layer.fuse_on_fla(torch.zeros(1, 3, tiny_config.hidden_size), None, None)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def run(layer, x, cu_seqlens, autocast):
    x = x.clone().requires_grad_(True)
    with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
        out = layer(x, None, cu_seqlens, None)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out)
    params = [x, *layer.parameters()]
    return out.float(), list(torch.autograd.grad(out, params, g))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_fla_fused_layer_matches_unfused(tiny_config, monkeypatch, autocast, packed):
    pytest.importorskip("fla")
    layer = kda_layer(tiny_config, 4, 64).cuda()
    B, T = (1, 150) if packed else (2, 100)
    cu_seqlens = torch.tensor([0, 37, 100, 150], device="cuda") if packed else None
    x = torch.randn(B, T, tiny_config.hidden_size, generator=torch.Generator().manual_seed(2)).cuda()
    assert layer.fuse_on_fla(x, None, None)
    fused, fused_grads = run(layer, x, cu_seqlens, autocast)
    monkeypatch.setattr("posttrain.model.kda.fla_layer_available", lambda x: False)
    assert not layer.fuse_on_fla(x, None, None)
    ref, ref_grads = run(layer, x, cu_seqlens, autocast)
    tol = 3e-2 if autocast else 5e-3
    assert rel(fused, ref) < tol
    names = ["x", *(n for n, _ in layer.named_parameters())]
    errors = {n: rel(a, b) for n, a, b in zip(names, fused_grads, ref_grads, strict=True)}
    assert max(errors.values()) < tol, errors
