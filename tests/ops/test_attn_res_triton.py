"""The Triton Block Attention Residual mix (`posttrain.ops.attn_res.triton_mix`) against the naive
spec in float64, forward and every gradient (each source, norm weight, query), on odd shapes, 2..6
sources of mixed float32/bfloat16 and D wider than the kernels' chunk: under Triton's interpreter
(a subprocess with TRITON_INTERPRET=1, so CI runs it without a GPU) and on a GPU (`gpu` tests,
which also compare it with the compiled and eager torch twins at a benchmark shape)."""

from __future__ import annotations

import pytest
import torch

from tests.ops.interpreted import run_interpreted

F32, BF16 = torch.float32, torch.bfloat16
# (leading shape, D, source dtypes, param dtype, widest chunk of D): chunks of 16 over D = 60 and of
# 512 over D = 1500 run the kernels' multi-chunk loops with a masked tail.
CASES = [
    ((37,), 60, (F32, F32), F32, 2048),
    ((1,), 8, (BF16, F32, BF16), F32, 2048),
    ((2, 19), 60, (F32, BF16, BF16, BF16), F32, 16),
    ((5,), 1500, (F32, BF16, F32, BF16, BF16, BF16), F32, 512),
    ((11,), 33, (BF16, BF16, BF16, BF16, F32), BF16, 16),
]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def tol(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == F32 else 1e-2


def check(lead, D, dtypes, param_dtype, device: str, fast=None) -> dict[str, float]:
    """`fast` (default the Triton autograd node) against `naive_attn_res` in float64; returns the
    relative errors, each within its tensor's dtype tolerance."""
    from posttrain.ops.attn_res import naive_attn_res
    from posttrain.ops.attn_res.triton_mix import TritonAttnResMix

    fast = fast or (lambda xs, w, q: TritonAttnResMix.apply(w, q, 1e-5, *xs))
    gen = torch.Generator().manual_seed(D * 7 + len(dtypes))
    shape = (*lead, D)
    sources = [(torch.randn(shape, generator=gen) * (i + 1) + 0.3 * i).to(dt) for i, dt in enumerate(dtypes)]
    norm_weight = (1 + 0.2 * torch.randn(D, generator=gen)).to(param_dtype)
    query = (0.5 * torch.randn(D, generator=gen)).to(param_dtype)
    grad_out = torch.randn(shape, generator=gen).to(dtypes[-1])
    inputs = [t.to(device).requires_grad_(True) for t in (*sources, norm_weight, query)]
    ref_inputs = [t.double().requires_grad_(True) for t in (*sources, norm_weight, query)]
    got = fast(inputs[:-2], inputs[-2], inputs[-1])
    want = naive_attn_res(ref_inputs[:-2], ref_inputs[-2], ref_inputs[-1], 1e-5)
    assert got.dtype == dtypes[-1] and got.shape == shape
    errors = {"out": rel(got.cpu(), want)}
    limits = {"out": tol(got.dtype)}
    grads = torch.autograd.grad(got, inputs, grad_out.to(device))
    want_grads = torch.autograd.grad(want, ref_inputs, grad_out.double())
    names = [f"grad_x{i}" for i in range(len(dtypes))] + ["grad_norm_weight", "grad_query"]
    for name, x, a, b in zip(names, inputs, grads, want_grads, strict=True):
        assert a.dtype == x.dtype and a.shape == x.shape, name
        errors[name], limits[name] = rel(a.cpu(), b), tol(a.dtype)
    assert all(errors[k] < limits[k] for k in errors), errors
    return errors


INTERPRETED = """
import json, sys, time, torch
sys.path.insert(0, sys.argv[1])
from posttrain.ops.attn_res import attn_res_mix, triton_mix
from tests.ops.test_attn_res_triton import CASES, check
x = torch.zeros(1)
assert triton_mix.available([x], x, x), "TRITON_INTERPRET=1 should route CPU tensors to Triton"
start, errors = time.perf_counter(), []
for lead, D, dtypes, param_dtype, block in CASES:
    triton_mix.MAX_BLOCK_D = block
    errors.append(check(lead, D, dtypes, param_dtype, "cpu"))
# attn_res_mix dispatches to the kernels here: one case through it.
f32 = torch.float32
errors.append(check((3,), 24, (f32, f32, f32), f32, "cpu", lambda xs, w, q: attn_res_mix(xs, w, q)))
print(json.dumps({"errors": errors, "seconds": time.perf_counter() - start}))
"""


def test_triton_mix_matches_spec_interpreted():
    result = run_interpreted(INTERPRETED)
    assert len(result["errors"]) == len(CASES) + 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", CASES)
def test_triton_mix_matches_spec_on_gpu(case):
    from posttrain.ops.attn_res import triton_mix

    lead, D, dtypes, param_dtype, block = case
    old, triton_mix.MAX_BLOCK_D = triton_mix.MAX_BLOCK_D, block
    try:
        check(lead, D, dtypes, param_dtype, "cuda")
    finally:
        triton_mix.MAX_BLOCK_D = old


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_mix_matches_torch_twins_at_bench_shape():
    """M = 16384, D = 2048, S = 5 (a float32 embedding, bf16 block sums): the Triton node against the
    compiled region (`mix_by_sources` under torch.compile) and the eager `_AttnResMix`."""
    from posttrain.ops.attn_res.fused import _AttnResMix, mix_by_sources
    from posttrain.ops.attn_res.triton_mix import TritonAttnResMix
    from posttrain.ops.fusion import compiled

    gen = torch.Generator(device="cuda").manual_seed(0)
    M, D = 16384, 2048
    dtypes = (F32, BF16, BF16, BF16, BF16)
    sources = [
        (torch.randn(M, D, device="cuda", generator=gen) * (1 + i)).to(dt).requires_grad_()
        for i, dt in enumerate(dtypes)
    ]
    norm_weight = (1 + 0.1 * torch.randn(D, device="cuda", generator=gen)).requires_grad_()
    query = (0.05 * torch.randn(D, device="cuda", generator=gen)).requires_grad_()
    grad_out = torch.randn(M, D, device="cuda", generator=gen).to(BF16)
    inputs = (*sources, norm_weight, query)
    runs = {
        "triton": lambda: TritonAttnResMix.apply(norm_weight, query, 1e-5, *sources),
        "compiled": lambda: compiled(mix_by_sources)(tuple(sources), norm_weight, query, 1e-5),
        "eager": lambda: _AttnResMix.apply(norm_weight, query, 1e-5, *sources),
    }
    results = {}
    for name, fn in runs.items():
        out = fn()
        results[name] = (out, torch.autograd.grad(out, inputs, grad_out))
    got_out, got_grads = results["triton"]
    for name in ("compiled", "eager"):
        want_out, want_grads = results[name]
        assert rel(got_out, want_out) < 1e-2, name
        for x, a, b in zip(inputs, got_grads, want_grads, strict=True):
            assert a.dtype == b.dtype == x.dtype
            assert rel(a, b) < tol(x.dtype) * 10, name  # both sides round: allow a few ulps more
