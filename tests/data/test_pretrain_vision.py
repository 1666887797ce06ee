"""The vision pre-alignment (data_recipes/pretrain_vision.py) and the tower it ships
(data_recipes/vision_base/): scenes are what draw() drew, a run is repeatable to the byte, the
shipped tower and projector are what the vision SFT stage starts from, and they see (their
features tell drawn scenes apart where a fresh tower's do not)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from data_recipes import pretrain_vision
from data_recipes.agent_tasks.visual import KINDS, draw, draw_scene
from posttrain.data.chat import ChatRenderer, load_tokenizer
from posttrain.model.vision_model import (
    VISION_WEIGHTS_FILE,
    KimiK3ForConditionalGeneration,
    load_vision_dir,
)
from posttrain.trainers.common import load_policy
from posttrain.trainers.sft import vision_preset

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "data_recipes" / "vision_base"
BASE = REPO / "data_recipes" / "base"
BODY = {"train": {"steps": 1}, "vision": "../data_recipes/vision_base"}


@pytest.mark.parametrize("seed", range(12))
def test_a_scene_is_what_draw_drew(seed):
    for kind in KINDS:
        image, facts, scene = draw_scene(kind, seed)
        again, same = draw(kind, seed)
        assert image.tobytes() == again.tobytes() and facts == same
        if kind == "count":
            assert scene[facts["shape"]] == facts["count"] and set(scene) == {"circle", "square"}
        elif kind == "bar":
            heights = scene["heights"]
            assert len(heights) == facts["bars"] and heights.index(max(heights)) + 1 == facts["tallest"]
        else:
            assert scene == {"digit": facts["digit"]}


def test_pretraining_is_repeatable_to_the_byte_and_writes_a_vision_dir(tmp_path):
    torch.set_num_threads(1)
    outs = []
    for name in ("a", "b"):
        model, config, log = pretrain_vision.train(steps=3, batch=4, lr=2e-3, seed=0, log_every=3)
        pretrain_vision.save(model, config, log, {"steps": 3}, tmp_path / name)
        outs.append(tmp_path / name)
    assert (outs[0] / VISION_WEIGHTS_FILE).read_bytes() == (outs[1] / VISION_WEIGHTS_FILE).read_bytes()
    config, weights = load_vision_dir(outs[0], text_hidden_size=128)
    assert config.vt_hidden_size == 32 and all(
        n.startswith(("vision_tower.", "mm_projector.")) for n in weights
    )
    with pytest.raises(ValueError, match="width 128"):
        load_vision_dir(outs[0], text_hidden_size=64)


def test_the_vision_sft_stage_starts_from_the_shipped_tower(stage_runner, tmp_path):
    # the stage file's `vision:` (tests/trainers/test_vision_stage_files.py reads it) resolves here
    assert vision_preset("../data_recipes/vision_base") == SHIPPED.resolve()
    tokenizer = load_tokenizer(BASE, media=True)
    ctx = stage_runner.context("sft", tmp_path, BODY, model=BASE)
    policy = load_policy(
        ctx,
        len(tokenizer),
        vision=SHIPPED,
        media_pad_id=ChatRenderer(tokenizer).media_token_ids["media_pad"],
    )
    assert isinstance(policy.model, KimiK3ForConditionalGeneration)
    shipped = load_file(str(SHIPPED / VISION_WEIGHTS_FILE))
    own = policy.model.state_dict()
    assert len(shipped) == 18 and all(torch.equal(own[n], t) for n, t in shipped.items())


def _centroid_accuracy(model: KimiK3ForConditionalGeneration) -> float:
    """Nearest-class-mean accuracy of which bar is tallest from the mean visual token, 150 charts
    to fit the means and 150 others to classify."""
    from posttrain.model.vision_model import image_processor

    processor = image_processor(model.config)

    def features(seeds: range) -> tuple[torch.Tensor, torch.Tensor]:
        drawn = [draw("bar", seed) for seed in seeds]
        batch = processor([image for image, _ in drawn])
        with torch.no_grad():
            tokens = model.media_embeddings(batch.pixel_values, batch.grid_thws)
        pooled = tokens.view(len(drawn), -1, tokens.shape[-1]).mean(1)
        return pooled, torch.tensor([facts["tallest"] for _, facts in drawn])

    fit_x, fit_y = features(range(150))
    test_x, test_y = features(range(1000, 1150))
    means = torch.stack([fit_x[fit_y == label].mean(0) for label in range(1, 6)])
    guess = torch.cdist(test_x, means).argmin(1) + 1
    return float((guess == test_y).float().mean())


def test_the_shipped_tower_sees_what_a_fresh_one_does_not(stage_runner, tmp_path):
    tokenizer = load_tokenizer(BASE, media=True)
    pad = ChatRenderer(tokenizer).media_token_ids["media_pad"]
    ctx = stage_runner.context("sft", tmp_path, BODY, model=BASE)
    fresh = load_policy(
        ctx, len(tokenizer), vision=REPO / "stages" / "models" / "vision-tiny.yaml", media_pad_id=pad
    )
    shipped = load_policy(ctx, len(tokenizer), vision=SHIPPED, media_pad_id=pad)
    assert _centroid_accuracy(shipped.model.eval()) >= 0.9
    assert _centroid_accuracy(fresh.model.eval()) < 0.6


def test_other_arguments_do_not_overwrite_the_shipped_tower(tmp_path, monkeypatch, capsys):
    # Before: --out defaults to the shipped tower, which a trial with --steps 2 replaced.
    shipped = tmp_path / "vision_base"
    shipped.mkdir()
    made_by = {"steps": 4000, "batch": 32, "lr": 0.002, "seed": 0, "log_every": 500}
    (shipped / pretrain_vision.LOG_FILE).write_text(json.dumps({"args": made_by}))
    monkeypatch.setattr(pretrain_vision, "OUTPUT", shipped)
    monkeypatch.setattr(sys, "argv", ["pretrain_vision", "--steps", "2"])
    with pytest.raises(SystemExit) as exit_:
        pretrain_vision.main()
    error = capsys.readouterr().err
    assert (
        exit_.value.code == 2
        and f"--steps 2 would overwrite the shipped {shipped}, made by --steps 4000" in error
    )
    assert [p.name for p in shipped.iterdir()] == [pretrain_vision.LOG_FILE]
    started = []  # the documented command, the defaults, is the one that made it: let through
    monkeypatch.setattr(sys, "argv", ["pretrain_vision"])
    monkeypatch.setattr(pretrain_vision, "train", lambda *a: started.append(a) or (None, None, {}))
    monkeypatch.setattr(pretrain_vision, "save", lambda *a: None)
    pretrain_vision.main()
    assert started == [(4000, 32, 0.002, 0, 500)]
