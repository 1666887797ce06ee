"""The tiny vision-language K3 the vision tests share: tiny text (vocab grown by the four media
tokens) + tiny MoonViT-V2, seeded, with every vision norm weight randomised (ones would hide a norm
that is skipped or loaded into the wrong place) and vision matrices at std fan_in^-1/2 (at the
0.02 initialisation attention is nearly uniform, so a wrong rotary or mask would barely show)."""

from __future__ import annotations

from pathlib import Path

import torch

from posttrain.model import load_model_config
from posttrain.model.vision_config import load_vision_config
from posttrain.model.vision_model import KimiK3ForConditionalGeneration, KimiK3VLConfig

REPO = Path(__file__).resolve().parents[2]
TEXT_YAML = REPO / "stages" / "models" / "tiny.yaml"
VISION_YAML = REPO / "stages" / "models" / "vision-tiny.yaml"
VOCAB = 2048 + 4  # the shipped tokenizer + load_tokenizer(media=True)'s four media tokens
MEDIA_PAD_ID = 2051


def tiny_vl_config(vocab_size: int = VOCAB, media_pad_id: int = MEDIA_PAD_ID) -> KimiK3VLConfig:
    text = load_model_config(TEXT_YAML)
    text.vocab_size = vocab_size
    vision = load_vision_config(VISION_YAML)
    return KimiK3VLConfig(text_config=text, vision_config=vision, media_placeholder_token_id=media_pad_id)


def tiny_vl_model(seed: int = 0, **config_kwargs) -> KimiK3ForConditionalGeneration:
    torch.manual_seed(seed)
    model = KimiK3ForConditionalGeneration(tiny_vl_config(**config_kwargs))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.startswith(("vision_tower.", "mm_projector.")):
                continue
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
            elif name.endswith("pos_emb.weight"):
                p.normal_(0.0, 0.5)
            else:
                p.normal_(0.0, p[0].numel() ** -0.5)
    return model
