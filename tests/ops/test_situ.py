"""SiTU-GLU: the memory-lean op equals the naive spec, forward and both gradients, and has the
properties K3 relies on (bounded output, SwiGLU near zero)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from posttrain.ops.situ import naive_situ_glu, situ_glu


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float(
        (a.float() - b.float()).pow(2).mean().sqrt() / b.float().pow(2).mean().sqrt().clamp(min=1e-12)
    )


@pytest.mark.parametrize("shape", [(1, 1), (37, 60), (100, 24), (3, 5, 33)])
@pytest.mark.parametrize("linear_beta", [25.0, None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_and_grads_match_naive(shape, linear_beta, dtype) -> None:
    torch.manual_seed(0)
    gate = (torch.randn(shape) * 8).to(dtype).requires_grad_()
    up = (torch.randn(shape) * 40).to(dtype).requires_grad_()
    grad_out = torch.randn(shape).to(dtype)
    outs, grads = [], []
    for fn in (naive_situ_glu, situ_glu):
        out = fn(gate, up, 4.0, linear_beta)
        g, u = torch.autograd.grad(out, (gate, up), grad_out)
        outs.append(out)
        grads.append((g, u))
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert outs[0].dtype == outs[1].dtype == dtype
    assert rel_rms(outs[1], outs[0]) < tol
    assert rel_rms(grads[1][0], grads[0][0]) < tol
    assert rel_rms(grads[1][1], grads[0][1]) < tol


def test_gradients_against_finite_differences() -> None:
    torch.manual_seed(1)
    gate = torch.randn(6, 7, dtype=torch.float64, requires_grad=True)
    up = (torch.randn(6, 7, dtype=torch.float64) * 30).requires_grad_()
    assert torch.autograd.gradcheck(lambda g, u: situ_glu(g, u, 4.0, 25.0), (gate, up))


def test_bounded_and_swiglu_near_zero() -> None:
    big = torch.tensor([1e4, -1e4, 50.0])
    out = naive_situ_glu(big, torch.full_like(big, 1e4), 4.0, 25.0)
    assert out.abs().max() <= 4.0 * 25.0
    torch.testing.assert_close(out[0], torch.tensor(100.0))
    small_g, small_u = torch.linspace(-0.05, 0.05, 11), torch.linspace(0.02, -0.03, 11)
    torch.testing.assert_close(
        naive_situ_glu(small_g, small_u), F.silu(small_g) * small_u, atol=1e-6, rtol=2e-3
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape", [(1, 1), (37, 60), (3, 5, 33), (4099, 768)])
@pytest.mark.parametrize("linear_beta", [25.0, None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernels_match_naive_on_gpu(shape, linear_beta, dtype) -> None:
    from posttrain.ops.situ import triton_glu

    torch.manual_seed(0)
    gate = (torch.randn(shape, device="cuda") * 8).to(dtype).requires_grad_()
    up = (torch.randn(shape, device="cuda") * 40).to(dtype).requires_grad_()
    grad_out = torch.randn(shape, device="cuda").to(dtype)
    assert triton_glu.triton_available(gate)
    out = situ_glu(gate, up, 4.0, linear_beta)
    assert out.dtype == dtype
    g, u = torch.autograd.grad(out, (gate, up), grad_out)
    # the spec in float64 on the same inputs
    g64, u64 = gate.detach().double().requires_grad_(), up.detach().double().requires_grad_()
    ref = naive_situ_glu(g64, u64, 4.0, linear_beta)
    rg, ru = torch.autograd.grad(ref, (g64, u64), grad_out.double())
    tol = 1e-6 if dtype == torch.float32 else 8e-3
    assert rel_rms(out, ref) < tol
    assert rel_rms(g, rg) < tol
    assert rel_rms(u, ru) < tol
