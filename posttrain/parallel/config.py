"""The `parallel:` block of a stage file: expert parallelism for a stage launched in several
processes (`torchrun` or `accelerate launch`), with FSDP2 over the rest when `accelerate.fsdp` is set.

It is a block of its own, not an accelerate option, because accelerate has no expert parallelism:
the experts are split here (`shard_experts`) and FSDP2 is applied by `fully_shard_dense`, with the
experts left out, from the keys `accelerate.fsdp` already has (`reshard_after_forward`,
`activation_checkpointing`) and `accelerate.mixed_precision` (bf16: FSDP2's MixedPrecisionPolicy).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class ParallelConfig(BaseModel):
    """Expert parallelism across the processes of one stage (docs/scaling.md)."""

    model_config = ConfigDict(extra="forbid")
    expert_parallel: int = Field(
        1,
        ge=1,
        description="ranks each MoE layer's routed experts are split over; divides the world size "
        "and num_experts (world / expert_parallel groups hold the same experts)",
    )
    reduce_dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="dtype of FSDP2's gradient reduce-scatter under accelerate.mixed_precision bf16",
    )
