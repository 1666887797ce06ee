"""The building blocks every K3 sublayer shares: RMSNorm and the SiTU-GLU MLP.

`KimiMLP` is the dense first layer (`mlp`, width `intermediate_size`) and the shared experts of each
MoE block (`shared_experts`, width `moe_intermediate_size * num_shared_experts`); its parameter names
(`gate_proj`, `up_proj`, `down_proj`) are the released checkpoint's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from posttrain.model.configuration_kimi_k3 import KimiK3Config
from posttrain.ops.fusion import region
from posttrain.ops.situ import situ_glu


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight over the last dim, in float32, returned in out_dtype
    (default x's dtype)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * weight.float()).to(out_dtype or x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, returned in the input dtype (weight initialised to 1).

    `compile_regions` is the config key of `posttrain.ops.fusion`. `feeds_matmuls` marks a norm
    whose output only enters matmuls: under autocast it is returned in the autocast dtype, the
    values autocast would cast it to anyway, so the float32 output and the per-matmul casts of
    it (six for a KDA layer's input) are never written.
    """

    def __init__(
        self, dim: int, eps: float = 1e-5, compile_regions: bool | None = False, feeds_matmuls: bool = False
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.compile_regions = compile_regions
        self.feeds_matmuls = feeds_matmuls

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out_dtype = None
        if self.feeds_matmuls and torch.is_autocast_enabled(x.device.type):
            out_dtype = torch.get_autocast_dtype(x.device.type)
        return region(rms_norm, self.compile_regions, x)(x, self.weight, self.eps, out_dtype)


def glu_activation(config: KimiK3Config, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The config's GLU: SiTU (K3; vLLM's beta defaults to 1 when unset) or SwiGLU."""
    if config.hidden_act == "situ":
        return situ_glu(gate, up, config.activation_situ_beta or 1.0, config.activation_situ_linear_beta)
    return F.silu(gate) * up


class KimiMLP(nn.Module):
    """SiTU-GLU MLP: down_proj(act(gate_proj(x), up_proj(x)))."""

    def __init__(self, config: KimiK3Config, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.config = config
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.from_projections(self.gate_proj(x), self.up_proj(x))

    def from_projections(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The rest of the MLP given gate_proj(x) and up_proj(x) (computed by a stacked GEMM)."""
        return self.down_proj(glu_activation(self.config, gate, up))
