"""The grouped MoE path's row gather and weighted combine (`posttrain.ops.expert_rows`) against
their indexing spec, forward and gradients, on odd shapes with uneven choices: the torch twin on
the CPU, the Triton kernels under Triton's interpreter (a subprocess with TRITON_INTERPRET=1, so
CI runs them without a GPU) and on a GPU (`gpu` tests)."""

from __future__ import annotations

import pytest
import torch

from posttrain.ops.expert_rows import combine_rows, gather_rows, naive_combine_rows, naive_gather_rows
from tests.ops.interpreted import run_interpreted

SHAPES = [(13, 3, 40), (1, 1, 8), (29, 2, 1500), (7, 4, 17)]  # (N tokens, k choices, D width)


def routing(N: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order, token, inverse) of a random expert sort of the N x k rows, as KimiK3Experts makes them."""
    expert = torch.randint(0, 5, (N * k,), generator=gen)
    order = expert.argsort(stable=True)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(N * k))
    return order, order // k, inverse.view(N, k)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def check(N: int, k: int, D: int, dtype: torch.dtype, device: str, tol: float) -> dict[str, float]:
    """Forward and every gradient of gather_rows -> combine_rows against the spec; returns the errors."""
    gen = torch.Generator().manual_seed(N * 31 + k * 7 + D)
    _, token, inverse = routing(N, k, gen)
    x = torch.randn(N, D, generator=gen).to(dtype)
    y = torch.randn(N * k, D, generator=gen).to(dtype)
    weight = (torch.rand(N * k, generator=gen, dtype=torch.float64) + 0.1).to(
        torch.promote_types(dtype, torch.float32)
    )
    g_rows = torch.randn(N * k, D, generator=gen).to(dtype)
    g_out = torch.randn(N, D, generator=gen).to(dtype)
    token, inverse = token.to(device), inverse.to(device)
    errors = {}
    for name, fast, spec in (
        ("gather", gather_rows, naive_gather_rows),
        ("combine", combine_rows, naive_combine_rows),
    ):
        if name == "gather":
            inputs = [x.to(device).requires_grad_(True)]
            got = fast(inputs[0], token, inverse)
            ref_inputs = [x.double().requires_grad_(True)]
            want = spec(ref_inputs[0], token.cpu())
            g = g_rows
        else:
            inputs = [y.to(device).requires_grad_(True), weight.to(device).requires_grad_(True)]
            got = fast(inputs[0], inputs[1], token, inverse)
            ref_inputs = [y.double().requires_grad_(True), weight.double().requires_grad_(True)]
            want = spec(ref_inputs[0], ref_inputs[1], inverse.cpu())
            g = g_out
        assert got.dtype == dtype and got.shape == want.shape
        errors[f"{name}_out"] = rel(got.cpu(), want)
        grads = torch.autograd.grad(got, inputs, g.to(device))
        want_grads = torch.autograd.grad(want, ref_inputs, g.double())
        for i, (a, b) in enumerate(zip(grads, want_grads, strict=True)):
            assert a.dtype == inputs[i].dtype
            errors[f"{name}_grad{i}"] = rel(a.cpu(), b)
    assert max(errors.values()) < tol, errors
    return errors


@pytest.mark.parametrize(("N", "k", "D"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_torch_twin_matches_spec(N, k, D, dtype):
    check(N, k, D, dtype, "cpu", 1e-12 if dtype == torch.float64 else 1e-2)


def test_combine_sums_in_float32():
    """Eight bf16 rows of 1 + 2^-9 weighted by 1: a bf16 running sum would round at every step."""
    y = torch.full((8, 4), 1 + 2**-9, dtype=torch.bfloat16)
    token = torch.zeros(8, dtype=torch.long)
    out = combine_rows(y, torch.ones(8), token, torch.arange(8).view(1, 8))
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, torch.full((1, 4), 8 * (1 + 2**-9), dtype=torch.float32).to(torch.bfloat16))


INTERPRETED = """
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from tests.ops.test_expert_rows import SHAPES, check
from posttrain.ops.expert_rows import triton_rows
assert triton_rows.available(torch.zeros(1)), "TRITON_INTERPRET=1 should route CPU tensors to Triton"
print(json.dumps([check(N, k, D, torch.float32, "cpu", 1e-5) for N, k, D in SHAPES]))
"""


def test_triton_kernels_match_spec_interpreted():
    errors = run_interpreted(INTERPRETED)
    assert len(errors) == len(SHAPES) and all(max(e.values()) < 1e-5 for e in errors)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(("N", "k", "D"), [*SHAPES, (4096, 8, 1024)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernels_match_spec_on_gpu(N, k, D, dtype):
    check(N, k, D, dtype, "cuda", 1e-5 if dtype == torch.float32 else 1e-2)
