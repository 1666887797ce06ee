"""OCP Microscaling (MX v1.0) fake quantisation and MXFP4 packing, in plain PyTorch.

K3 trains with its serving precision: routed-expert weights in MXFP4 and routed-expert input
activations in MXFP8 (E4M3). Training needs the exact values the serving kernels will see
(`quantize_dequantize`, with a straight-through gradient so master weights keep learning), and
export needs the same values as bytes (`pack_mxfp4` / `unpack_mxfp4`, the layout of
compressed-tensors `mxfp4-pack-quantized`). Everything runs on the CPU; every step is exact
(power-of-two scaling, integer exponents), so results are bit-identical across devices.

Rules, per block of `block_size` consecutive elements along the last dimension:
- shared scale X = 2^s, s an integer stored as E8M0 (byte s + 127), clamped to [-127, 127];
  - "floor" (OCP MX v1.0 section 6.3): s = floor(log2(amax)) - emax_elem;
  - "rceil" (vLLM's MXFP8 activations, torchao's QAT default): s = ceil(log2(amax / max_elem)),
    computed exactly (no rounding of amax / max_elem);
  - an all-zero block gets s = -127 (E8M0 byte 0) and stays zero;
- elements x / X are rounded to the element format (FP4 E2M1 or FP8 E4M3, subnormals included)
  with round-to-nearest, ties to even, and saturate at the format's largest normal;
- a block holding a NaN or an infinity has no finite scale: it gets E8M0's NaN (byte 255) and
  every element of the block dequantises to NaN (what OCP prescribes for a NaN scale).
The dequantised result is cast back to the input dtype (bf16, fp16 or fp32). It is exact for
bf16 and fp32; fp16 inputs within a few percent of fp16's max can round up past it (to inf)
under "rceil" because the cast, not the MX rule, overflows.
A last dimension that is not a multiple of `block_size` is a ValueError (no implicit padding).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

__all__ = [
    "ELEMENT_FORMATS",
    "E8M0_BIAS",
    "E8M0_NAN",
    "ElementFormat",
    "MXFormat",
    "ScaleRule",
    "mx_scale_exponents",
    "pack_mxfp4",
    "quantize_dequantize",
    "unpack_mxfp4",
]

MXFormat = Literal["mxfp4", "mxfp8_e4m3"]
ScaleRule = Literal["floor", "rceil"]

E8M0_BIAS = 127
E8M0_NAN = 255
SCALE_EXP_MIN = -127
SCALE_EXP_MAX = 127
MXFP4_BLOCK_SIZE = 32
_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class ElementFormat:
    """A small IEEE-like float: `mantissa_bits` explicit bits, normals from 2^min_exponent."""

    name: str
    mantissa_bits: int
    min_exponent: int  # exponent of the smallest normal, 1 - bias; subnormals sit below it
    max_exponent: int  # emax_elem: exponent of the largest normal
    max_normal: float


ELEMENT_FORMATS: dict[str, ElementFormat] = {
    "mxfp4": ElementFormat("mxfp4", mantissa_bits=1, min_exponent=0, max_exponent=2, max_normal=6.0),
    "mxfp8_e4m3": ElementFormat(
        "mxfp8_e4m3", mantissa_bits=3, min_exponent=-6, max_exponent=8, max_normal=448.0
    ),
}

# E2M1 magnitudes in code order: code = sign << 3 | index into this table.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _element_format(fmt: str) -> ElementFormat:
    if fmt not in ELEMENT_FORMATS:
        raise ValueError(f"unknown MX format {fmt!r}; expected one of {sorted(ELEMENT_FORMATS)}")
    return ELEMENT_FORMATS[fmt]


def _check_input(x: torch.Tensor, block_size: int, scale_rule: str) -> None:
    if scale_rule not in ("floor", "rceil"):
        raise ValueError(f"unknown MX scale_rule {scale_rule!r}; expected 'floor' or 'rceil'")
    if x.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"MX quantisation takes float32, bfloat16 or float16 tensors, got {x.dtype}")
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if x.dim() == 0 or x.shape[-1] % block_size != 0:
        n = x.shape[-1] if x.dim() else 1
        padded = -(-n // block_size) * block_size
        raise ValueError(
            f"MX quantisation needs the last dimension to be a multiple of block_size={block_size}, "
            f"got shape {tuple(x.shape)} (last dim {n}). Fix: size that dimension as a multiple of "
            f"{block_size} (e.g. {padded}; K3's routed-expert hidden and intermediate sizes are "
            f"multiples of 32), or pad it with zeros yourself before quantising."
        )


def _pow2(exponent: torch.Tensor) -> torch.Tensor:
    """2^exponent as float32 for integer exponents in [-149, 127], exact: built from exponent bits,
    below 2^-126 as the product of two normal powers (exact, the result being a power of two)."""
    e = exponent.to(torch.int32)
    high = e.clamp(-126, 127)
    low = (e - high).clamp(min=-126)
    return ((high + 127) << 23).view(torch.float32) * ((low + 127) << 23).view(torch.float32)


def _scale_exponents(amax: torch.Tensor, elem: ElementFormat, scale_rule: str) -> torch.Tensor:
    """Integer E8M0 exponent per block from the block's float32 amax (finite or not)."""
    mantissa, exponent = torch.frexp(amax)  # amax = mantissa * 2^exponent, mantissa in [0.5, 1)
    if scale_rule == "floor":
        s = exponent - 1 - elem.max_exponent
    else:
        # Smallest s with max_normal * 2^s >= amax, decided on exact mantissas, not on a rounded
        # amax / max_normal.
        max_mantissa, max_exp = math.frexp(elem.max_normal)
        s = exponent - max_exp + (mantissa > max_mantissa).to(torch.int32)
    s = torch.where(amax == 0, SCALE_EXP_MIN, s)
    return s.clamp(SCALE_EXP_MIN, SCALE_EXP_MAX)


def _round_to_element(v: torch.Tensor, elem: ElementFormat) -> torch.Tensor:
    """Round float32 values (already divided by the block scale) to the element grid, RNE, saturating."""
    magnitude = v.abs()
    # Normal elements: round float32's 23-bit mantissa to the element's bits, ties to even, on the
    # integer bits (a carry moves into the exponent, as it should).
    shift = 23 - elem.mantissa_bits
    bits = magnitude.view(torch.int32)
    bits = (bits + ((1 << (shift - 1)) - 1) + ((bits >> shift) & 1)) & ~((1 << shift) - 1)
    # Subnormal elements: a fixed step of 2^(min_exponent - mantissa_bits); torch.round is half-to-even.
    inv_step = 2.0 ** (elem.mantissa_bits - elem.min_exponent)
    subnormal = torch.round(magnitude * inv_step) / inv_step
    rounded = torch.where(magnitude < 2.0**elem.min_exponent, subnormal, bits.view(torch.float32))
    return torch.copysign(rounded.clamp(max=elem.max_normal), v)


def _round_to_e4m3(v: torch.Tensor, elem: ElementFormat) -> torch.Tensor:
    """`_round_to_element(v, elem)` for E4M3 by torch's float8_e4m3fn cast (round-to-nearest-even,
    subnormals) after saturating at +-max_normal (448): three ops instead of about fifteen, which is
    most of an MXFP8 activation fake-quant's time on a small CPU tensor. Bit-identical for every
    float32 (tests/qat/test_mx.py checks every bf16 bit pattern with several low-bit tails and random
    float32 bit patterns, signed zeros and subnormals included)."""
    return v.clamp(-elem.max_normal, elem.max_normal).to(torch.float8_e4m3fn).to(torch.float32)


def _quantize_blocks(
    x: torch.Tensor, fmt: str, block_size: int, scale_rule: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split x into blocks and quantise them.

    Returns (elements fp32 [..., n/bs, bs] on the element grid, scale exponents int32
    [..., n/bs, 1], finite mask bool [..., n/bs, 1]: False where the block holds NaN/inf).
    """
    elem = _element_format(fmt)
    _check_input(x, block_size, scale_rule)
    blocks = x.to(torch.float32).reshape(*x.shape[:-1], x.shape[-1] // block_size, block_size)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    finite = torch.isfinite(amax)
    s = _scale_exponents(amax, elem, scale_rule)
    scaled = blocks * _pow2(-s)
    elements = _round_to_e4m3(scaled, elem) if fmt == "mxfp8_e4m3" else _round_to_element(scaled, elem)
    return elements, s, finite


def _dequantize_blocks(
    elements: torch.Tensor, s: torch.Tensor, finite: torch.Tensor, shape: torch.Size, dtype: torch.dtype
) -> torch.Tensor:
    scale = torch.where(finite, _pow2(s), float("nan"))  # per block; NaN spreads over its block
    return (elements * scale).reshape(shape).to(dtype)


def _quantize_dequantize(x: torch.Tensor, fmt: str, block_size: int, scale_rule: str) -> torch.Tensor:
    elements, s, finite = _quantize_blocks(x, fmt, block_size, scale_rule)
    return _dequantize_blocks(elements, s, finite, x.shape, x.dtype)


class _MXFakeQuantize(torch.autograd.Function):
    """Forward: MX quantise-dequantise. Backward: straight-through (the incoming gradient, as is)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, fmt: str, block_size: int, scale_rule: str) -> torch.Tensor:
        return _quantize_dequantize(x, fmt, block_size, scale_rule)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        return grad_output, None, None, None


def quantize_dequantize(
    x: torch.Tensor, fmt: MXFormat, block_size: int = 32, scale_rule: ScaleRule = "floor"
) -> torch.Tensor:
    """Round x to the MX format `fmt` and return the dequantised values in x's dtype and shape.

    x: [..., n] float32/bfloat16/float16 with n % block_size == 0 (else ValueError).
    fmt: "mxfp4" (E2M1 elements, max 6, emax 2) or "mxfp8_e4m3" (E4M3 elements, max 448, emax 8).
    scale_rule: "floor" (OCP) or "rceil"; see the module docstring for both rules and NaN handling.
    The gradient with respect to x is the incoming gradient unchanged (straight-through).
    """
    return _MXFakeQuantize.apply(x, fmt, block_size, scale_rule)


def mx_scale_exponents(
    x: torch.Tensor, fmt: MXFormat, block_size: int = 32, scale_rule: ScaleRule = "floor"
) -> torch.Tensor:
    """The unbiased E8M0 exponent s of each block (scale 2^s): int32 [..., n / block_size].

    Blocks holding NaN/inf report 128 (the biased NaN code 255 minus the bias).
    """
    _, s, finite = _quantize_blocks(x.detach(), fmt, block_size, scale_rule)
    return torch.where(finite, s, E8M0_NAN - E8M0_BIAS).squeeze(-1)


def pack_mxfp4(w: torch.Tensor, scale_rule: ScaleRule = "floor") -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise w to MXFP4 (blocks of 32 along the last dim) and pack it as stored in checkpoints.

    w: [..., n], n % 32 == 0. Returns
      blocks uint8 [..., n / 2]: two E2M1 codes a byte, the even element in the low nibble;
        code = sign << 3 | index of the magnitude in (0, 0.5, 1, 1.5, 2, 3, 4, 6);
      scales uint8 [..., n / 32]: biased E8M0 exponents (s + 127; 255 = NaN block).
    `unpack_mxfp4(*pack_mxfp4(w), dtype=w.dtype)` equals `quantize_dequantize(w, "mxfp4")`.
    """
    elements, s, finite = _quantize_blocks(w.detach(), "mxfp4", MXFP4_BLOCK_SIZE, scale_rule)
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=w.device)
    index = torch.searchsorted(table, elements.abs().contiguous())
    codes = index.to(torch.uint8) | (torch.signbit(elements).to(torch.uint8) << 3)
    codes = torch.where(finite, codes, torch.zeros_like(codes)).reshape(w.shape)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    scales = torch.where(finite, s + E8M0_BIAS, E8M0_NAN).to(torch.uint8).squeeze(-1)
    return blocks.contiguous(), scales.contiguous()


def unpack_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Dequantise packed MXFP4 (the layout `pack_mxfp4` writes) to `dtype`: [..., 2 * blocks.shape[-1]].

    blocks uint8 [..., n / 2], scales uint8 [..., n / 32]; scale byte 255 makes its block NaN.
    """
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise TypeError(f"unpack_mxfp4 takes uint8 blocks and scales, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[:-1] != scales.shape[:-1] or blocks.shape[-1] != scales.shape[-1] * 16:
        raise ValueError(
            f"unpack_mxfp4: blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match; "
            f"expected blocks [..., n/2] and scales [..., n/32] with the same leading dims"
        )
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2).to(torch.int64)
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    magnitudes = table[codes & 0x7]
    elements = torch.where((codes & 0x8) != 0, -magnitudes, magnitudes)
    elements = elements.reshape(*scales.shape, MXFP4_BLOCK_SIZE)
    s = scales.to(torch.int32).unsqueeze(-1) - E8M0_BIAS
    finite = scales.unsqueeze(-1) != E8M0_NAN
    shape = (*blocks.shape[:-1], blocks.shape[-1] * 2)
    return _dequantize_blocks(elements, s, finite, torch.Size(shape), dtype)
