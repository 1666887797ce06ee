"""Weight-sync names for vLLM engines (`vllm_weight_name`): the K3 wrapper's `language_model.` prefix
is added (flat `model.*` names from a policy built in memory) or kept (names of a model read from a
released directory), removed for vLLM's text-only K3 class, and any other architecture's names
pass unchanged. The wrapper case runs through vLLM's own loader in test_vllm_loader.py."""

from __future__ import annotations

from posttrain.engines.vllm_engine import architectures_of, vllm_weight_name

WRAPPER = ["KimiK3ForConditionalGeneration"]


def test_names_follow_the_engines_architecture(tmp_path):
    flat = "model.layers.1.block_sparse_moe.experts.3.w1.weight"
    released = "language_model." + flat
    assert vllm_weight_name(flat, WRAPPER) == released
    assert vllm_weight_name(released, WRAPPER) == released
    assert vllm_weight_name("lm_head.weight", WRAPPER) == "language_model.lm_head.weight"
    assert (
        vllm_weight_name("vision_tower.patch_embed.proj.weight", WRAPPER)
        == "vision_tower.patch_embed.proj.weight"
    )
    assert vllm_weight_name(released, ["KimiLinearForCausalLM"]) == flat
    assert vllm_weight_name(
        "language_model.model.embed_tokens.weight", ["LlavaForConditionalGeneration"]
    ) == ("language_model.model.embed_tokens.weight")
    (tmp_path / "config.json").write_text('{"architectures": ["KimiK3ForConditionalGeneration"]}')
    assert architectures_of(tmp_path) == WRAPPER and architectures_of(tmp_path / "absent") == []
