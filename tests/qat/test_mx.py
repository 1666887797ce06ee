"""MX fake quantisation against hand-computed values and a slow scalar reference of the OCP rules.

The reference below works one Python float at a time (math.ldexp, exact comparisons, the element
grid enumerated from its bit codes) and shares no code with posttrain.qat.mx, so agreement on
random tensors with ties, subnormal scales, huge/tiny values, zeros and bf16 is evidence that the
vectorised implementation follows the rules, not that it agrees with itself.
"""

import bisect
import math

import pytest
import torch

from posttrain.qat.mx import mx_scale_exponents, pack_mxfp4, quantize_dequantize, unpack_mxfp4

FORMATS = ("mxfp4", "mxfp8_e4m3")
RULES = ("floor", "rceil")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# ---------------------------------------------------------------------------------------------
# Scalar reference (OCP MX v1.0), deliberately written differently from the implementation.


def ref_grid(fmt: str) -> list[float]:
    """Non-negative element values in code order, decoded from the bit codes."""
    mbits, bias, last_code = {"mxfp4": (1, 1, 0b111), "mxfp8_e4m3": (3, 7, 0b1111110)}[fmt]
    values = []
    for code in range(last_code + 1):  # E4M3's 0b1111111 is NaN, so 448 (0b1111110) is the last
        e, m = code >> mbits, code & ((1 << mbits) - 1)
        if e == 0:
            values.append(math.ldexp(m, 1 - bias - mbits))
        else:
            values.append(math.ldexp((1 << mbits) + m, e - bias - mbits))
    return values


GRIDS = {fmt: ref_grid(fmt) for fmt in FORMATS}


def ref_floor_log2(a: float) -> int:
    k = int(math.log2(a))
    while math.ldexp(1.0, k) > a:
        k -= 1
    while math.ldexp(1.0, k + 1) <= a:
        k += 1
    return k


def ref_scale_exponent(block: list[float], fmt: str, rule: str) -> int | None:
    """E8M0 exponent of a block, None for a block holding NaN/inf."""
    if any(not math.isfinite(v) for v in block):
        return None
    amax = max(abs(v) for v in block)
    if amax == 0:
        return -127
    max_elem = GRIDS[fmt][-1]
    if rule == "floor":
        s = ref_floor_log2(amax) - ref_floor_log2(max_elem)
    else:
        s = math.ceil(math.log2(amax / max_elem))
        while math.ldexp(max_elem, s - 1) >= amax:
            s -= 1
        while math.ldexp(max_elem, s) < amax:
            s += 1
    return min(max(s, -127), 127)


def ref_round(a: float, grid: list[float]) -> float:
    """Nearest grid value to a >= 0, ties to the even code, saturating at the last value."""
    if a >= grid[-1]:
        return grid[-1]
    i = bisect.bisect_right(grid, a) - 1
    lo, hi = grid[i], grid[i + 1]
    twice = 2 * a  # exact in float64, as is lo + hi: the comparison below is exact
    if twice < lo + hi:
        return lo
    if twice > lo + hi:
        return hi
    return lo if i % 2 == 0 else hi


def ref_quantize_dequantize(x: torch.Tensor, fmt: str, rule: str, block_size: int = 32) -> torch.Tensor:
    flat = x.double().reshape(-1).tolist()
    out = []
    for start in range(0, len(flat), block_size):
        block = flat[start : start + block_size]
        s = ref_scale_exponent(block, fmt, rule)
        for v in block:
            if s is None:
                out.append(math.nan)
            else:
                q = ref_round(math.ldexp(abs(v), -s), GRIDS[fmt])
                out.append(math.copysign(math.ldexp(q, s), v))
    return torch.tensor(out, dtype=torch.float64).reshape(x.shape).to(x.dtype)


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(actual), nan)
    int_dtype = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
    a = actual.view(int_dtype[actual.dtype])[~nan]
    e = expected.view(int_dtype[expected.dtype])[~nan]
    bad = (a != e).nonzero()
    assert bad.numel() == 0, (
        f"{bad.numel()} mismatches, first: got {actual[~nan][bad[0]].item()!r}, "
        f"expected {expected[~nan][bad[0]].item()!r}"
    )


# Binade ranges per input dtype: (tiny, normal, huge, tie scales). float16 has its own narrow range.
EXPONENT_RANGES = {
    torch.float32: ((-149, -115), (-20, 20), (110, 126), (-126, 100)),
    torch.bfloat16: ((-133, -115), (-20, 20), (110, 126), (-126, 100)),
    torch.float16: ((-24, -14), (-8, 8), (10, 14), (-20, 6)),
}


def random_mx_tensor(gen: torch.Generator, fmt: str, dtype: torch.dtype, rows: int = 12) -> torch.Tensor:
    """Blocks of mixed kinds: gaussian at tiny/normal/huge magnitudes, exact grid ties, zeros."""
    grid = GRIDS[fmt]
    midpoints = [(a + b) / 2 for a, b in zip(grid, grid[1:], strict=False)]
    tiny, normal, huge, tie_scales = EXPONENT_RANGES[dtype]

    def randint(bounds: tuple[int, int]) -> int:
        return int(torch.randint(bounds[0], bounds[1], (1,), generator=gen))

    def gaussian(exponent: int) -> torch.Tensor:
        return torch.randn(32, generator=gen, dtype=torch.float64) * 2.0**exponent

    blocks = []
    for _ in range(rows * 2):
        kind = randint((0, 6))
        if kind == 0:  # tiny: the scale exponent clamps at -127 for float32/bfloat16
            block = gaussian(randint(tiny))
        elif kind == 1:
            block = gaussian(randint(normal))
        elif kind == 2:  # huge: float32's top binades
            block = gaussian(randint(huge))
        elif kind == 3:  # exact ties: midpoints and grid points at one scale, amax at the grid's max
            s = randint(tie_scales)
            pick = torch.randint(0, len(midpoints), (32,), generator=gen).tolist()
            signs = torch.randint(0, 2, (32,), generator=gen).tolist()
            vals = [(grid if i % 3 == 0 else midpoints)[p] for i, p in enumerate(pick)]
            vals[0] = grid[-1]
            block = torch.tensor([math.ldexp(v, s) * (-1) ** sg for v, sg in zip(vals, signs, strict=True)])
        elif kind == 4:
            block = torch.zeros(32, dtype=torch.float64)
        else:  # wide dynamic range inside one block: small elements underflow the element grid
            spread = torch.randint(normal[0] - 12, normal[1] + 1, (32,), generator=gen).double()
            block = torch.randn(32, generator=gen, dtype=torch.float64) * 2.0**spread
        blocks.append(block)
    return torch.stack(blocks).reshape(rows, 64).to(torch.float32).to(dtype)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_scalar_reference_bitwise(fmt, rule, dtype):
    gen = torch.Generator().manual_seed(1234 + FORMATS.index(fmt) * 10 + RULES.index(rule))
    for _ in range(6):
        x = random_mx_tensor(gen, fmt, dtype)
        assert_bitwise_equal(
            quantize_dequantize(x, fmt, scale_rule=rule), ref_quantize_dequantize(x, fmt, rule)
        )


@pytest.mark.parametrize("block_size", (1, 4, 16, 64))
def test_other_block_sizes_match_reference(block_size):
    gen = torch.Generator().manual_seed(block_size)
    for fmt in FORMATS:
        for rule in RULES:
            x = random_mx_tensor(gen, fmt, torch.bfloat16, rows=4)
            assert_bitwise_equal(
                quantize_dequantize(x, fmt, block_size, rule),
                ref_quantize_dequantize(x, fmt, rule, block_size),
            )


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rule", RULES)
def test_scale_exponents_match_reference(fmt, rule):
    gen = torch.Generator().manual_seed(7)
    x = random_mx_tensor(gen, fmt, torch.float32)
    x[0, :32] = float("inf")
    expected = [
        ref_scale_exponent(x[r, c : c + 32].double().tolist(), fmt, rule) for r in range(12) for c in (0, 32)
    ]
    expected = [128 if s is None else s for s in expected]
    assert mx_scale_exponents(x, fmt, scale_rule=rule).reshape(-1).tolist() == expected


# ---------------------------------------------------------------------------------------------
# Hand-computed values.


def _block(values: list[float], dtype=torch.float32) -> torch.Tensor:
    return torch.tensor(values + [0.0] * (32 - len(values)), dtype=dtype)


E2M1_TIES = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
E2M1_TIES_ROUNDED = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]  # each to the neighbour with an even code


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_e2m1_ties_round_to_even_at_scale_one(rule, dtype):
    # amax 5 gives scale 2^0 under both rules: floor(log2 5) - 2 = 0 and ceil(log2(5/6)) = 0.
    x = _block(E2M1_TIES + [-v for v in E2M1_TIES], dtype)
    out = quantize_dequantize(x, "mxfp4", scale_rule=rule)
    assert out.dtype == dtype
    assert out[:14].tolist() == E2M1_TIES_ROUNDED + [-v for v in E2M1_TIES_ROUNDED]
    assert torch.signbit(out[7])  # -0.25 rounds to -0, not +0
    assert mx_scale_exponents(x, "mxfp4", scale_rule=rule).tolist() == [0]


def test_e2m1_grid_values_are_fixed_points():
    grid = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    x = _block(grid + [-v for v in grid[1:]])
    assert torch.equal(quantize_dequantize(x, "mxfp4"), x)


def test_floor_rule_saturates_at_max_normal():
    # floor: amax 7.5 -> scale 2^(2 - 2) = 1, and 7.5 > 6 saturates to 6; 6.9 also.
    x = _block([7.5, -6.9, 5.5, 1.0])
    assert quantize_dequantize(x, "mxfp4")[:4].tolist() == [6.0, -6.0, 6.0, 1.0]
    # rceil: scale 2^ceil(log2(7.5/6)) = 2; 3.75 -> 4, -3.45 -> -3, 2.75 -> 3, 0.5 stays: nothing saturates.
    assert quantize_dequantize(x, "mxfp4", scale_rule="rceil")[:4].tolist() == [8.0, -6.0, 6.0, 1.0]
    # E4M3 floor: amax 500 -> scale 2^(8 - 8) = 1; 500 and 470 (whose nearest is 480) saturate to 448.
    y = _block([500.0, 470.0, -460.0, 3.0])
    assert quantize_dequantize(y, "mxfp8_e4m3")[:4].tolist() == [448.0, 448.0, -448.0, 3.0]


def test_e4m3_subnormal_elements_and_ties():
    # Scale 2^0 (amax 448). E4M3 subnormals are multiples of 2^-9.
    x = _block([448.0, 2.0**-9, 2.0**-10, 3 * 2.0**-10, 2.0**-6 + 2.0**-10, 17.0, 19.0])
    expected = [448.0, 2.0**-9, 0.0, 2.0**-8, 2.0**-6, 16.0, 20.0]
    for rule in RULES:
        assert quantize_dequantize(x, "mxfp8_e4m3", scale_rule=rule)[:7].tolist() == expected


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_subnormal_block_scale(dtype):
    # amax 2^-125 -> floor: -125 - 2 = -127 (E8M0's smallest, a float32 subnormal 2^-127).
    s = 2.0**-127
    x = _block([4 * s, 0.5 * s, 0.25 * s, 0.75 * s, -1.5 * s, 2.5 * s], dtype)
    assert mx_scale_exponents(x, "mxfp4").tolist() == [-127]
    out = quantize_dequantize(x, "mxfp4")
    assert out[:6].tolist() == [4 * s, 0.5 * s, 0.0, s, -1.5 * s, 2 * s]
    # Below that the exponent clamps at -127: 2^-140 is 2^-13 of the scale and rounds to zero.
    tiny = _block([2.0**-140, 2.0**-128, 3 * 2.0**-129])
    assert quantize_dequantize(tiny, "mxfp4")[:3].tolist() == [0.0, 2.0**-128, 2.0**-127]
    blocks, scales = pack_mxfp4(tiny)
    assert scales.tolist() == [0]


def test_zero_blocks_stay_zero_and_leave_neighbours_alone():
    x = torch.zeros(2, 64)
    x[1, 32:] = torch.linspace(-3, 3, 32)
    for fmt in FORMATS:
        for rule in RULES:
            out = quantize_dequantize(x, fmt, scale_rule=rule)
            assert torch.count_nonzero(out[0]) == 0 and torch.count_nonzero(out[1, :32]) == 0
            assert torch.count_nonzero(out[1, 32:]) > 0
    blocks, scales = pack_mxfp4(x)
    assert scales[0].tolist() == [0, 0] and torch.count_nonzero(blocks[0]) == 0


def test_nan_or_inf_poison_only_their_block():
    x = torch.ones(3, 32)
    x[0, 5] = float("nan")
    x[1, 9] = float("-inf")
    out = quantize_dequantize(x, "mxfp8_e4m3")
    assert torch.isnan(out[:2]).all() and torch.equal(out[2], torch.ones(32))
    blocks, scales = pack_mxfp4(x)
    assert scales[:, 0].tolist() == [255, 255, 127 - 2]
    assert torch.isnan(unpack_mxfp4(blocks, scales)[:2]).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_dtype_and_shape_preserved(dtype):
    x = torch.randn(2, 3, 96).to(dtype)
    for fmt in FORMATS:
        out = quantize_dequantize(x, fmt)
        assert out.dtype == dtype and out.shape == x.shape


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_straight_through_gradient_is_exactly_the_incoming_gradient(fmt, dtype):
    x = (torch.randn(4, 64) * 3).to(dtype).requires_grad_()
    grad = torch.randn(4, 64).to(dtype)
    quantize_dequantize(x, fmt).backward(grad)
    assert x.grad.dtype == dtype and torch.equal(x.grad, grad)


def test_last_dim_not_a_multiple_of_block_size_is_a_clear_error():
    with pytest.raises(ValueError, match=r"multiple of block_size=32.*shape \(4, 48\).*e\.g\. 64"):
        quantize_dequantize(torch.randn(4, 48), "mxfp4")
    with pytest.raises(ValueError, match=r"shape \(3, 10\)"):
        pack_mxfp4(torch.randn(3, 10))


def test_unknown_format_rule_and_dtype_are_errors():
    with pytest.raises(ValueError, match="mxfp6"):
        quantize_dequantize(torch.randn(32), "mxfp6")
    with pytest.raises(ValueError, match="ceil"):
        quantize_dequantize(torch.randn(32), "mxfp4", scale_rule="ceil")
    with pytest.raises(TypeError, match="float64"):
        quantize_dequantize(torch.randn(32, dtype=torch.float64), "mxfp4")


# ---------------------------------------------------------------------------------------------
# Packing.


def test_pack_layout_by_hand():
    # amax 6 -> scale 2^0 -> E8M0 byte 127. Codes: 1.0 -> 0b0010, -0.5 -> 0b1001, 6 -> 0b0111,
    # -0.0 (from -0.1) -> 0b1000; even element in the low nibble.
    x = _block([1.0, -0.5, 4.0, -6.0, 0.0, -0.1])
    blocks, scales = pack_mxfp4(x)
    assert blocks.dtype == torch.uint8 and scales.dtype == torch.uint8
    assert blocks.shape == (16,) and scales.shape == (1,)
    assert blocks[:3].tolist() == [0b1001_0010, 0b1111_0110, 0b1000_0000]
    assert scales.tolist() == [127]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rule", RULES)
def test_unpack_of_pack_equals_fake_quant(dtype, rule):
    gen = torch.Generator().manual_seed(99)
    w = random_mx_tensor(gen, "mxfp4", dtype).reshape(3, 4, 64)
    blocks, scales = pack_mxfp4(w, scale_rule=rule)
    assert blocks.shape == (3, 4, 32) and scales.shape == (3, 4, 2)
    assert torch.equal(
        unpack_mxfp4(blocks, scales, dtype=dtype), quantize_dequantize(w, "mxfp4", scale_rule=rule)
    )


def test_unpack_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match=r"blocks \(4, 16\) and scales \(4, 2\)"):
        unpack_mxfp4(torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.uint8))


def test_e4m3_rounding_by_cast_equals_the_bit_rounding():
    """`_round_to_e4m3` (torch's float8_e4m3fn cast after saturating) against the spec's integer
    rounding, bit for bit: every bf16 bit pattern with six low-bit tails (ties, just above and below
    them) and 500k random float32 bit patterns, signed zeros, subnormals and huge values included."""
    from posttrain.qat.mx import ELEMENT_FORMATS, _round_to_e4m3, _round_to_element

    high = torch.arange(0, 1 << 16, dtype=torch.int64) << 16
    tails = [high | low for low in (0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF)]
    random = torch.randint(-(2**31), 2**31 - 1, (500_000,), generator=torch.Generator().manual_seed(0))
    v = torch.cat([*tails, random]).to(torch.int32).view(torch.float32)
    v = v[torch.isfinite(v)]
    e4m3 = ELEMENT_FORMATS["mxfp8_e4m3"]
    want = _round_to_element(v, e4m3)
    assert torch.equal(_round_to_e4m3(v, e4m3).view(torch.int32), want.view(torch.int32))
