"""A damaged K3 checkpoint directory (a shard lost or cut short, an index that disagrees with its
shards, tensors of the wrong dtype, uneven routed experts, a config.json that disagrees with the
weights) is refused before anything loads, with a ValueError naming the file, the tensor and the
fix: what a stage's `model:` and `posttrain export` see, instead of safetensors' `header too small`
naming no file, a weight silently cast or left at random init, or the full-size K3 default built
(tens of GB) from a config.json that lost a key."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from posttrain.engines.testing import tiny_k3
from posttrain.model import save_released
from posttrain.model.vision_model import load_pretrained
from posttrain.qat.export import export_mxfp4

INDEX = "model.safetensors.index.json"
RECOPY = "copy or export the checkpoint again"
EXPERT_W1 = "language_model.model.layers.1.block_sparse_moe.experts.{}.w1.weight"


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """sharded/ (bf16, several shards and an index), single/ (one model.safetensors), mxfp4/
    (packed experts, one file) of one tiny K3."""
    root = tmp_path_factory.mktemp("clean")
    model = tiny_k3(0)
    save_released(model, root / "sharded", dtype=torch.bfloat16, max_shard_size="200KB")
    save_released(model, root / "single", dtype=torch.bfloat16)
    export_mxfp4(model, root / "mxfp4", dtype=torch.bfloat16)
    return root


def copy(clean: Path, tmp_path: Path, layout: str) -> Path:
    return Path(shutil.copytree(clean / layout, tmp_path / layout))


def edit_json(path: Path, edit: Callable[[dict], object]) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def edit_tensors(path: Path, edit: Callable[[dict[str, torch.Tensor]], object]) -> None:
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


def first_shard(directory: Path) -> Path:
    return directory / sorted(json.loads((directory / INDEX).read_text())["weight_map"].values())[0]


def lose_shard(d: Path) -> str:
    shard = first_shard(d)
    shard.unlink()
    return f"{INDEX} names {shard.name}, which is not in {d}: {RECOPY}"


def cut_shard_short(d: Path) -> str:
    shard = first_shard(d)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    return f"{shard} is not a readable safetensors file .*: {RECOPY}"


def overwrite_shard(d: Path) -> str:
    shard = first_shard(d)
    shard.write_bytes(b"<html>rate limited</html>")
    return f"{shard} is not a readable safetensors file .*: {RECOPY}"


def move_tensor_in_index(d: Path) -> str:
    name = "language_model.model.norm.weight"
    elsewhere = first_shard(d).name
    edit_json(d / INDEX, lambda index: index["weight_map"].update({name: elsewhere}))
    return f"{INDEX} places {name} in {elsewhere}, which does not hold it: {RECOPY}"


def break_index_json(d: Path) -> str:
    (d / INDEX).write_text('{"weight_map": ')
    return f"{INDEX} is not valid JSON .*: {RECOPY}"


def drop_weight_map(d: Path) -> str:
    (d / INDEX).write_text('{"metadata": {}}')
    return f"{INDEX} has no `weight_map`"


def remove_all_weights(d: Path) -> str:
    for shard in d.glob("*.safetensors*"):
        shard.unlink()
    return f"{d} holds no weights"


@pytest.mark.parametrize(
    "damage",
    [
        lose_shard,
        cut_shard_short,
        overwrite_shard,
        move_tensor_in_index,
        break_index_json,
        drop_weight_map,
        remove_all_weights,
    ],
)
def test_damaged_weight_files_are_named_before_loading(clean, tmp_path, damage):
    directory = copy(clean, tmp_path, "sharded")
    expected = damage(directory)
    with pytest.raises(ValueError, match=expected):
        load_pretrained(directory)  # how a stage loads its `model:` directory


def cast_norm_to_int(d: Path) -> str:
    name = "language_model.model.norm.weight"
    edit_tensors(d / "model.safetensors", lambda t: t.update({name: t[name].to(torch.int32)}))
    return f"{d / 'model.safetensors'}: {name} is I32; a K3 weight is F32, BF16 or F16"


def store_scales_as_float(d: Path) -> str:
    name = EXPERT_W1.format(0) + "_scale"
    edit_tensors(d / "model.safetensors", lambda t: t.update({name: t[name].float()}))
    return f"{name} is F32; MXFP4 bytes are stored as U8"


def drop_an_expert(d: Path) -> str:
    edit_tensors(d / "model.safetensors", lambda t: t.pop(EXPERT_W1.format(3)))
    return r"experts\.\*\.w1: experts \[3\] are absent \(7 stored"


def cut_an_expert(d: Path) -> str:
    name = EXPERT_W1.format(2)
    edit_tensors(d / "model.safetensors", lambda t: t.update({name: t[name][:-1].clone()}))
    return f"{name} has shape \\[63, 32\\], {EXPERT_W1.format(0)} \\[64, 32\\]"


def store_an_expert_twice(d: Path) -> str:
    name = EXPERT_W1.format(1)
    edit_tensors(d / "model.safetensors", lambda t: t.update({name: torch.zeros(64, 32)}))
    return r"experts\.\*\.w1 are stored both plain \(\.weight\) and packed"


@pytest.mark.parametrize(
    ("layout", "damage"),
    [
        ("single", cast_norm_to_int),
        ("mxfp4", store_scales_as_float),
        ("single", drop_an_expert),
        ("single", cut_an_expert),
        ("mxfp4", store_an_expert_twice),
    ],
)
def test_tensors_that_cannot_be_a_k3_are_named(clean, tmp_path, layout, damage):
    # Before: the int tensor was cast into the float weight without a word, and uneven experts
    # failed inside transformers' conversion as a RuntimeError pointing at a logged report.
    directory = copy(clean, tmp_path, layout)
    expected = damage(directory)
    with pytest.raises(ValueError, match=expected):
        load_pretrained(directory)


def test_a_config_that_disagrees_with_the_weights_is_named(clean, tmp_path):
    directory = copy(clean, tmp_path, "single")
    # A config.json that lost hidden_size builds the full-size default (7168 wide): refused from
    # the headers, before that model is built.
    edit_json(directory / "config.json", lambda c: c["text_config"].pop("hidden_size"))
    built = r"embed_tokens.weight is \[2048, 64\], config.json builds \[2048, 7168\]"
    with pytest.raises(ValueError, match=built):
        load_pretrained(directory)
    edit_json(directory / "config.json", lambda c: c["text_config"].update(hidden_size=64, num_experts=4))
    stored = r"shapes stored \['model.layers.1.block_sparse_moe.experts.w1 \[8, 64, 32\] \(config.json: \[4"
    with pytest.raises(ValueError, match=stored):
        load_pretrained(directory)
    edit_json(directory / "config.json", lambda c: c["text_config"].update(hidden_size="64", num_experts=8))
    with pytest.raises(ValueError, match=r"config.json: hidden_size='64' is a str; it must be int"):
        load_pretrained(directory)


def test_export_of_a_damaged_dir_exits_2_and_writes_nothing(clean, tmp_path, posttrain):
    # Before: safetensors' error escaped export's handler as a traceback naming no file.
    directory = copy(clean, tmp_path, "sharded")
    shard = first_shard(directory)
    cut_shard_short(directory)
    code, _, err = posttrain("export", directory, "--format", "bf16", "--out", tmp_path / "out")
    message = " ".join(err.split())
    assert code == 2 and "Traceback" not in err, err
    expected = f"posttrain export: {directory}: cannot load the model: {shard} is not a readable safetensors"
    assert message.startswith(expected)
    assert not (tmp_path / "out").exists()
