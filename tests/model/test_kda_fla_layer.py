"""KDA's fla-fused training path (`posttrain.ops.kda.fla_layer`: conv + SiLU in fla's
`causal_conv1d`, l2norm, the bounded gate and beta's sigmoid inside fla's `chunk_kda`) against the
layer's unfused path, which is tested against the naive spec on the CPU: forward and the gradient of
the input and of every parameter on an odd length under bf16 autocast (a `gpu` test; it passed on
an H200). Which forwards take the fused path is a CPU test: packed rows and float32 compute do not
(their fla kernels have not been checked on a GPU), nor does the CPU."""

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
    assert not layer.fuse_on_fla(torch.zeros(1, 3, tiny_config.hidden_size), None, None, None)


def test_fused_path_only_for_checked_forwards(tiny_config, monkeypatch):
    """With fla taking the tensor, only unpadded, unpacked, uncached bf16-autocast training forwards
    fuse: the one configuration compared with the unfused path on a GPU."""
    monkeypatch.setattr("posttrain.model.kda.fla_layer_available", lambda x: True)
    monkeypatch.setattr("torch.is_autocast_enabled", lambda device_type=None: True)
    dtype = {"value": torch.bfloat16}
    monkeypatch.setattr("torch.get_autocast_dtype", lambda device_type: dtype["value"])
    layer = kda_layer(tiny_config, 2, 16)
    x = torch.zeros(1, 5, tiny_config.hidden_size)
    assert layer.fuse_on_fla(x, None, None, None)
    assert not layer.fuse_on_fla(x, torch.ones(1, 5), None, None)
    assert not layer.fuse_on_fla(x, None, torch.tensor([0, 2, 5]), None)
    with torch.no_grad():
        assert not layer.fuse_on_fla(x, None, None, None)
    dtype["value"] = torch.float16
    assert not layer.fuse_on_fla(x, None, None, None)
    monkeypatch.setattr("torch.is_autocast_enabled", lambda device_type=None: False)
    dtype["value"] = torch.bfloat16
    assert not layer.fuse_on_fla(x, None, None, None)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def run(layer, x):
    x = x.clone().requires_grad_(True)
    with torch.autocast("cuda", torch.bfloat16):
        out = layer(x, None, None, None)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out)
    params = [x, *layer.parameters()]
    return out.float(), list(torch.autograd.grad(out, params, g))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fla_fused_layer_matches_unfused(tiny_config, monkeypatch):
    pytest.importorskip("fla")
    # head_dim 128: K3's (and the train-step bench's), whose fla kernels a carried Triton cache holds
    layer = kda_layer(tiny_config, 2, 128).cuda()
    x = torch.randn(2, 100, tiny_config.hidden_size, generator=torch.Generator().manual_seed(2)).cuda()
    with torch.autocast("cuda", torch.bfloat16):
        assert layer.fuse_on_fla(x, None, None, None)
    fused, fused_grads = run(layer, x)
    monkeypatch.setattr("posttrain.model.kda.fla_layer_available", lambda x: False)
    ref, ref_grads = run(layer, x)
    tol = 3e-2
    assert rel(fused, ref) < tol
    names = ["x", *(n for n, _ in layer.named_parameters())]
    errors = {n: rel(a, b) for n, a, b in zip(names, fused_grads, ref_grads, strict=True)}
    assert max(errors.values()) < tol, errors
