"""How K3 checkpoints on disk map onto `KimiK3ForCausalLM`'s parameters (transformers' checkpoint
conversion mapping for model_type kimi_k3), so `from_pretrained` reads every layout we meet:

- routed experts stored per expert (`...experts.{e}.w1.weight`, the released names) merge into the
  module's 3-D `experts.w1` [E, out, in]; `save_pretrained` splits them again;
- MXFP4-packed experts (`.weight_packed` uint8 [out, in/2] + `.weight_scale` uint8 [out, in/32],
  compressed-tensors `mxfp4-pack-quantized`) are dequantised exactly (`posttrain.qat.mx.unpack_mxfp4`)
  into the same 3-D weights; written back by `save_pretrained` they are full-precision per-expert
  weights, never re-packed behind the caller's back;
- the released wrapper's `language_model.` prefix (`language_model.model.*`,
  `language_model.lm_head.weight`) is removed; flat `model.*` names (older run dirs) load as they are.
Vision-tower tensors of a released checkpoint (`vision_tower.*`, `mm_projector.*`) have no module
in the text model and are skipped (`KimiK3PreTrainedModel._keys_to_ignore_on_load_unexpected`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers.conversion_mapping import (
    get_checkpoint_conversion_mapping,
    register_checkpoint_conversion_mapping,
)
from transformers.core_model_loading import (
    ConversionOps,
    MergeModulelist,
    PrefixChange,
    WeightConverter,
)

from posttrain.model.configuration_kimi_k3 import KimiK3Config
from posttrain.model.released import TEXT_PREFIX, WRAPPER_ARCHITECTURE
from posttrain.qat.mx import unpack_mxfp4

EXPERT_WEIGHTS = ("w1", "w2", "w3")  # gate, down, up: the released per-expert names
_PACKED_NAME = re.compile(
    r"^(?P<module>.+)\.(?P<expert>\d+)\.(?P<weight>w[123])\.weight_(?P<part>packed|scale)$"
)


def check_packed_experts(model_dir: str | Path) -> None:
    """Raise ValueError naming the module if a directory's MXFP4-packed experts are incomplete: every
    expert 0..E-1 of a packed projection needs both `weight_packed` and `weight_scale`. Reads only
    the safetensors headers (names), so it costs nothing before a load."""
    parts: dict[tuple[str, str], dict[int, set[str]]] = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():
                m = _PACKED_NAME.match(name)
                if m:
                    experts = parts.setdefault((m["module"], m["weight"]), {})
                    experts.setdefault(int(m["expert"]), set()).add(m["part"])
    for (module, w), experts in sorted(parts.items()):
        incomplete = sorted(e for e, found in experts.items() if found != {"packed", "scale"})
        if incomplete or sorted(experts) != list(range(len(experts))):
            raise ValueError(
                f"{model_dir}: packed experts of {module}.*.{w} are incomplete (experts {sorted(experts)}, "
                f"missing a part: {incomplete}); each expert 0..E-1 needs weight_packed and weight_scale"
            )


def _as_uint8(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """The stored bytes. transformers may have cast them to the model's float dtype on the way in
    (every integer 0..255 is exact in float32 and bfloat16), so cast back after checking."""
    if tensor.dtype == torch.uint8:
        return tensor
    as_bytes = tensor.to(torch.uint8)
    if not torch.equal(as_bytes.to(tensor.dtype), tensor):
        raise ValueError(f"{name}: expected uint8 MXFP4 bytes, got {tensor.dtype} values outside 0..255")
    return as_bytes


class UnpackMXFP4Experts(ConversionOps):
    """{packed pattern: [E, out, in/2], scale pattern: [E, out, in/32]} -> {target: [E, out, in]}."""

    def convert(
        self,
        input_dict: dict[str, Any],
        source_patterns: list[str],
        target_patterns: list[str],
        **kwargs: Any,
    ) -> dict[str, torch.Tensor]:
        packed_key, scale_key = source_patterns
        layer = kwargs.get("full_layer_name", target_patterns[0])
        if packed_key not in input_dict or scale_key not in input_dict:
            raise ValueError(
                f"{layer}: packed MXFP4 experts need both weight_packed and weight_scale for every expert; "
                f"found only {sorted(input_dict)}"
            )
        blocks = _as_uint8(input_dict[packed_key], f"{layer} weight_packed")
        scales = _as_uint8(input_dict[scale_key], f"{layer} weight_scale")
        if blocks.shape[0] != scales.shape[0]:
            raise ValueError(
                f"{layer}: {blocks.shape[0]} experts have weight_packed but {scales.shape[0]} have "
                "weight_scale; each expert needs both"
            )
        return {target_patterns[0]: unpack_mxfp4(blocks, scales, dtype=torch.float32)}

    @property
    def reverse_op(self) -> ConversionOps:
        raise NotImplementedError("packed experts are written by posttrain.qat.export, not save_pretrained")


class MXFP4ExpertsConverter(WeightConverter):
    """Packed per-expert MXFP4 -> one 3-D weight. Its reverse (what `save_pretrained` applies) is the
    plain per-expert split, so a model loaded from packed experts saves full-precision ones."""

    __slots__ = ()

    def reverse_transform(self) -> WeightConverter:
        return per_expert_converter(self.target_patterns[0].rsplit(".", 1)[-1]).reverse_transform()


def per_expert_converter(w: str) -> WeightConverter:
    return WeightConverter(
        source_patterns=f"block_sparse_moe.experts.*.{w}.weight",
        target_patterns=f"block_sparse_moe.experts.{w}",
        operations=[MergeModulelist(dim=0)],
    )


def packed_expert_converter(w: str) -> MXFP4ExpertsConverter:
    return MXFP4ExpertsConverter(
        source_patterns=[
            f"block_sparse_moe.experts.*.{w}.weight_packed",
            f"block_sparse_moe.experts.*.{w}.weight_scale",
        ],
        target_patterns=f"block_sparse_moe.experts.{w}",
        operations=[MergeModulelist(dim=0), UnpackMXFP4Experts()],
    )


def expert_converters() -> list[WeightConverter]:
    # Packed converters come first: the plain pattern `experts.*.w1.weight` is a prefix of
    # `experts.*.w1.weight_packed`, and the first matching converter wins.
    return [
        *(packed_expert_converter(w) for w in EXPERT_WEIGHTS),
        *(per_expert_converter(w) for w in EXPERT_WEIGHTS),
    ]


def register_checkpoint_layout() -> None:
    """Register the mapping above for model_type kimi_k3 (once per process), and the experts alone
    for the multimodal `KimiK3ForConditionalGeneration`, whose own `language_model` module keeps the
    prefix. transformers looks a mapping up by class name before model_type, and scopes the text
    model's kimi_k3 mapping under `language_model.` there, where the prefix removal matches nothing."""
    if get_checkpoint_conversion_mapping(KimiK3Config.model_type) is not None:
        return
    register_checkpoint_conversion_mapping(
        KimiK3Config.model_type,
        [PrefixChange(prefix_to_remove=TEXT_PREFIX.rstrip(".")), *expert_converters()],
    )
    register_checkpoint_conversion_mapping(WRAPPER_ARCHITECTURE, expert_converters())
