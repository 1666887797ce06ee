"""Cross-check against torchao.prototype.mx_formats, a second public implementation of the MX rules.

torchao comes with the `dev` extra the test command installs, so it is imported plainly: a torchao
that stops importing fails this module instead of skipping it (checked with torchao 0.18.0 on torch
2.13.0 CPU). The bit-exact evidence that does not depend on torchao is test_mx.py's scalar
reference.

Magnitudes stay in [2^-100, 2^100]: when a block's scale exponent clamps at E8M0's minimum (-127)
torchao 0.18 divides by 2^-126 (FLOOR) or by 1 (RCEIL) but stores 2^-127, so its dequantised
values are off by 2x or zeroed there; our rule follows the spec (scale exactly 2^-127), which
test_mx.py::test_subnormal_block_scale pins with hand-computed values.
"""

import warnings

import pytest
import torch

from posttrain.qat.mx import quantize_dequantize

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx

ELEMENT_DTYPES = {"mxfp4": torch.float4_e2m1fn_x2, "mxfp8_e4m3": torch.float8_e4m3fn}
MODES = {"floor": ScaleCalculationMode.FLOOR, "rceil": ScaleCalculationMode.RCEIL}


@pytest.mark.parametrize("fmt", list(ELEMENT_DTYPES))
@pytest.mark.parametrize("rule", list(MODES))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_matches_torchao(fmt, rule, dtype):
    gen = torch.Generator().manual_seed(5)
    for _ in range(10):
        exponents = torch.randint(-100, 100, (16, 4, 1), generator=gen).float()
        x = (torch.randn(16, 4, 32, generator=gen) * 2.0**exponents).reshape(16, 128)
        x[3, 32:64] = 0.0
        x[5, :32] = 6.0 * 2.0 ** exponents[5, 0]  # amax exactly at the element max: the RCEIL edge
        x[5, 64:96] = 448.0 * 2.0 ** exponents[5, 2]
        x = x.to(dtype)
        scale, data = to_mx(x, ELEMENT_DTYPES[fmt], 32, MODES[rule])
        expected = to_dtype(data, scale, ELEMENT_DTYPES[fmt], 32, dtype)
        assert torch.equal(quantize_dequantize(x, fmt, scale_rule=rule), expected)
