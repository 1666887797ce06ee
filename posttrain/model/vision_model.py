"""K3 as the released vision-language model: `KimiK3ForConditionalGeneration` = MoonViT-V2
(`vision_tower`) + projector (`mm_projector`) + the K3 text model (`language_model`).

The config is the released multimodal header (`model_type: kimi_k3`, text keys under `text_config`
with vLLM's `model_type: kimi_linear`, `vision_config`, `media_placeholder_token_id`), so
`save_pretrained` writes a directory vLLM's `KimiK3ForConditionalGeneration` loader reads:
`vision_tower.*`, `mm_projector.*`, `language_model.model.*`, `language_model.lm_head.weight`
(routed experts per expert through the `kimi_k3` checkpoint-conversion mapping).

Visual tokens enter the text model as embeddings: every `<|media_pad|>` position of input_ids
(`media_placeholder_token_id`) is replaced by one projected visual token, items in order. Those
positions are prompt: their labels are ignored (-100), whatever the caller passed.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers import initialization as init
from transformers.modeling_outputs import CausalLMOutputWithPast

from posttrain.data.images import MediaItem, MoonViTImageProcessor
from posttrain.files import new_dir
from posttrain.model.configuration_kimi_k3 import KimiK3Config
from posttrain.model.modeling_kimi_k3 import KimiK3ForCausalLM, StrictLoading, check_loaded_whole
from posttrain.model.released import (
    MEDIA_PLACEHOLDER_TOKEN,
    RELEASED_MEDIA_PLACEHOLDER_TOKEN_ID,
    TEXT_MODEL_TYPE,
)
from posttrain.model.vision import KimiK3MultiModalProjector, MoonViTPosEmb, MoonViTV2
from posttrain.model.vision_config import KimiK3VisionConfig
from posttrain.weight_files import weight_headers

IMAGE_PLACEHOLDER = "<|kimi_image_placeholder|>"


class KimiK3VLConfig(PretrainedConfig):
    """The released multimodal K3 config: `text_config` (KimiK3Config keys), `vision_config`
    (KimiK3VisionConfig keys, `text_hidden_size` forced to the text width as vLLM does)."""

    model_type = "kimi_k3"
    sub_configs = {"text_config": KimiK3Config, "vision_config": KimiK3VisionConfig}

    def __init__(
        self,
        text_config: dict[str, Any] | KimiK3Config | None = None,
        vision_config: dict[str, Any] | KimiK3VisionConfig | None = None,
        media_placeholder_token_id: int = RELEASED_MEDIA_PLACEHOLDER_TOKEN_ID,
        ignore_index: int = -100,
        image_placeholder: str = IMAGE_PLACEHOLDER,
        pad_token_id: int | None = 0,
        **kwargs: Any,
    ) -> None:
        if isinstance(text_config, dict):
            text_config = KimiK3Config(**_strip_header(text_config))
        self.text_config = KimiK3Config() if text_config is None else text_config
        if isinstance(vision_config, dict):
            vision_config = KimiK3VisionConfig(**_strip_header(vision_config))
        self.vision_config = KimiK3VisionConfig() if vision_config is None else vision_config
        self.vision_config.text_hidden_size = self.text_config.hidden_size
        self.media_placeholder_token_id = media_placeholder_token_id
        self.ignore_index = ignore_index
        self.image_placeholder = image_placeholder
        kwargs.setdefault("architectures", ["KimiK3ForConditionalGeneration"])
        super().__init__(pad_token_id=pad_token_id, **kwargs)
        vocab = self.text_config.vocab_size
        if not 0 <= media_placeholder_token_id < vocab:
            raise ValueError(
                f"media_placeholder_token_id={media_placeholder_token_id} is outside the text vocabulary "
                f"(vocab_size={vocab}): use the tokenizer's id of <|media_pad|>"
            )

    def to_dict(self) -> dict[str, Any]:
        data = super().to_dict()
        data["text_config"]["model_type"] = TEXT_MODEL_TYPE  # what vLLM parses text_config as
        for key in ("text_config", "vision_config"):
            # transformers drops the top level's load path but not a sub-config's: the text config
            # read from the base model would publish that machine's path, so equal weights got
            # unequal config.json files (and model hashes) on two machines or run dirs.
            data[key].pop("_name_or_path", None)
        return data


def _strip_header(data: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in data.items() if k not in ("model_type", "architectures", "transformers_version")}


class KimiK3ForConditionalGeneration(StrictLoading, PreTrainedModel):
    """Vision tower, projector and K3 causal LM; `forward` takes input_ids with `<|media_pad|>`
    runs plus the processor's pixel_values / grid_thws."""

    config: KimiK3VLConfig
    config_class = KimiK3VLConfig
    base_model_prefix = ""
    supports_gradient_checkpointing = True
    _no_split_modules = ["KimiK3DecoderLayer", "MoonViTEncoderLayer"]

    def __init__(self, config: KimiK3VLConfig) -> None:
        super().__init__(config)
        self.vision_tower = MoonViTV2(config.vision_config)
        self.mm_projector = KimiK3MultiModalProjector(config.vision_config)
        self.language_model = KimiK3ForCausalLM(config.text_config)
        self.post_init()

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        # The text model initialises its own modules (transformers calls each sub-model's
        # _init_weights); here the vision side: linears and the patch conv N(0, initializer_range),
        # biases 0, norms 1, the position table N(0, initializer_range).
        std = self.config.vision_config.initializer_range
        if isinstance(module, nn.Linear | nn.Conv2d):
            init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.RMSNorm | nn.LayerNorm):
            init.ones_(module.weight)
            if getattr(module, "bias", None) is not None:
                init.zeros_(module.bias)
        elif isinstance(module, MoonViTPosEmb):
            init.normal_(module.weight, mean=0.0, std=std)

    def get_input_embeddings(self) -> nn.Module:
        return self.language_model.model.embed_tokens

    def media_embeddings(self, pixel_values: torch.Tensor, grid_thws: torch.Tensor | list) -> torch.Tensor:
        """[sum tokens, text hidden]: the projected visual tokens of every media item, in order."""
        features = self.vision_tower(pixel_values, grid_thws)
        return self.mm_projector(features.to(self.mm_projector.proj[0].weight.dtype))

    def forward(
        self,
        input_ids: torch.LongTensor,
        pixel_values: torch.Tensor | None = None,
        grid_thws: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        """Args:
        input_ids: [B, T]; each media item's visual tokens are a run of `<|media_pad|>` ids.
        pixel_values, grid_thws: `MoonViTImageProcessor` output for the items, in prompt order.
        attention_mask, labels and the rest: as `KimiK3ForCausalLM.forward` (labels at media
        positions are set to -100).
        """
        media = input_ids == self.config.media_placeholder_token_id
        embeds = self.get_input_embeddings()(input_ids)
        count = int(media.sum())
        if pixel_values is None:
            if count:
                raise ValueError(
                    f"input_ids hold {count} <|media_pad|> tokens but no pixel_values were given"
                )
        else:
            visual = self.media_embeddings(pixel_values, grid_thws)
            if visual.shape[0] != count:
                raise ValueError(
                    f"input_ids hold {count} <|media_pad|> tokens but the media give {visual.shape[0]} "
                    "visual tokens: render the prompt with the same processor's blocks"
                )
            embeds = embeds.masked_scatter(media[..., None], visual.to(embeds.dtype))
        if labels is not None:
            labels = labels.masked_fill(media, self.config.ignore_index)
        return self.language_model(
            inputs_embeds=embeds, attention_mask=attention_mask, labels=labels, **kwargs
        )


def count_vision_parameters(config: KimiK3VLConfig | KimiK3VisionConfig) -> dict[str, int]:
    """{"vision_tower": ..., "mm_projector": ...} parameter counts, built on the meta device."""
    vision = config.vision_config if isinstance(config, KimiK3VLConfig) else config
    with torch.device("meta"):
        tower, projector = MoonViTV2(vision), KimiK3MultiModalProjector(vision)
    return {
        "vision_tower": sum(p.numel() for p in tower.parameters()),
        "mm_projector": sum(p.numel() for p in projector.parameters()),
    }


# Through the pipeline: building, loading and feeding the multimodal model -------------------------


def has_vision_weights(model_dir: str | Path) -> bool:
    """Whether a checkpoint directory holds vision-tower tensors, read from the safetensors headers
    only. A text model's directory has a `vision_config` header too (vLLM's parser needs one) but
    no `vision_tower.*` tensors."""
    headers = weight_headers(model_dir).values()
    return any(name.startswith("vision_tower.") for header in headers for name in header)


def sees_images(model_dir: str | Path) -> bool:
    """Whether a directory is a vision-language model its own tokenizer can feed: vision weights,
    and its tokenizer's `<|media_pad|>` is the config's `media_placeholder_token_id` (a text-only
    save of a small vocabulary writes the pad token there, and no image can be rendered for it)."""
    directory = Path(model_dir)
    config_file = directory / "config.json"
    if not config_file.is_file() or not has_vision_weights(directory):
        return False
    placeholder = json.loads(config_file.read_text()).get("media_placeholder_token_id")
    return _added_tokens(directory).get(placeholder) == MEDIA_PLACEHOLDER_TOKEN


def _added_tokens(directory: Path) -> dict[int, str]:
    """id -> content of a saved tokenizer's added tokens (tokenizer.json's `added_tokens`, or
    tokenizer_config.json's `added_tokens_decoder` as a release without tokenizer.json has)."""
    out: dict[int, str] = {}
    config = directory / "tokenizer_config.json"
    if config.is_file():
        decoder = json.loads(config.read_text()).get("added_tokens_decoder", {})
        out.update({int(i): token.get("content") for i, token in decoder.items()})
    fast = directory / "tokenizer.json"
    if fast.is_file():
        out.update({t["id"]: t["content"] for t in json.loads(fast.read_text()).get("added_tokens", [])})
    return out


def load_pretrained(model_dir: str | Path, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """A checkpoint directory as the model it holds: KimiK3ForConditionalGeneration when it
    `sees_images`, else `AutoModelForCausalLM` (K3, whose vision tensors are then skipped, or any
    transformers causal LM). A weight holding NaN or inf is a ValueError naming it: a stage would
    otherwise fail at its first loss, blaming its learning rate."""
    import posttrain.model  # noqa: F401  (registers kimi_k3 with AutoModelForCausalLM)

    if sees_images(model_dir):
        model = KimiK3ForConditionalGeneration.from_pretrained(str(model_dir), dtype=dtype)
    else:
        # Strict for any causal LM (a Llama-shaped `model:` too), not only K3's own from_pretrained.
        model, info = AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=dtype, output_loading_info=True, ignore_mismatched_sizes=True
        )
        check_loaded_whole(model_dir, model, info)
    non_finite = [
        name
        for name, tensor in model.state_dict().items()
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all())
    ]
    if non_finite:
        raise ValueError(
            f"{model_dir}: {len(non_finite)} weights hold NaN or inf values, e.g. {non_finite[:4]}: it was "
            "saved from a diverged run; start from an earlier checkpoint of that run"
        )
    return model


def with_vision(
    text_model: KimiK3ForCausalLM,
    vision: KimiK3VisionConfig,
    media_placeholder_token_id: int,
    vision_weights: dict[str, torch.Tensor] | None = None,
) -> KimiK3ForConditionalGeneration:
    """`text_model` (its weights kept) under a vision tower and projector: how a stage starts a
    vision-language model from a text base or preset. Fresh ones, initialised from the global RNG,
    unless `vision_weights` (a pretrained vision directory's `vision_tower.*` / `mm_projector.*`
    tensors, `load_vision_dir`) gives every one of their parameters."""
    config = KimiK3VLConfig(
        text_config=text_model.config,
        vision_config=vision,
        media_placeholder_token_id=media_placeholder_token_id,
    )
    model = KimiK3ForConditionalGeneration(config)
    model.language_model = text_model
    if vision_weights is not None:
        own = {
            name: tensor for name, tensor in model.state_dict().items() if name.startswith(VISION_PREFIXES)
        }
        if set(own) != set(vision_weights):
            missing, extra = sorted(set(own) - set(vision_weights)), sorted(set(vision_weights) - set(own))
            raise ValueError(f"vision weights do not fit the tower: missing {missing[:4]}, extra {extra[:4]}")
        for name, tensor in vision_weights.items():
            if tensor.shape != own[name].shape:
                shapes = f"{tuple(tensor.shape)}, the tower's {tuple(own[name].shape)}"
                raise ValueError(f"vision weight {name} has shape {shapes}")
        model.load_state_dict(vision_weights, strict=False)
    return model


# A pretrained vision directory (data_recipes/vision_base/, data_recipes/pretrain_vision.py): the
# tower and projector alone, so a stage puts them under any text model of the same width.
VISION_CONFIG_FILE = "vision_config.yaml"
VISION_WEIGHTS_FILE = "model.safetensors"
VISION_PREFIXES = ("vision_tower.", "mm_projector.")


def is_vision_dir(path: str | Path) -> bool:
    """Whether `path` is a pretrained vision directory (its config and weights)."""
    path = Path(path)
    return (path / VISION_CONFIG_FILE).is_file() and (path / VISION_WEIGHTS_FILE).is_file()


def load_vision_dir(
    path: str | Path, text_hidden_size: int
) -> tuple[KimiK3VisionConfig, dict[str, torch.Tensor]]:
    """(the vision config, the `vision_tower.*` / `mm_projector.*` tensors) of a pretrained vision
    directory whose projector maps into `text_hidden_size`; a different width is an error (the
    projector was aligned to another text model)."""
    from safetensors.torch import load_file

    from posttrain.model.vision_config import load_vision_config

    path = Path(path)
    config = load_vision_config(path / VISION_CONFIG_FILE)
    if config.text_hidden_size != text_hidden_size:
        raise ValueError(
            f"vision dir {path}: its projector maps into width {config.text_hidden_size}, the text model's "
            f"hidden_size is {text_hidden_size}; pretrain a tower for this text model "
            "(data_recipes/pretrain_vision.py) or use a preset (a fresh tower)"
        )
    return config, load_file(str(path / VISION_WEIGHTS_FILE))


def image_processor(config: KimiK3VLConfig) -> MoonViTImageProcessor:
    """The processor whose patches and token counts match the model's vision tower."""
    return MoonViTImageProcessor.from_vision_config(config.vision_config)


def media_inputs(model: nn.Module, rows: Sequence[Sequence[MediaItem]]) -> dict[str, torch.Tensor]:
    """The forward's pixel_values / grid_thws for the media of a batch's rows, in row order (the
    order of the `<|media_pad|>` runs in the batch); {} when no row has media, so a text forward
    is called exactly as before."""
    entries = [entry for row in rows for entry in row]
    if not entries:
        return {}
    if not isinstance(getattr(model, "vision_tower", None), nn.Module):
        raise ValueError(
            f"{len(entries)} media entries but {type(model).__name__} has no vision tower; train a "
            "vision-language model (a stage with `vision:`, or a model dir with vision weights)"
        )
    batch = image_processor(model.config)(entries)
    device = next(model.parameters()).device
    return {"pixel_values": batch.pixel_values.to(device), "grid_thws": batch.grid_thws.to(device)}


def save_multimodal(
    model: KimiK3ForConditionalGeneration, out_dir: str | Path, *, tokenizer: Any = None
) -> Path:
    """Write the multimodal model in the released layout (save_pretrained: `vision_tower.*`,
    `mm_projector.*`, `language_model.*`, experts one by one), its tokenizer, its text model's
    generation config and the preprocessor_config.json vLLM's K3 processor reads; whole or not at
    all, as `save_released`."""
    from posttrain.model.released import PREPROCESSOR_FILE, default_preprocessor_config

    out_dir = Path(out_dir)
    with new_dir(out_dir) as tmp:
        model.save_pretrained(str(tmp), safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        model.language_model.generation_config.save_pretrained(str(tmp))
        preprocessor = default_preprocessor_config(model.config.vision_config.to_dict())
        (tmp / PREPROCESSOR_FILE).write_text(json.dumps(preprocessor, indent=2) + "\n")
    return out_dir
