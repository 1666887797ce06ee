"""KimiK3ForConditionalGeneration: visual tokens replace the `<|media_pad|>` runs and never carry
a loss, the HF save/load round trip in the released layout, and QAT leaving the vision side alone."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from vision_fixtures import MEDIA_PAD_ID, tiny_vl_config, tiny_vl_model

from posttrain.data.chat import ChatRenderer, load_tokenizer
from posttrain.data.images import MoonViTImageProcessor
from posttrain.model.modeling_kimi_k3 import KimiK3ForCausalLM
from posttrain.model.vision_model import KimiK3ForConditionalGeneration, with_vision
from posttrain.qat.apply import apply_qat, routed_expert_modules


@pytest.fixture(scope="module")
def media_renderer() -> ChatRenderer:
    return ChatRenderer(load_tokenizer(media=True))


def _images(seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    image = Image.fromarray(rng.integers(0, 256, (50, 90, 3), dtype=np.uint8))
    frames = [Image.fromarray(rng.integers(0, 256, (30, 40, 3), dtype=np.uint8)) for _ in range(5)]
    return [image, frames]


def _conversation() -> list[dict]:
    return [
        {"role": "system", "content": "Count what you see."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "How many squares here "},
                {"type": "image"},
                {"type": "text", "text": " and in this clip "},
                {"type": "video"},
                {"type": "text", "text": "?"},
            ],
        },
        {"role": "assistant", "reasoning_content": "three and two", "content": "5"},
    ]


def _batch(model: KimiK3ForConditionalGeneration, renderer: ChatRenderer):
    media = _images()
    processor = MoonViTImageProcessor.from_vision_config(model.config.vision_config)
    batch = processor(media)
    ids, mask = renderer.render(_conversation(), media=processor.blocks(media))
    return torch.tensor([ids]), torch.tensor([mask]), batch


def test_the_tokenizer_media_pad_is_the_config_placeholder(media_renderer):
    assert media_renderer.media_token_ids["media_pad"] == MEDIA_PAD_ID
    assert len(media_renderer.tokenizer) == tiny_vl_model().config.text_config.vocab_size


def test_image_tokens_are_masked_from_the_loss_and_feed_the_text(media_renderer):
    model = tiny_vl_model(seed=4)
    ids, mask, batch = _batch(model, media_renderer)
    media = ids == MEDIA_PAD_ID
    assert int(media.sum()) == batch.num_tokens == 8 + 2 * 4
    assert not bool((mask.bool() & media).any())  # the renderer never trains on them
    # the model ignores labels at media positions even when the caller passes them
    labels = ids.clone()
    loss = model(ids, batch.pixel_values, batch.grid_thws, labels=labels).loss
    by_hand = labels.masked_fill(media, -100)
    loss_by_hand = model(ids, batch.pixel_values, batch.grid_thws, labels=by_hand).loss
    garbled = labels.masked_fill(media, 7)
    loss_garbled = model(ids, batch.pixel_values, batch.grid_thws, labels=garbled).loss
    assert torch.equal(loss, loss_by_hand) and torch.equal(loss, loss_garbled)
    # and the pixels reach the text: the loss depends on them, the tower gets gradients
    other = model(ids, batch.pixel_values.flip(0), batch.grid_thws, labels=labels).loss
    assert not torch.allclose(loss, other)
    loss.backward()
    assert model.vision_tower.encoder.blocks[0].wqkv.weight.grad.abs().sum() > 0
    assert model.mm_projector.proj[0].weight.grad.abs().sum() > 0


def test_a_padded_batch_takes_its_media_row_by_row(media_renderer):
    model = tiny_vl_model(seed=7).eval()
    processor = MoonViTImageProcessor.from_vision_config(model.config.vision_config)
    first, second = _images(1)[0], _images(2)[1]
    rows = []
    for media in ([first], [second]):
        messages = [{"role": "user", "content": [{"type": "text", "text": "Count."}, {"type": "image"}]}]
        if isinstance(media[0], list):
            messages[0]["content"][1] = {"type": "video"}
        rows.append(media_renderer.render_prompt(messages, media=processor.blocks(media)))
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])  # left padding
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    both = processor([first, second])
    with torch.no_grad():
        batched = model(ids, both.pixel_values, both.grid_thws, attention_mask=mask).logits
        for row, media in enumerate(([first], [second])):
            alone = processor(media)
            single = model(torch.tensor([rows[row]]), alone.pixel_values, alone.grid_thws).logits
            torch.testing.assert_close(
                batched[row, width - len(rows[row]) :], single[0], rtol=1e-4, atol=1e-4
            )


def test_media_counts_must_agree(media_renderer):
    model = tiny_vl_model()
    ids, _, batch = _batch(model, media_renderer)
    with pytest.raises(ValueError, match=re.escape("hold 16 <|media_pad|> tokens but the media give 12")):
        model(ids, batch.pixel_values[: 1 * 4 * 8 + 4 * 4 * 4], batch.grid_thws[:2])
    with pytest.raises(ValueError, match="but no pixel_values were given"):
        model(ids)


def test_save_load_round_trip_in_the_released_layout(tmp_path, media_renderer):
    model = tiny_vl_model(seed=5)
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "kimi_k3"
    assert config["architectures"] == ["KimiK3ForConditionalGeneration"]
    assert config["text_config"]["model_type"] == "kimi_linear"
    assert config["media_placeholder_token_id"] == MEDIA_PAD_ID
    vision = config["vision_config"]
    assert (vision["vt_num_hidden_layers"], vision["merge_kernel_size"], vision["text_hidden_size"]) == (
        2,
        [2, 2],
        64,
    )
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert "mm_projector.proj.0.weight" in names and "mm_projector.post_norm.weight" in names
    assert "vision_tower.encoder.blocks.1.wqkv.weight" in names
    assert "language_model.model.layers.1.block_sparse_moe.experts.7.w2.weight" in names
    assert "language_model.lm_head.weight" in names and "language_model.model.embed_tokens.weight" in names
    assert not any(n.startswith(("model.", "lm_head")) for n in names)

    loaded = KimiK3ForConditionalGeneration.from_pretrained(tmp_path)
    before, after = model.state_dict(), loaded.state_dict()
    assert before.keys() == after.keys()
    for key in before:
        assert torch.equal(before[key], after[key]), key
    ids, _, batch = _batch(model, media_renderer)
    with torch.no_grad():
        logits = model(ids, batch.pixel_values, batch.grid_thws).logits
        logits_loaded = loaded(ids, batch.pixel_values, batch.grid_thws).logits
    assert torch.equal(logits, logits_loaded)


def test_the_written_config_names_no_local_path(tmp_path):
    # A stage puts a text base read from disk under the tower (with_vision); equal weights read from
    # two places must publish equal config.json bytes (the manifest hashes them), so no sub-config
    # may carry the directory it was read from.
    tiny_vl_model(seed=5).language_model.save_pretrained(tmp_path / "a")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    vision = tiny_vl_config().vision_config
    for source in ("a", "b"):
        text = KimiK3ForCausalLM.from_pretrained(tmp_path / source)
        with_vision(text, vision, MEDIA_PAD_ID).save_pretrained(tmp_path / f"{source}2")
    written = (tmp_path / "a2" / "config.json").read_text()
    assert written == (tmp_path / "b2" / "config.json").read_text()
    assert "_name_or_path" not in written and str(tmp_path) not in written


def test_qat_hooks_touch_only_the_text_routed_experts(media_renderer):
    model = tiny_vl_model(seed=6)
    ids, _, batch = _batch(model, media_renderer)
    with torch.no_grad():
        visual = model.media_embeddings(batch.pixel_values, batch.grid_thws)
        logits = model(ids, batch.pixel_values, batch.grid_thws).logits
    vision_before = {
        k: v.clone() for k, v in model.state_dict().items() if not k.startswith("language_model.")
    }
    hooked = apply_qat(model, {"scheme": "k3"})
    assert hooked == sorted(routed_expert_modules(model)) and len(hooked) == 3
    assert all(name.startswith("language_model.model.layers.") for name in hooked)
    for name, module in model.named_modules():
        if name.startswith(("vision_tower", "mm_projector")):
            assert getattr(module, "weight_fake_quant", None) is None, name
            assert getattr(module, "act_fake_quant", None) is None, name
    with torch.no_grad():
        assert torch.equal(model.media_embeddings(batch.pixel_values, batch.grid_thws), visual)
        quantised = model(ids, batch.pixel_values, batch.grid_thws).logits
    assert not torch.equal(quantised, logits)  # QAT is on for the experts
    after = {k: v for k, v in model.state_dict().items() if not k.startswith("language_model.")}
    assert all(torch.equal(after[k], vision_before[k]) for k in vision_before)


def test_a_dir_loads_as_the_multimodal_model_only_when_its_tokenizer_can_feed_the_tower(tmp_path):
    from posttrain.data.chat import load_tokenizer
    from posttrain.engines.testing import tiny_k3
    from posttrain.model import KimiK3ForCausalLM, save_released
    from posttrain.model.vision_model import load_pretrained, save_multimodal, sees_images

    model = tiny_vl_model(seed=8)
    save_multimodal(model, tmp_path / "vl", tokenizer=load_tokenizer(media=True))
    model.save_pretrained(tmp_path / "vl-no-tokenizer")
    text = tiny_k3(0)
    save_released(text, tmp_path / "text", tokenizer=load_tokenizer())  # placeholder: the pad token
    assert [sees_images(tmp_path / d) for d in ("vl", "vl-no-tokenizer", "text")] == [True, False, False]
    loaded = load_pretrained(tmp_path / "vl")
    assert isinstance(loaded, KimiK3ForConditionalGeneration)
    assert all(torch.equal(p, dict(model.named_parameters())[n]) for n, p in loaded.named_parameters())
    assert type(load_pretrained(tmp_path / "text")) is KimiK3ForCausalLM


@pytest.mark.parametrize("prefix", ["vision_tower.", "language_model.model.layers.0."])
def test_a_multimodal_dir_missing_a_tensor_is_refused_by_name(tmp_path, prefix):
    # Before: KimiK3ForConditionalGeneration.from_pretrained only warned and left the tensor at
    # random init (the text model's strict loading was not its own).
    from posttrain.model.vision_model import load_pretrained, save_multimodal

    save_multimodal(tiny_vl_model(seed=8), tmp_path / "vl", tokenizer=load_tokenizer(media=True))
    weights = tmp_path / "vl" / "model.safetensors"
    tensors = load_file(str(weights))
    dropped = next(name for name in sorted(tensors) if name.startswith(prefix))
    del tensors[dropped]
    save_file(tensors, str(weights))
    refused = rf"does not match KimiK3ForConditionalGeneration .*missing \['{re.escape(dropped)}'\]"
    with pytest.raises(ValueError, match=refused):
        load_pretrained(tmp_path / "vl")


def test_a_llama_dir_missing_a_tensor_is_refused_by_name(tmp_path):
    # Before: load_pretrained (a stage's `model:`) took AutoModelForCausalLM's word for any model
    # but K3: a Llama-shaped directory missing a weight loaded with it at random init.
    from posttrain.engines.testing import build_tiny_llama
    from posttrain.model.vision_model import load_pretrained

    directory = build_tiny_llama(tmp_path / "llama", load_tokenizer())
    weights = directory / "model.safetensors"
    tensors = load_file(str(weights))
    del tensors["model.layers.0.mlp.down_proj.weight"]
    save_file(tensors, str(weights))
    refused = r"does not match LlamaForCausalLM .*missing \['model.layers.0.mlp.down_proj.weight'\]"
    with pytest.raises(ValueError, match=refused):
        load_pretrained(directory)


def test_a_dir_holding_nan_weights_is_refused_by_name(tmp_path):
    # Before: it loaded, and the stage trained from it until its first non-finite loss, whose
    # message (NonFiniteLossError) points at the learning rate.
    from posttrain.engines.testing import save_tiny_k3
    from posttrain.model.vision_model import load_pretrained

    directory = save_tiny_k3(tmp_path / "k3", load_tokenizer())
    weights = directory / "model.safetensors"
    tensors = load_file(str(weights))
    tensors["model.norm.weight"][3] = float("nan")
    save_file(tensors, str(weights))
    with pytest.raises(ValueError, match=r"1 weights hold NaN or inf values, e.g. \['model.norm.weight'\]"):
        load_pretrained(directory)
