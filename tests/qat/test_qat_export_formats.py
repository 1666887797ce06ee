"""Our MXFP4 export read by the real third-party code that serves it: compressed-tensors decodes the
bytes to our values, and vLLM's compressed-tensors config sends the routed experts (and nothing
else) to its MXFP4 MoE path."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from posttrain.qat import QATConfig, apply_qat, quantize_dequantize, routed_expert_modules
from posttrain.qat.export import export_mxfp4, mxfp4_quantization_config


def test_compressed_tensors_decodes_our_bytes(tiny_model, tmp_path):
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme

    qc = mxfp4_quantization_config()
    assert QuantizationConfig.model_validate(qc).format == "mxfp4-pack-quantized"
    scheme = QuantizationScheme.model_validate(qc["config_groups"]["group_0"])
    with torch.no_grad():
        for p in routed_expert_modules(tiny_model)["model.layers.2.block_sparse_moe.experts"].parameters():
            p.mul_(torch.logspace(-30, 30, p.shape[-1], base=2.0))  # scales far from 1, both ways
    apply_qat(tiny_model, QATConfig())
    tensors = load_file(export_mxfp4(tiny_model, tmp_path / "mx") / "model.safetensors")
    experts = routed_expert_modules(tiny_model)["model.layers.2.block_sparse_moe.experts"]
    for w in ("w1", "w2", "w3"):
        expected = quantize_dequantize(getattr(experts, w).detach(), "mxfp4")
        for e in (0, 7):
            prefix = f"language_model.model.layers.2.block_sparse_moe.experts.{e}.{w}"
            state = {
                "weight_packed": tensors[f"{prefix}.weight_packed"],
                "weight_scale": tensors[f"{prefix}.weight_scale"],
            }
            decoded = MXFP4PackedCompressor.decompress(state, scheme)["weight"]
            assert decoded.dtype == torch.bfloat16
            assert torch.equal(decoded.float(), expected[e])


@pytest.mark.vllm
def test_vllm_routes_only_routed_experts_to_mxfp4(tiny_model):
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig,
    )

    config = CompressedTensorsConfig.from_config(mxfp4_quantization_config())
    linear = torch.nn.Linear(1, 1)
    for layer in (1, 2, 3):
        for e in (0, 7):
            for w in ("w1", "w2", "w3"):
                scheme = config.get_scheme_dict(
                    linear, f"model.layers.{layer}.block_sparse_moe.experts.{e}.{w}"
                )
                assert scheme["format"] == "mxfp4-pack-quantized"
                assert config._is_mxfp4(scheme["weights"]) and scheme["input_activations"] is None
    linears = [n for n, m in tiny_model.named_modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) > 30
    # Our Linears plus the fused names vLLM's K3 builds from them must all stay unquantised.
    fused = ["model.layers.0.self_attn.in_proj_qkvgfab", "model.layers.3.self_attn.fused_qkv_a_g_proj",
             "model.layers.0.mlp.gate_up_proj", "model.layers.1.block_sparse_moe.shared_experts.gate_up_proj",
             "model.layers.1.self_attention_res_proj"]  # fmt: skip
    for name in linears + fused:
        assert config.get_scheme_dict(linear, name) is None, name
