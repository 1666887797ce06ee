"""The released Kimi K3 checkpoint layout, which is what vLLM's `KimiK3ForConditionalGeneration` reads.

config.json is the multimodal wrapper: `model_type: kimi_k3`, `architectures:
[KimiK3ForConditionalGeneration]`, the text keys under `text_config` (whose `model_type` is
`kimi_linear`), a `vision_config`, `media_placeholder_token_id`, and, for MXFP4 experts, the
compressed-tensors `quantization_config` at the top level. Text tensors are named
`language_model.model.*` and `language_model.lm_head.weight`; routed experts one per expert
(`...experts.{e}.w1.weight`, or `.weight_packed` / `.weight_scale` when packed). vLLM's name mapper
rewrites only `language_model.layers.`, so every text tensor carries the full prefix, and vLLM never
ties `lm_head`, so a tied model is written untied (the LM head stored as a copy of the embedding).

`save_released` writes this layout (stage outputs and `posttrain export`); reading it back is
`from_pretrained` (the config unwraps in `KimiK3Config.from_dict`, names and packed experts convert
in the checkpoint-conversion mapping of `modeling_kimi_k3`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors.torch import save_file
from torch import nn

from posttrain.files import new_dir
from posttrain.weight_files import INDEX_FILE

WRAPPER_ARCHITECTURE = "KimiK3ForConditionalGeneration"
WRAPPER_MODEL_TYPE = "kimi_k3"
TEXT_ARCHITECTURE = "KimiLinearForCausalLM"
TEXT_MODEL_TYPE = "kimi_linear"
TEXT_PREFIX = "language_model."
MEDIA_PLACEHOLDER_TOKEN = "<|media_pad|>"  # the token vLLM's K3 processor resolves
RELEASED_MEDIA_PLACEHOLDER_TOKEN_ID = 163605
# Wrapper-level keys that describe the vision side; a loaded config keeps them so that a model read
# from a released directory is written back with the same vision header.
VISION_KEYS = ("vision_config", "media_placeholder_token_id")
# Keys of a config dict that are transformers' bookkeeping, not text hyper-parameters.
_WRAPPER_ONLY = ("text_config", "model_type", "architectures", "ignore_index", "image_placeholder")
_TOP_LEVEL = ("posttrain_qat", "quantization_config", "transformers_version", *VISION_KEYS)
PREPROCESSOR_FILE = "preprocessor_config.json"
DEFAULT_MAX_SHARD_SIZE = "5GB"

# [E, out, in] weight of one projection -> {suffix: [E, ...]} tensors written per expert, e.g.
# {"weight": w} or {"weight_packed": blocks, "weight_scale": scales}.
ExpertWriter = Callable[[torch.Tensor], dict[str, torch.Tensor]]


def default_vision_config(text_hidden_size: int) -> dict[str, Any]:
    """The `vision_config` written when the model has none of its own: `KimiK3VisionConfig` (vLLM's
    keys), at the released size (27 layers, width 1024) for a full-size text model and scaled down
    (2 layers, width 64) for a smaller one. Text-only serving never builds the tower
    (`--language-model-only`); this header is what vLLM's config parser needs."""
    from posttrain.model.vision_config import KimiK3VisionConfig  # the vision side stays optional

    if text_hidden_size >= 7168:
        config = KimiK3VisionConfig(text_hidden_size=text_hidden_size)
    else:
        config = KimiK3VisionConfig(
            init_pos_emb_height=8,
            init_pos_emb_width=8,
            vt_num_attention_heads=2,
            vt_num_hidden_layers=2,
            vt_hidden_size=64,
            vt_intermediate_size=256,
            qkv_hidden_size=64,
            text_hidden_size=text_hidden_size,
        )
    data = config.to_dict()
    data.pop("transformers_version", None)
    return data


def default_preprocessor_config(vision_config: dict[str, Any]) -> dict[str, Any]:
    """preprocessor_config.json: the MoonViT media-processor settings (`media_proc_cfg`) that vLLM's
    K3 processor reads when it parses the model, even for text-only serving. Patch and merge sizes
    follow `vision_config`; the limits are MoonViT's (16384 patches an image, 512 a side)."""
    return {
        "image_processor_type": "KimiK25VisionProcessor",
        "media_proc_cfg": {
            "patch_size": vision_config["patch_size"],
            "merge_kernel_size": vision_config["merge_kernel_size"][0],
            "temporal_merge_kernel_size": vision_config["init_pos_emb_time"],
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
            "in_patch_limit": 16384,
            "patch_limit_on_one_side": 512,
            "fixed_output_tokens": None,
            "in_patch_limit_each_frame": 4096,
            "in_patch_limit_video": None,
            "sample_fps": 2.0,
            "max_num_frames_each_video": None,
            "timestamp_mode": "hh:mm:ss.fff",
        },
    }


def is_released_config(data: dict[str, Any]) -> bool:
    """Whether a config.json dict is the wrapper (text keys under `text_config`)."""
    return isinstance(data.get("text_config"), dict)


def flatten_released_config(data: dict[str, Any]) -> dict[str, Any]:
    """The flat `KimiK3Config` keys of a wrapper config.json dict: the `text_config` keys, plus the
    wrapper's vision header, QAT record and quantization config (text keys win on a clash)."""
    flat = {k: v for k, v in data.items() if k not in _WRAPPER_ONLY}
    text = {k: v for k, v in data["text_config"].items() if k not in ("model_type", "architectures")}
    flat.update(text)
    return flat


def released_config_dict(
    config: Any,
    *,
    dtype: torch.dtype,
    quantization_config: dict[str, Any] | None = None,
    media_placeholder_token_id: int | None = None,
) -> dict[str, Any]:
    """config.json content of the released layout for a `KimiK3Config` (written untied).

    media_placeholder_token_id defaults to the config's own (a model read from a release), else the
    released id when the vocabulary holds it, else the pad token (a small vocabulary has no media
    token; vLLM's processor needs a token id it can decode, and text serving places no media). The
    model's `vision_config`, if it has one, is kept (keys it lacks from `default_vision_config`).
    """
    text = config.to_dict()
    top = {key: text.pop(key) for key in _TOP_LEVEL if key in text}
    # _name_or_path: the directory this config was read from (a base model, the SFT stage's output);
    # kept, it would publish that machine's path and make equal weights' config.json (and the run's
    # model hashes) differ between run dirs.
    for key in ("architectures", "model_type", "dtype", "torch_dtype", "auto_map", "_name_or_path"):
        text.pop(key, None)
    dtype_name = str(dtype).removeprefix("torch.")
    text.update(model_type=TEXT_MODEL_TYPE, tie_word_embeddings=False, dtype=dtype_name)
    # the model's own vision header (from a release) over the defaults, so every key vLLM reads exists
    vision = {**default_vision_config(config.hidden_size), **(top.pop("vision_config", None) or {})}
    vision.pop("_name_or_path", None)
    placeholder = top.pop("media_placeholder_token_id", None)
    if media_placeholder_token_id is not None:
        placeholder = media_placeholder_token_id
    if placeholder is None:
        big = config.vocab_size > RELEASED_MEDIA_PLACEHOLDER_TOKEN_ID
        placeholder = RELEASED_MEDIA_PLACEHOLDER_TOKEN_ID if big else config.pad_token_id
    out: dict[str, Any] = {
        "architectures": [WRAPPER_ARCHITECTURE],
        "model_type": WRAPPER_MODEL_TYPE,
        "text_config": text,
        "vision_config": {**vision, "text_hidden_size": config.hidden_size},
        "media_placeholder_token_id": placeholder,
        "pad_token_id": text.get("pad_token_id"),
        "ignore_index": -100,
        "tie_word_embeddings": False,
        "dtype": dtype_name,
        **top,
    }
    out.pop("quantization_config", None)  # a stale one from a loaded release; ours is passed in
    if quantization_config is not None:
        out["quantization_config"] = quantization_config
    return out


def _expert_modules(model: nn.Module) -> dict[str, nn.Module]:
    from posttrain.model.moe import KimiK3Experts

    return {name: m for name, m in model.named_modules() if isinstance(m, KimiK3Experts)}


def released_state_dict(
    model: nn.Module, *, dtype: torch.dtype | None = None, expert_writer: ExpertWriter | None = None
) -> dict[str, torch.Tensor]:
    """The model's tensors under their released names (not yet cloned: expert entries are views).

    Routed experts are split per expert, through `expert_writer` when given (e.g. MXFP4 packing);
    floating tensors are cast to dtype when given, except the router's float32 selection bias
    (`e_score_correction_bias`, kept in float32 as vLLM's gate keeps it); a tied LM head is written
    as its own tensor.
    """
    state = {name: t.detach() for name, t in model.state_dict().items()}
    out: dict[str, torch.Tensor] = {}
    for module_name in _expert_modules(model):
        for w in ("w1", "w2", "w3"):
            weight = state.pop(f"{module_name}.{w}")
            parts = expert_writer(weight) if expert_writer is not None else {"weight": weight}
            for suffix, tensor in parts.items():
                if tensor.is_floating_point() and dtype is not None:
                    tensor = tensor.to(dtype)
                for e in range(tensor.shape[0]):
                    out[f"{TEXT_PREFIX}{module_name}.{e}.{w}.{suffix}"] = tensor[e]
    if getattr(model.config, "tie_word_embeddings", False):
        state["lm_head.weight"] = model.get_input_embeddings().weight.detach()
    for name, tensor in state.items():
        if tensor.is_floating_point() and dtype is not None and not name.endswith("e_score_correction_bias"):
            tensor = tensor.to(dtype)
        out[TEXT_PREFIX + name] = tensor
    return out


def write_safetensors(
    out_dir: Path, state: dict[str, torch.Tensor], max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE
) -> list[str]:
    """Write `state` as one `model.safetensors`, or shards plus `model.safetensors.index.json` when it
    exceeds max_shard_size. Tensors are cloned one shard at a time (views of one storage cannot be
    saved side by side), so the extra memory is one shard. Returns the file names written."""
    split = split_torch_state_dict_into_shards(state, max_shard_size=max_shard_size)
    for filename, names in split.filename_to_tensors.items():
        shard = {name: state[name].contiguous().clone() for name in names}
        save_file(shard, str(out_dir / filename), metadata={"format": "pt"})
        del shard
    if split.is_sharded:
        index = {
            "metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
            "weight_map": dict(sorted(split.tensor_to_filename.items())),
        }
        (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return sorted(split.filename_to_tensors)


def model_dtype(model: nn.Module) -> torch.dtype:
    return next(model.parameters()).dtype


def save_released(
    model: nn.Module,
    out_dir: str | Path,
    *,
    tokenizer: Any = None,
    dtype: torch.dtype | None = None,
    expert_writer: ExpertWriter | None = None,
    quantization_config: dict[str, Any] | None = None,
    extra_config: dict[str, Any] | None = None,
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
) -> Path:
    """Write `model` (a KimiK3ForCausalLM) to out_dir in the released layout; returns out_dir.

    out_dir is written whole or not at all: files go to a sibling temp dir renamed into place (an
    existing out_dir is an error). dtype: floating tensors' dtype (default: the model's).
    tokenizer: saved alongside (with its chat template); its `<|media_pad|>` id, if it has one,
    becomes `media_placeholder_token_id`. extra_config: keys merged into config.json's top level.
    Also written: the generation config when the model has one, and the vision preprocessor config
    vLLM's parser reads (`default_preprocessor_config`).
    """
    out_dir = Path(out_dir)
    with new_dir(out_dir) as tmp:
        dtype = dtype or model_dtype(model)
        state = released_state_dict(model, dtype=dtype, expert_writer=expert_writer)
        write_safetensors(tmp, state, max_shard_size)
        del state
        placeholder = None
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
            if MEDIA_PLACEHOLDER_TOKEN in tokenizer.get_vocab():
                placeholder = tokenizer.convert_tokens_to_ids(MEDIA_PLACEHOLDER_TOKEN)
        config = released_config_dict(
            model.config,
            dtype=dtype,
            quantization_config=quantization_config,
            media_placeholder_token_id=placeholder,
        )
        config.update(extra_config or {})
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        preprocessor = default_preprocessor_config(config["vision_config"])
        (tmp / PREPROCESSOR_FILE).write_text(json.dumps(preprocessor, indent=2) + "\n")
        generation_config = getattr(model, "generation_config", None)
        if generation_config is not None:
            generation_config.save_pretrained(str(tmp))
    return out_dir
