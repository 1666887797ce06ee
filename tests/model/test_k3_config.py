"""KimiK3Config: released key names, shipped YAMLs, and errors that name the key and the fix."""

from __future__ import annotations

import copy
import inspect
import json

import pytest
import yaml

from posttrain.model import KimiK3Config, load_model_config


@pytest.fixture
def tiny_dict(tiny_yaml) -> dict:
    return yaml.safe_load(tiny_yaml.read_text())


def with_changes(data: dict, **changes) -> dict:
    data = copy.deepcopy(data)
    for key, value in changes.items():
        if key in data["linear_attn_config"] and key not in data:
            data["linear_attn_config"][key] = value
        else:
            data[key] = value
    return data


def test_tiny_yaml_is_the_contract(tiny_config: KimiK3Config) -> None:
    c = tiny_config
    assert (c.vocab_size, c.hidden_size, c.num_hidden_layers) == (2048, 64, 4)
    assert c.linear_attn_config["kda_layers"] == [1, 2, 3]
    assert c.linear_attn_config["full_attn_layers"] == [4]
    assert (c.linear_attn_config["num_heads"], c.linear_attn_config["head_dim"]) == (2, 32)
    assert (c.num_attention_heads, c.q_lora_rank, c.kv_lora_rank) == (2, 32, 32)
    assert (c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim) == (32, 16, 32)
    assert (c.first_k_dense_replace, c.intermediate_size) == (1, 128)
    assert (c.num_experts, c.num_experts_per_token, c.moe_intermediate_size) == (8, 2, 64)
    assert (c.routed_expert_hidden_size, c.num_shared_experts, c.attn_res_block_size) == (32, 1, 2)
    assert c.model_type == "kimi_k3"
    assert [c.is_kda_layer(i) for i in range(4)] == [True, True, True, False]
    assert [c.is_moe_layer(i) for i in range(4)] == [False, True, True, True]


def test_full_yaml_is_the_released_layout(full_config: KimiK3Config) -> None:
    c = full_config
    kinds = [c.is_kda_layer(i) for i in range(c.num_hidden_layers)]
    assert kinds.count(True) == 69 and kinds.count(False) == 24
    assert not kinds[91] and not kinds[92]  # layers 92 and 93 (1-based) are both MLA
    assert (c.num_experts, c.num_experts_per_token, c.attn_res_block_size) == (896, 16, 12)
    # the class defaults are the released model too
    assert KimiK3Config().to_dict()["linear_attn_config"] == c.linear_attn_config


def test_released_multimodal_json_reads_its_text_config(tmp_path, tiny_dict: dict) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "kimi_k3", "text_config": tiny_dict, "vision_config": {}}))
    assert load_model_config(path).hidden_size == 64


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"kda_layers": [1, 2, 3, 4]}, r"layers \[4\] are in both kda_layers and full_attn_layers"),
        ({"kda_layers": [1, 2]}, r"layers \[3\] are in neither kda_layers nor full_attn_layers"),
        ({"full_attn_layers": [4, 5]}, r"full_attn_layers has \[5\] outside 1\.\.4"),
        ({"kda_layers": [0, 1, 2, 3]}, r"kda_layers has \[0\] outside 1\.\.4 \(indices are 1-based"),
        ({"num_experts_per_token": 9}, r"num_experts_per_token=9 > num_experts=8"),
        ({"routed_expert_hidden_size": 48}, r"routed_expert_hidden_size=48 does not divide hidden_size=64"),
        ({"hidden_act": "gelu"}, r"hidden_act='gelu': use one of"),
        ({"gate_lower_bound": -8.0}, r"linear_attn_config.gate_lower_bound=-8.0: must be in \[-5.0, 0\)"),
        ({"num_expert_group": 3}, r"num_expert_group=3 does not divide num_experts=8"),
        ({"mla_use_nope": False}, r"mla_use_nope=false: rotary MLA is not implemented"),
        ({"topk_method": "greedy"}, r"topk_method='greedy'"),
        # wrong types: a quoted number, a null size, a bool where a number belongs (Python's int)
        ({"hidden_size": "64"}, r"hidden_size='64' is a str; it must be int \(a number, without quotes\)"),
        ({"num_hidden_layers": None}, r"num_hidden_layers=None is a NoneType; it must be int"),
        ({"rms_norm_eps": "1e-5"}, r"rms_norm_eps='1e-5' is a str; it must be float"),
        ({"num_experts": True}, r"num_experts=True is a bool; it must be int or None"),
        ({"linear_attn_config": [1, 2]}, r"linear_attn_config=\[1, 2\] is a list; it must be dict"),
    ],
)
def test_bad_config_names_key_and_fix(tmp_path, tiny_dict: dict, changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KimiK3Config(**with_changes(tiny_dict, **changes))
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(with_changes(tiny_dict, **changes)))
    with pytest.raises(ValueError, match=f"model config {path}: .*" + message):
        load_model_config(path)


def test_yaml_unknown_key_suggests_nearest(tmp_path, tiny_dict: dict) -> None:
    data = tiny_dict
    data["num_expert"] = data.pop("num_experts")
    path = tmp_path / "typo.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError, match=r"unknown key 'num_expert' \(did you mean 'num_experts'\?\)"):
        load_model_config(path)


def test_missing_file_and_bad_extension(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model_config(tmp_path / "nope.yaml")
    (tmp_path / "c.toml").write_text("x = 1")
    with pytest.raises(ValueError, match=r"use a \.yaml, \.yml or \.json file"):
        load_model_config(tmp_path / "c.toml")


def test_key_names_are_vllms(vllm_config_keys: set[str]) -> None:
    ours = set(inspect.signature(KimiK3Config.__init__).parameters) - {"self", "kwargs"}
    theirs = vllm_config_keys
    assert ours <= theirs, f"not a released key: {sorted(ours - theirs)}"
    # what we do not take: the model_type switch and rotary settings (K3's MLA uses no rotation)
    assert theirs - ours == {"model_type", "rope_parameters"}
