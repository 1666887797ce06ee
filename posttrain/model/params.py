"""count_parameters: total and per-token active parameters of a K3 config, without allocating.

The model is built on the meta device, so the full 2.78T configuration costs no memory. "active" is
what one token touches: every parameter except the token embedding (a lookup, not a matmul) and all
but `num_experts_per_token` of each MoE layer's routed experts; the LM head counts. Buffers (the
router's selection bias) are not parameters and are not counted.
"""

from __future__ import annotations

import torch

from posttrain.model.configuration_kimi_k3 import KimiK3Config


def count_parameters(config: KimiK3Config) -> dict[str, int]:
    """{"total": all parameters, "active": parameters used per token} of KimiK3ForCausalLM(config)."""
    from posttrain.model.modeling_kimi_k3 import KimiK3ForCausalLM
    from posttrain.model.moe import KimiK3Experts

    with torch.device("meta"):
        model = KimiK3ForCausalLM(config)
    total = sum(p.numel() for p in model.parameters())
    active = total - model.model.embed_tokens.weight.numel()
    if config.tie_word_embeddings:
        # the shared matrix is counted once in `total` and is used by the head
        active += model.model.embed_tokens.weight.numel()
    for module in model.modules():
        if isinstance(module, KimiK3Experts):
            per_expert = sum(p.numel() for p in module.parameters()) // module.num_experts
            active -= per_expert * (module.num_experts - config.num_experts_per_token)
    return {"total": total, "active": active}
