"""posttrain reads the released K3 checkpoint layout (docs/k3.md section 3), built here by hand from that
description and not with posttrain's exporter or MX packer: the wrapper config.json
(`KimiK3ForConditionalGeneration`, text keys under `text_config`, compressed-tensors MXFP4 at the
top level), `language_model.*` names, routed experts as `.weight_packed` uint8 [out, in/2] (even
element in the low nibble) + `.weight_scale` uint8 [out, in/32] (biased E8M0), everything else
bf16, two shards with an index, vision-tower tensors present or absent.

Loaded with `from_pretrained`, the routed-expert master weights are exactly the MXFP4 values, every
other weight is the stored one, and the logits equal the source model's with those experts (with
QAT on too: re-quantising an MXFP4 value gives itself). An `sft` stage runs from such a directory
(`model: <dir>`) and its output exports and loads again; old flat run dirs keep loading.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from interchange_stages import sft_body
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from posttrain.engines.testing import TINY_K3_PRESET, tiny_k3
from posttrain.model import KimiK3ForCausalLM
from posttrain.qat import QATConfig, apply_qat, routed_expert_modules

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
PROJECTIONS = ("w1", "w2", "w3")


def decode_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The spec's decoding, written out: code = sign bit 3 | magnitude index; byte = even element
    (low nibble) | odd element << 4; value = +-E2M1[index] * 2^(scale byte - 127)."""
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(packed.shape[0], -1).long()
    values = E2M1[codes & 0x7] * torch.where((codes & 0x8) != 0, -1.0, 1.0)
    return values * torch.pow(2.0, scale.float() - 127).repeat_interleave(32, dim=-1)


def released_config(model: KimiK3ForCausalLM) -> dict:
    """config.json as the release writes it, for this model's hyper-parameters."""
    import yaml

    text = yaml.safe_load(TINY_K3_PRESET.read_text())
    text["model_type"] = "kimi_linear"
    return {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        "text_config": text,
        "vision_config": {"model_type": "kimi_k3_vision", "patch_size": 14, "vt_hidden_size": 64,
                          "vt_num_hidden_layers": 2, "vt_num_attention_heads": 2, "text_hidden_size": 64},
        "media_placeholder_token_id": 5,
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "format": "mxfp4-pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {"group_0": {
                "targets": ["Linear"], "format": "mxfp4-pack-quantized",
                "weights": {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 32,
                            "strategy": "group", "scale_dtype": "torch.uint8"},
                "input_activations": None, "output_activations": None}},
            "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj.*",
                       "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"],
        },
    }  # fmt: skip


def build_released_dir(directory: Path, *, vision: bool, seed: int = 0) -> KimiK3ForCausalLM:
    """Write a released-layout tiny K3 to `directory`; returns the source model (eval mode) whose
    routed experts hold the MXFP4 values and whose other weights are bf16-rounded."""
    generator = torch.Generator().manual_seed(seed)
    source = tiny_k3(seed).eval()
    tensors: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for tensor in source.state_dict().values():
            tensor.copy_(tensor.to(torch.bfloat16).float())  # the release stores bf16
        for module_name, experts in routed_expert_modules(source).items():
            for w in PROJECTIONS:
                weight = getattr(experts, w)
                for e in range(weight.shape[0]):
                    rows, cols = weight.shape[1:]
                    byte = {"dtype": torch.uint8, "generator": generator}
                    packed = torch.randint(0, 256, (rows, cols // 2), **byte)
                    scale = torch.randint(119, 125, (rows, cols // 32), **byte)  # 2^-8 .. 2^-3
                    weight[e] = decode_mxfp4(packed, scale)
                    stem = f"language_model.{module_name}.{e}.{w}"
                    tensors[f"{stem}.weight_packed"], tensors[f"{stem}.weight_scale"] = packed, scale
    expert_params = {f"{m}.{w}" for m in routed_expert_modules(source) for w in PROJECTIONS}
    for name, tensor in source.state_dict().items():
        if name not in expert_params:
            stored = tensor if name.endswith("e_score_correction_bias") else tensor.to(torch.bfloat16)
            tensors[f"language_model.{name}"] = stored.contiguous()
    if vision:
        tensors["vision_tower.patch_embed.proj.weight"] = torch.randn(64, 3, 14, 14).to(torch.bfloat16)
        tensors["mm_projector.proj.0.weight"] = torch.randn(64, 256).to(torch.bfloat16)
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    directory.mkdir(parents=True)
    for file, shard in shards.items():
        save_file({n: tensors[n] for n in shard}, str(directory / file), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {n: f for f, shard in shards.items() for n in shard}}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    (directory / "config.json").write_text(json.dumps(released_config(source)))
    return source


def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


IDS = torch.randint(3, 2048, (2, 11), generator=torch.Generator().manual_seed(4))


@pytest.mark.parametrize("vision", [True, False], ids=["with-vision", "text-only"])
def test_a_hand_built_released_dir_loads_exactly(tmp_path, vision):
    source = build_released_dir(tmp_path / "k3", vision=vision)
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "k3"), dtype=torch.float32).eval()
    assert isinstance(loaded, KimiK3ForCausalLM)
    assert getattr(loaded.config, "quantization_config", None) is None  # dequantised on load
    expected = source.state_dict()
    got = loaded.state_dict()
    assert got.keys() == expected.keys()
    different = [name for name in expected if not torch.equal(got[name], expected[name])]
    assert different == []  # the routed experts are exactly the MXFP4 values, the rest as stored
    assert torch.equal(logits(loaded, IDS), logits(source, IDS))
    # save_pretrained writes the experts back in full precision, never re-packed
    loaded.save_pretrained(str(tmp_path / "resaved"))
    resaved = load_file(str(tmp_path / "resaved" / "model.safetensors"))
    assert not any(name.endswith(("weight_packed", "weight_scale")) for name in resaved)
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "resaved"), dtype=torch.float32).eval()
    assert torch.equal(logits(reloaded, IDS), logits(source, IDS))
    # QAT continues from the MXFP4 values: fake-quantising them returns them unchanged
    apply_qat(loaded, QATConfig())
    apply_qat(source, QATConfig())
    assert torch.equal(logits(loaded, IDS), logits(source, IDS))
    assert loaded.config.vision_config["vt_hidden_size"] == 64  # the vision header is kept


def test_released_dir_errors_name_the_problem(tmp_path):
    build_released_dir(tmp_path / "k3", vision=False)
    config = json.loads((tmp_path / "k3" / "config.json").read_text())
    config["quantization_config"]["format"] = "nvfp4-pack-quantized"
    (tmp_path / "k3" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="format 'nvfp4-pack-quantized'.*mxfp4-pack-quantized"):
        AutoModelForCausalLM.from_pretrained(str(tmp_path / "k3"))

    build_released_dir(tmp_path / "missing", vision=False)
    shard = tmp_path / "missing" / "model-00001-of-00002.safetensors"
    tensors = load_file(str(shard))
    dropped = next(n for n in tensors if n.endswith("q_proj.weight"))
    del tensors[dropped]
    save_file(tensors, str(shard))
    with pytest.raises(
        ValueError, match=f"index.json places {dropped} in {shard.name}, which does not hold it"
    ):
        AutoModelForCausalLM.from_pretrained(str(tmp_path / "missing"))
    index_file = tmp_path / "missing" / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    del index["weight_map"][dropped]  # the index agrees: the weight is simply not there
    index_file.write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"missing \['" + dropped.removeprefix("language_model.")):
        AutoModelForCausalLM.from_pretrained(str(tmp_path / "missing"))


def test_old_flat_dirs_and_the_engines_load_both_layouts(tmp_path, renderer):
    from posttrain.engines import EmbeddedEngine
    from posttrain.engines.testing import prompt_sample, reference_logprobs
    from posttrain.model import save_released

    model = tiny_k3(2).eval()
    model.save_pretrained(str(tmp_path / "flat"))  # what run dirs hold from before the released layout
    save_released(model, tmp_path / "released", tokenizer=renderer.tokenizer)
    tokens = IDS[0].tolist()
    for layout in ("flat", "released"):
        loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / layout), dtype=torch.float32).eval()
        assert torch.equal(logits(loaded, IDS), logits(model, IDS)), layout
        engine = EmbeddedEngine.from_pretrained(tmp_path / layout)  # the engine teachers run in
        scores = engine.score([prompt_sample("p", tokens)])[0]
        torch.testing.assert_close(torch.tensor(scores), reference_logprobs(model, tokens), rtol=0, atol=1e-5)


def test_equal_weights_read_from_two_dirs_publish_equal_config_bytes(tmp_path):
    # A stage's model is read from its init's directory (the base, the SFT stage's output) and
    # written with save_released; the manifest hashes the written files, and a release must not
    # name the machine it was made on, so no config may carry the directory it was read from.
    from posttrain.model import save_released

    tiny_k3(3).save_pretrained(str(tmp_path / "a"))
    build_released_dir(tmp_path / "b", vision=True)  # a release's header: vision_config and all
    for source in ("a", "b"):
        (tmp_path / f"{source}-copy").symlink_to(tmp_path / source, target_is_directory=True)
        written = []
        for read_from in (source, f"{source}-copy"):
            model = AutoModelForCausalLM.from_pretrained(str(tmp_path / read_from), dtype=torch.float32)
            save_released(model, tmp_path / f"{read_from}-out")
            written.append((tmp_path / f"{read_from}-out" / "config.json").read_text())
        assert written[0] == written[1], source
        assert "_name_or_path" not in written[0] and str(tmp_path) not in written[0], source


def test_an_sft_stage_runs_from_a_released_dir_and_its_output_exports_and_loads(
    tmp_path, sft_recipe, stage_runner, posttrain
):
    from posttrain.qat import qat_config_of, quantize_dequantize
    from posttrain.qat.export import load_exported

    build_released_dir(tmp_path / "k3", vision=True)
    ctx = stage_runner.context("sft", tmp_path / "run", sft_body(sft_recipe, steps=2), model=tmp_path / "k3")
    final = stage_runner.run(ctx)
    assert final["eval_loss_after"] < final["eval_loss_before"]
    trained = AutoModelForCausalLM.from_pretrained(str(ctx.output_dir), dtype=torch.float32)
    assert json.loads((ctx.output_dir / "config.json").read_text())["vision_config"]["vt_hidden_size"] == 64
    for fmt in ("mxfp4", "bf16"):
        code, _, err = posttrain("export", ctx.output_dir, "--format", fmt, "--out", tmp_path / fmt)
        assert code == 0, err
        served = load_exported(tmp_path / fmt)
        rule = qat_config_of(trained.config).weight_scale_rule
        for name, experts in routed_expert_modules(trained).items():
            for w in PROJECTIONS:
                expected = quantize_dequantize(getattr(experts, w).detach(), "mxfp4", scale_rule=rule)
                assert torch.equal(getattr(routed_expert_modules(served)[name], w), expected), (fmt, name, w)
