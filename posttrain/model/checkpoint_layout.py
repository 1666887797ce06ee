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
from posttrain.weight_files import RECOPY, TensorHeader, weight_headers

EXPERT_WEIGHTS = ("w1", "w2", "w3")  # gate, down, up: the released per-expert names
_LAYER = re.compile(r"(?:^|\.)model\.layers\.(\d+)\.")
_EXPERT_NAME = re.compile(
    r"^(?P<module>.+\.experts)\.(?P<expert>\d+)\.(?P<weight>w[123])\.(?P<part>weight|weight_packed|weight_scale)$"
)


def check_k3_weights(model_dir: str | Path, config: KimiK3Config) -> None:
    """Raise ValueError naming the file, tensor and fix when a directory's tensors cannot be a K3
    model's, before transformers loads them (it would cast an integer tensor into a float weight
    without a word, and fail on uneven experts deep inside its conversion). Reads only the
    safetensors headers (`weight_headers`), so it costs nothing before a load:
    - every tensor is floating point, except MXFP4 parts (`weight_packed` / `weight_scale`: U8);
    - a projection's routed experts are stored in one form, plain or packed, and every expert
      0..E-1 of a packed one has both parts;
    - the experts of one projection share one shape per part, and a packed part holds two values a
      byte against one scale per 32 values;
    - the embedding and the layer count are the sizes `config` (the directory's config.json) gives:
      checked before the model is built, as a config.json that lost a key would build the full-size
      K3 default, tens of GB, only to find every shape wrong."""
    # (experts module, w1|w2|w3) -> part -> expert -> (tensor name, header)
    experts: dict[tuple[str, str], dict[str, dict[int, tuple[str, TensorHeader]]]] = {}
    layers = 0
    for file, header in weight_headers(model_dir).items():
        for name, tensor in header.items():
            _check_size(Path(model_dir) / file, name, tensor, config)
            layer = _LAYER.search(name)
            layers = max(layers, int(layer[1]) + 1 if layer else 0)
            m = _EXPERT_NAME.match(name)
            packed = m is not None and m["part"] != "weight"
            if tensor.is_floating == packed:
                form = "MXFP4 bytes are stored as U8" if packed else "a K3 weight is F32, BF16 or F16"
                raise ValueError(
                    f"{Path(model_dir) / file}: {name} is {tensor.dtype}; {form}. The file was written "
                    "wrong: export the checkpoint again"
                )
            if m is not None:
                parts = experts.setdefault((m["module"], m["weight"]), {})
                parts.setdefault(m["part"], {})[int(m["expert"])] = (name, tensor)
    for (module, w), parts in sorted(experts.items()):
        where = f"{model_dir}: routed experts {module}.*.{w}"
        if "weight" in parts and len(parts) > 1:
            raise ValueError(
                f"{where} are stored both plain (.weight) and packed (.weight_packed / .weight_scale): "
                "keep one form per projection"
            )
        numbers = sorted(set().union(*parts.values()))
        incomplete = sorted(e for e in numbers if any(e not in by_expert for by_expert in parts.values()))
        if incomplete:
            raise ValueError(
                f"{where}: experts {incomplete} lack a part; each expert needs weight_packed and "
                f"weight_scale: {RECOPY}"
            )
        absent = sorted(set(range(numbers[-1] + 1)) - set(numbers))
        if absent:
            raise ValueError(
                f"{where}: experts {absent[:8]} are absent ({len(numbers)} stored, the last numbered "
                f"{numbers[-1]}; experts are numbered 0..E-1): {RECOPY}"
            )
        for by_expert in parts.values():
            first_name, first = by_expert[0]
            for name, tensor in by_expert.values():
                if tensor.shape != first.shape:
                    raise ValueError(
                        f"{where}: {name} has shape {list(tensor.shape)}, {first_name} "
                        f"{list(first.shape)}; every expert of a projection has one shape"
                    )
        if "weight_packed" in parts:
            packed, scale = parts["weight_packed"][0][1].shape, parts["weight_scale"][0][1].shape
            if len(packed) != 2 or scale != (packed[0], packed[1] * 2 // 32):
                raise ValueError(
                    f"{where}: weight_packed {list(packed)} and weight_scale {list(scale)} do not fit: "
                    "[out, in/2] bytes take [out, in/32] scales"
                )
    if layers and layers != config.num_hidden_layers:
        raise ValueError(
            f"{model_dir}: the weights hold {layers} decoder layers, config.json's num_hidden_layers is "
            f"{config.num_hidden_layers}: use the config.json these weights were saved with"
        )


def _check_size(file: Path, name: str, tensor: TensorHeader, config: KimiK3Config) -> None:
    if not name.endswith("model.embed_tokens.weight"):
        return
    built = (config.vocab_size, config.hidden_size)
    if tensor.shape != built:
        raise ValueError(
            f"{file}: {name} is {list(tensor.shape)}, config.json builds {list(built)} (vocab_size, "
            "hidden_size): use the config.json these weights were saved with (a key it lacks falls back "
            "to the full-size K3 default)"
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
