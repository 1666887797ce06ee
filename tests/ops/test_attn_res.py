"""Block Attention Residual mix: the memory-lean op equals the naive spec, forward and every
gradient (sources, norm weight, query), over odd shapes and source counts."""

from __future__ import annotations

import pytest
import torch

from posttrain.ops.attn_res import attn_res_mix, naive_attn_res


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float(
        (a.float() - b.float()).pow(2).mean().sqrt() / b.float().pow(2).mean().sqrt().clamp(min=1e-12)
    )


@pytest.mark.parametrize("num_sources", [1, 2, 5])
@pytest.mark.parametrize("shape", [(1, 1, 60), (2, 37, 60), (100, 33)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_and_grads_match_naive(num_sources, shape, dtype) -> None:
    torch.manual_seed(num_sources)
    D = shape[-1]
    sources = [(torch.randn(shape) * (i + 1)).to(dtype).requires_grad_() for i in range(num_sources)]
    norm_weight = (1 + 0.1 * torch.randn(D)).requires_grad_()
    query = (0.5 * torch.randn(D)).requires_grad_()
    grad_out = torch.randn(shape).to(dtype)
    inputs = (*sources, norm_weight, query)
    results = []
    for fn in (naive_attn_res, attn_res_mix):
        out = fn(sources, norm_weight, query, 1e-5)
        results.append((out, torch.autograd.grad(out, inputs, grad_out, allow_unused=True)))
    (ref, ref_grads), (got, got_grads) = results
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert got.dtype == ref.dtype == dtype
    assert rel_rms(got, ref) < tol
    for g_ref, g_got in zip(ref_grads, got_grads, strict=True):
        if g_got is None:  # one source: the weight is a constant 1, nothing reaches w or q
            assert num_sources == 1 and (g_ref is None or not g_ref.abs().sum() > 0)
            continue
        assert rel_rms(g_got, g_ref) < tol


def test_gradients_against_finite_differences() -> None:
    torch.manual_seed(3)
    sources = [torch.randn(3, 7, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    w = torch.randn(7, dtype=torch.float64, requires_grad=True)
    q = torch.randn(7, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda a, b, c, w, q: attn_res_mix([a, b, c], w, q, 1e-5), (*sources, w, q)
    )


def test_zero_query_mixes_uniformly() -> None:
    sources = [torch.randn(4, 16) for _ in range(3)]
    out = attn_res_mix(sources, torch.ones(16), torch.zeros(16))
    torch.testing.assert_close(out, sum(sources) / 3)
