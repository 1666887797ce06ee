"""MX fake quantisation as one Triton kernel per tensor on CUDA, bit-exact to `posttrain.qat.mx`.

The spec (`mx.quantize_dequantize`) is about fifty elementwise PyTorch ops: on a GPU that is fifty
launches and as many passes over the tensor per call, for every expert weight and activation of
every MoE layer. This kernel reads each block of 32 once, computes its E8M0 exponent and the
element rounding with the same integer-exact steps (the exponent and mantissa read off the float
bits, 2^s built from bits, ties to even, saturation, NaN/inf blocks to NaN) and writes the
dequantised block in the input's dtype. `fake_quantize` picks it for CUDA tensors and the spec
elsewhere; both have the straight-through gradient. The GPU tests check it bit for bit against
the spec on specials (zeros, subnormals, ties, saturation, NaN, inf) in fp32, bf16 and fp16.
"""

from __future__ import annotations

import math
import struct

import torch

from posttrain.qat.mx import (
    SCALE_EXP_MAX,
    SCALE_EXP_MIN,
    MXFormat,
    ScaleRule,
    _check_input,
    _element_format,
    quantize_dequantize,
)

_BLOCKS_PER_PROGRAM = 64


try:  # Triton ships with CUDA builds of torch, not with the CPU build
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:
    triton = None

if triton is not None:

    @triton.jit
    def _pow2(k):
        # 2^k exactly, from bits, for integer k in [-149, 127] (subnormal below -126)
        normal = (tl.maximum(k, -126) + 127) << 23
        sub = 1 << tl.minimum(tl.maximum(k + 149, 0), 22)
        return tl.where(k >= -126, normal, sub).to(tl.float32, bitcast=True)

    @triton.jit
    def _mx_qdq(
        x_ptr,
        y_ptr,
        n_blocks,
        BS: tl.constexpr,
        BR: tl.constexpr,
        MBITS: tl.constexpr,
        MIN_EXP: tl.constexpr,
        MAX_EXP: tl.constexpr,
        MAX_NORMAL: tl.constexpr,
        SHIFT: tl.constexpr,
        ROUND_BIAS: tl.constexpr,
        KEEP_MASK: tl.constexpr,
        INV_STEP: tl.constexpr,
        STEP: tl.constexpr,
        MIN_NORMAL: tl.constexpr,
        RCEIL: tl.constexpr,
        MAX_FREXP_EXP: tl.constexpr,
        MAX_FIELD: tl.constexpr,
        S_MIN: tl.constexpr,
        S_MAX: tl.constexpr,
    ):
        rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
        offs = rows[:, None] * BS + tl.arange(0, BS)[None, :]
        mask = rows[:, None] < n_blocks
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        bits = x.to(tl.int32, bitcast=True)
        # |x| bits order like |x| (NaN above inf), so the block amax is an integer max: exact,
        # and a NaN anywhere in the block shows up instead of being dropped by a float max.
        amax = tl.max(bits & 0x7FFFFFFF, axis=1)
        finite = amax < 0x7F800000
        # frexp(amax) = m * 2^e, m in [0.5, 1): e and m's fraction bits from the float bits; a
        # subnormal amax is normalised through its fraction converted exactly to float.
        biased = amax >> 23
        frac = amax & 0x7FFFFF
        sub_bits = frac.to(tl.float32).to(tl.int32, bitcast=True)
        is_sub = biased == 0
        e = tl.where(is_sub, (sub_bits >> 23) - 275, biased - 126)
        field = tl.where(is_sub, sub_bits & 0x7FFFFF, frac)
        if RCEIL:
            s = e - MAX_FREXP_EXP + (field > MAX_FIELD).to(tl.int32)
        else:
            s = e - 1 - MAX_EXP
        s = tl.where(amax == 0, S_MIN, s)
        s = tl.minimum(tl.maximum(s, S_MIN), S_MAX)

        inv = _pow2(-s)
        v = x * inv[:, None]
        mag_bits = v.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        mag = mag_bits.to(tl.float32, bitcast=True)
        # Normal elements: round the 23-bit fraction to MBITS on the integer bits, ties to even (a
        # carry moves into the exponent); subnormal elements: a fixed step, rint is half-to-even.
        rounded_bits = (mag_bits + ROUND_BIAS + ((mag_bits >> SHIFT) & 1)) & KEEP_MASK
        subnormal = libdevice.rint(mag * INV_STEP) * STEP
        rounded = tl.where(mag < MIN_NORMAL, subnormal, rounded_bits.to(tl.float32, bitcast=True))
        rounded = tl.minimum(rounded, MAX_NORMAL)
        sign = (bits >> 31) << 31
        elements = (rounded.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
        out = elements * _pow2(s)[:, None]
        nan = tl.full(out.shape, 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)
        out = tl.where(finite[:, None], out, nan)
        tl.store(y_ptr + offs, out.to(y_ptr.dtype.element_ty), mask=mask)


def fused_available(x: torch.Tensor, block_size: int) -> bool:
    """True when `fused_quantize_dequantize` can take x: Triton, a CUDA tensor, a power-of-two block."""
    return triton is not None and x.is_cuda and block_size > 0 and block_size & (block_size - 1) == 0


def fused_quantize_dequantize(
    x: torch.Tensor, fmt: MXFormat, block_size: int = 32, scale_rule: ScaleRule = "floor"
) -> torch.Tensor:
    """The values of `mx.quantize_dequantize(x, ...)` computed by one kernel (no autograd)."""
    _check_input(x, block_size, scale_rule)
    elem = _element_format(fmt)
    # rceil compares frexp mantissas; for normal floats that is comparing their fraction bits
    _, max_frexp_exp = math.frexp(elem.max_normal)
    max_field = struct.unpack("<I", struct.pack("<f", elem.max_normal))[0] & 0x7FFFFF
    shift = 23 - elem.mantissa_bits
    src = x.contiguous()
    out = torch.empty_like(src)
    n_blocks = src.numel() // block_size
    if n_blocks:
        grid = (-(-n_blocks // _BLOCKS_PER_PROGRAM),)
        _mx_qdq[grid](
            src,
            out,
            n_blocks,
            BS=block_size,
            BR=_BLOCKS_PER_PROGRAM,
            MBITS=elem.mantissa_bits,
            MIN_EXP=elem.min_exponent,
            MAX_EXP=elem.max_exponent,
            MAX_NORMAL=elem.max_normal,
            SHIFT=shift,
            ROUND_BIAS=(1 << (shift - 1)) - 1,
            KEEP_MASK=~((1 << shift) - 1),
            INV_STEP=2.0 ** (elem.mantissa_bits - elem.min_exponent),
            STEP=2.0 ** (elem.min_exponent - elem.mantissa_bits),
            MIN_NORMAL=2.0**elem.min_exponent,
            RCEIL=scale_rule == "rceil",
            MAX_FREXP_EXP=max_frexp_exp,
            MAX_FIELD=max_field,
            S_MIN=SCALE_EXP_MIN,
            S_MAX=SCALE_EXP_MAX,
            num_warps=4,
        )
    return out.view(x.shape)


class _FusedFakeQuantize(torch.autograd.Function):
    """Forward: the fused kernel. Backward: straight-through, as the spec's."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, fmt: str, block_size: int, scale_rule: str) -> torch.Tensor:
        return fused_quantize_dequantize(x, fmt, block_size, scale_rule)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        return grad_output, None, None, None


def fake_quantize(
    x: torch.Tensor, fmt: MXFormat, block_size: int = 32, scale_rule: ScaleRule = "floor"
) -> torch.Tensor:
    """MX fake quantisation with a straight-through gradient: the fused kernel for CUDA tensors,
    the spec (`mx.quantize_dequantize`) elsewhere; the same values either way."""
    if fused_available(x, block_size):
        return _FusedFakeQuantize.apply(x, fmt, block_size, scale_rule)
    return quantize_dequantize(x, fmt, block_size, scale_rule)
