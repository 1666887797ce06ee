"""Regional `torch.compile` of K3's elementwise chains, chosen by the config key `compile_regions`.

On a GPU a K3 training step is bound by float32 elementwise kernels outside the matmuls: the
RMSNorms, the Block Attention Residual mixes, KDA's short conv + SiLU + l2norm, its gate and its
gated output norm. Each is a small pure-tensor function; compiling it (inductor) fuses the chain
into a few kernels for the forward and the backward, with the same arithmetic in float32.

The regions are compiled one by one, not the whole model: fla's KDA kernels, the grouped expert
GEMMs and the QAT hooks stay eager in between. `compile_regions`: None (the default) compiles
training forwards on CUDA (CUDA tensors with grad enabled: inference, where every new prompt
shape would stall on a compile, stays eager; `engines/cuda_graph_decode.py` removes its launch
cost instead), True everywhere (inductor runs on the CPU too: the tests compare the compiled regions
with eager there), False never.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable)

_compiled: dict[Callable, Callable] = {}
# Graphs one region may keep: each RMSNorm width, source count of a mix, grad mode and dtype is
# one (dynamo's default of 8 would send the rest back to eager, silently but for a warning).
RECOMPILE_LIMIT = 64


def compiled(fn: F) -> F:
    """`fn` under torch.compile, built once per function (dynamo guards pick the graph per shape,
    dtype and device; shapes turn dynamic after a first recompile, so changing lengths do not pile
    up graphs)."""
    if fn not in _compiled:
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        _compiled[fn] = torch.compile(fn)
    return _compiled[fn]  # type: ignore[return-value]


def use_compiled(setting: bool | None, x: torch.Tensor) -> bool:
    """Whether a region fed `x` runs compiled under the config's `compile_regions` setting."""
    if torch.compiler.is_compiling():
        return False  # already inside a compiled graph (a caller compiled the model): trace eagerly
    return x.is_cuda and torch.is_grad_enabled() if setting is None else setting


def region(fn: F, setting: bool | None, x: torch.Tensor) -> F:
    """`fn` or its compiled twin for an input `x`, by `use_compiled`."""
    return compiled(fn) if use_compiled(setting, x) else fn
