"""Where this repository's Triton kernels run: on CUDA tensors of 16/32-bit floats, and on CPU ones
under Triton's interpreter (TRITON_INTERPRET=1, how the CPU tests execute the kernels); float64
and everything else keep each op's torch path."""

from __future__ import annotations

import os

import torch

try:  # Triton ships with CUDA builds of torch, not always with the CPU build
    import triton
except ImportError:
    triton = None

TRITON_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def triton_serves(*tensors: torch.Tensor) -> bool:
    """Whether a Triton kernel may take these tensors (placed by the first)."""
    on_device = tensors[0].is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
    return triton is not None and on_device and all(t.dtype in TRITON_FLOATS for t in tensors)
