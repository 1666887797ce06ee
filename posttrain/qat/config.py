"""The `qat:` block of a stage file: which MX quantisation the routed experts train and serve with.

K3 quantises from SFT onward (`scheme: k3`) and every later stage carries the same block, so the
policy trained is the policy served; `scheme: none` trains in full precision. Scale rules are per
tensor kind because the released checkpoint and the serving kernels differ: weights use the OCP
"floor" rule (what the MXFP4 checkpoint's E8M0 scales encode), activations use "rceil" (what vLLM's
MXFP8 activation quantiser computes, and torchao's QAT default), which never saturates.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from posttrain.qat.mx import ScaleRule


class QATConfig(BaseModel):
    """Quantisation-aware training of K3's routed experts (attention, latent projections, shared
    experts, router, embeddings and LM head always stay in high precision)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    scheme: Literal["k3", "none"] = Field(
        "k3", description="k3: MXFP4 routed-expert weights + MXFP8 routed-expert input activations; none: off"
    )
    weight_format: Literal["mxfp4"] = Field("mxfp4", description="element format of routed-expert weights")
    activation_format: Literal["mxfp8_e4m3"] = Field(
        "mxfp8_e4m3", description="element format of the activations entering each expert matmul"
    )
    weight_scale_rule: ScaleRule = Field("floor", description="E8M0 scale rule for weights (OCP floor)")
    activation_scale_rule: ScaleRule = Field("rceil", description="E8M0 scale rule for activations (vLLM's)")
    block_size: Literal[32] = Field(32, description="elements sharing one E8M0 scale (OCP MX: 32)")

    @property
    def enabled(self) -> bool:
        return self.scheme != "none"
