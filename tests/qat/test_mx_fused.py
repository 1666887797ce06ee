"""The fused MX fake-quant kernel (`posttrain.qat.mx_fused`) against the spec quantiser, bit for bit.

On CPU `fake_quantize` must be the spec itself; the `gpu` tests run the Triton kernel on the
mixed-kind blocks of test_mx (tiny/normal/huge magnitudes, exact ties, zeros, wide ranges) plus
NaN, inf and signed zeros, in every format, rule and dtype, against the spec on the CPU.
"""

from __future__ import annotations

import pytest
import torch
from test_mx import DTYPES, FORMATS, RULES, assert_bitwise_equal, random_mx_tensor

from posttrain.qat import MXFakeQuant
from posttrain.qat.mx import quantize_dequantize
from posttrain.qat.mx_fused import fake_quantize, fused_available


def test_cpu_tensors_take_the_spec_path():
    gen = torch.Generator().manual_seed(0)
    x = random_mx_tensor(gen, "mxfp4", torch.float32).requires_grad_(True)
    assert not fused_available(x, 32)
    out = fake_quantize(x, "mxfp4", 32, "floor")
    assert out.grad_fn is not None and "MXFakeQuantize" in type(out.grad_fn).__name__
    assert_bitwise_equal(out.detach(), quantize_dequantize(x.detach(), "mxfp4", 32, "floor"))
    g = torch.randn(x.shape, generator=gen)
    out.backward(g)
    assert torch.equal(x.grad, g)
    assert_bitwise_equal(MXFakeQuant("mxfp4", "floor")(x.detach()), out.detach())


def with_specials(x: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    x[0, 3] = float("nan")
    x[1, 40] = float("inf")
    x[2, 7] = float("-inf")
    x[3, :32] = -0.0
    x[4, 32:] = torch.finfo(x.dtype).max
    x[5, 5] = torch.finfo(x.dtype).tiny / 4  # subnormal in every dtype
    return x


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_kernel_is_bit_exact_to_the_spec(fmt, rule, dtype):
    gen = torch.Generator().manual_seed(99 + FORMATS.index(fmt) * 10 + RULES.index(rule))
    blocks = torch.cat([random_mx_tensor(gen, fmt, dtype, rows=12) for _ in range(50)])  # 600 x 64
    for x in (with_specials(blocks), blocks.reshape(5, 40, 192), blocks[:7, :32]):
        assert fused_available(x.cuda(), 32)
        got = fake_quantize(x.cuda(), fmt, 32, rule)
        assert_bitwise_equal(got.cpu(), quantize_dequantize(x, fmt, 32, rule))


@pytest.mark.gpu
@gpu
def test_fused_gradient_is_straight_through_and_hook_uses_it():
    x = torch.randn(33, 96, device="cuda", requires_grad=True)
    out = fake_quantize(x, "mxfp8_e4m3", 32, "rceil")
    assert "FusedFakeQuantize" in type(out.grad_fn).__name__
    g = torch.randn_like(x)
    out.backward(g)
    assert torch.equal(x.grad, g)
    hook = MXFakeQuant("mxfp8_e4m3", "rceil")
    assert torch.equal(hook(x.detach()), out.detach())
