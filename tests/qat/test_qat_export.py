"""Export of a QAT-trained tiny K3 (MXFP4 packed and dequantised) and loading it back: files on
disk in the released layout (wrapper header, `language_model.*` names, experts per expert),
identical dequantised weights and identical logits."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from posttrain.model import KimiK3ForCausalLM
from posttrain.qat import (
    QATConfig,
    apply_qat,
    qat_config_of,
    quantize_dequantize,
    restore_qat,
    routed_expert_modules,
)
from posttrain.qat.export import export_dequantized, export_mxfp4, load_exported

EXPERTS = [f"model.layers.{i}.block_sparse_moe.experts" for i in (1, 2, 3)]
SAVED = "language_model."  # the released prefix of every text tensor on disk


def trained_like(model: KimiK3ForCausalLM) -> KimiK3ForCausalLM:
    """Router biases and attention-residual queries away from their zero init, as after training."""
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if name.endswith(("e_score_correction_bias", "_res_proj.weight")):
                t.copy_(torch.randn(t.shape, generator=gen) * 0.1)
    return model


@torch.no_grad()
def test_mxfp4_export_loads_back_to_identical_logits(tiny_model, token_ids, tmp_path):
    model = trained_like(tiny_model)
    apply_qat(model, QATConfig())
    expected = model(token_ids).logits
    out = export_mxfp4(model, tmp_path / "mx")

    config = json.loads((out / "config.json").read_text())
    qc = config["quantization_config"]
    assert (qc["quant_method"], qc["format"], qc["quantization_status"]) == (
        "compressed-tensors",
        "mxfp4-pack-quantized",
        "compressed",
    )
    weights = qc["config_groups"]["group_0"]["weights"]
    assert (weights["num_bits"], weights["type"], weights["group_size"], weights["scale_dtype"]) == (
        4,
        "float",
        32,
        "torch.uint8",
    )
    assert config["architectures"] == ["KimiK3ForConditionalGeneration"]
    assert config["text_config"]["model_type"] == "kimi_linear" and config["posttrain_qat"]["scheme"] == "k3"

    tensors = load_file(out / "model.safetensors")
    for module in EXPERTS:
        assert f"{SAVED}{module}.w1" not in tensors
        for e in range(8):
            for w, (rows, cols) in {"w1": (64, 32), "w3": (64, 32), "w2": (32, 64)}.items():
                packed, scale = (
                    tensors[f"{SAVED}{module}.{e}.{w}.weight_packed"],
                    tensors[f"{SAVED}{module}.{e}.{w}.weight_scale"],
                )
                assert packed.dtype == scale.dtype == torch.uint8
                assert packed.shape == (rows, cols // 2) and scale.shape == (rows, cols // 32)
    # Everything else is stored as it is in the model, in full precision.
    assert torch.equal(tensors[SAVED + "model.layers.1.block_sparse_moe.shared_experts.up_proj.weight"],
                       model.model.layers[1].block_sparse_moe.shared_experts.up_proj.weight)  # fmt: skip
    assert tensors[SAVED + "model.layers.3.self_attn.kv_b_proj.weight"].dtype == torch.float32

    loaded = load_exported(out).eval()
    assert not hasattr(loaded.config, "quantization_config")
    for name, module in routed_expert_modules(loaded).items():
        assert module.act_fake_quant is not None  # QAT re-applied from posttrain_qat
        original = routed_expert_modules(model)[name]
        for w in ("w1", "w2", "w3"):
            assert torch.equal(getattr(module, w), quantize_dequantize(getattr(original, w), "mxfp4"))
    assert torch.equal(loaded(token_ids).logits, expected)


@torch.no_grad()
def test_dequantized_export_is_a_plain_model_dir(tiny_model, token_ids, tmp_path):
    model = trained_like(tiny_model)
    apply_qat(model, QATConfig())
    expected = model(token_ids).logits

    fp32 = export_dequantized(model, tmp_path / "fp32", dtype=torch.float32)
    assert "quantization_config" not in json.loads((fp32 / "config.json").read_text())
    plain = AutoModelForCausalLM.from_pretrained(str(fp32), dtype=torch.float32).eval()
    assert restore_qat(plain) == EXPERTS
    assert torch.equal(plain(token_ids).logits, expected)

    bf16 = export_dequantized(model, tmp_path / "bf16")
    tensors = load_file(bf16 / "model.safetensors")
    assert all(
        t.dtype == torch.bfloat16 for name, t in tensors.items() if not name.endswith("correction_bias")
    )
    w2 = routed_expert_modules(model)[EXPERTS[0]].w2
    # bf16 holds every MXFP4 value exactly: the stored experts (one tensor per expert, the released
    # names) are the fake-quantised fp32 values.
    assert f"{SAVED}{EXPERTS[0]}.w2" not in tensors
    stored = torch.stack([tensors[f"{SAVED}{EXPERTS[0]}.{e}.w2.weight"] for e in range(8)])
    assert torch.equal(stored.float(), quantize_dequantize(w2, "mxfp4"))
    loaded = load_exported(bf16, dtype=torch.bfloat16)
    assert loaded.dtype == torch.bfloat16
    assert torch.equal(routed_expert_modules(loaded)[EXPERTS[0]].w2, stored)


@torch.no_grad()
def test_sharded_rceil_export_writes_tied_embeddings_untied(tiny_config, token_ids, tmp_path):
    tiny_config.tie_word_embeddings = True
    torch.manual_seed(0)
    model = KimiK3ForCausalLM(tiny_config).eval()
    cfg = QATConfig(weight_scale_rule="rceil")
    apply_qat(model, cfg)
    expected = model(token_ids).logits
    out = export_mxfp4(model, tmp_path / "mx", qat=cfg, max_shard_size="100KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    # vLLM never ties lm_head: the head is written as its own tensor and the config says untied.
    assert SAVED + "lm_head.weight" in index["weight_map"]
    assert json.loads((out / "config.json").read_text())["text_config"]["tie_word_embeddings"] is False
    loaded = load_exported(out).eval()
    assert not loaded.config.tie_word_embeddings
    assert torch.equal(loaded.lm_head.weight, model.model.embed_tokens.weight)
    assert qat_config_of(loaded.config) == cfg
    assert torch.equal(loaded(token_ids).logits, expected)


@torch.no_grad()
def test_save_pretrained_records_qat_for_whoever_loads_it(tiny_model, token_ids, tmp_path):
    cfg = QATConfig(activation_scale_rule="floor")
    apply_qat(tiny_model, cfg)
    expected = tiny_model(token_ids).logits
    tiny_model.save_pretrained(tmp_path / "model")
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "model"), dtype=torch.float32).eval()
    assert qat_config_of(loaded.config) == cfg
    assert routed_expert_modules(loaded)[EXPERTS[0]].act_fake_quant is None  # from_pretrained alone: off
    restore_qat(loaded)
    assert torch.equal(loaded(token_ids).logits, expected)  # the master weights, quantised the same way


def test_incomplete_packed_experts_are_named(tiny_model, tmp_path):
    out = export_mxfp4(tiny_model, tmp_path / "mx")
    tensors = load_file(out / "model.safetensors")
    del tensors[SAVED + "model.layers.2.block_sparse_moe.experts.5.w3.weight_scale"]
    save_file(tensors, out / "model.safetensors")
    with pytest.raises(
        ValueError, match=r"layers\.2\.block_sparse_moe\.experts\.\*\.w3: experts \[5\] lack a part"
    ):
        load_exported(out)
    with pytest.raises(ValueError, match="no routed-experts module"):
        export_mxfp4(torch.nn.Linear(32, 32), tmp_path / "linear")
