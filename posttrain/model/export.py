"""Write a K3 checkpoint that vLLM's K3 text loader reads.

`save_pretrained` already writes the released weight names (per-expert `experts.{e}.w1.weight`,
`model.layers.{i}.self_attn.*`, ...). What vLLM keys on besides names is config.json: for a text-only
K3 it builds `KimiLinearForCausalLM` (its K3 implementation) from `model_type: kimi_linear` with the
same flat keys; `model_type: kimi_k3` would make it expect the multimodal wrapper (`text_config`,
`vision_config`). So the export is our checkpoint with that config header.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from posttrain.model.configuration_kimi_k3 import KimiK3Config

VLLM_ARCHITECTURE = "KimiLinearForCausalLM"
VLLM_MODEL_TYPE = "kimi_linear"


def vllm_config_dict(config: KimiK3Config) -> dict[str, Any]:
    """config.json content for vLLM's text-only K3 path (its `KimiLinearConfig` keys)."""
    data = config.to_dict()
    data["model_type"] = VLLM_MODEL_TYPE
    data["architectures"] = [VLLM_ARCHITECTURE]
    return data


def save_for_vllm(model, out_dir: str | Path, **save_kwargs: Any) -> Path:
    """Save `model` (a KimiK3ForCausalLM) to out_dir for `vllm.LLM(model=out_dir)`; returns out_dir.

    The directory is for vLLM: transformers' AutoModel would read `kimi_linear` as its own class.
    Tokenizer files are the caller's to copy alongside.
    """
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir, **save_kwargs)
    (out_dir / "config.json").write_text(json.dumps(vllm_config_dict(model.config), indent=2, sort_keys=True))
    return out_dir
