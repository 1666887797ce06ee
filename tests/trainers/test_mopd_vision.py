"""MOPD with images: a multimodal teacher prefills the trajectory's visual tokens (its log-probs
with the image differ from those without it or with another image, and equal a direct forward of
the teacher on the same image), and a `mopd` stage on the general/visual questions trains a
multimodal student from multimodal teachers and writes a multimodal model."""

from __future__ import annotations

import copy
import logging
import math
from pathlib import Path

import pytest
import torch

import data_recipes  # noqa: F401  (registers the task families and teacher domains)
from posttrain.data.chat import load_tokenizer
from posttrain.engines.testing import tiny_vl_k3
from posttrain.envs.environments import EnvironmentConfig, make_environment
from posttrain.model.vision_model import KimiK3ForConditionalGeneration, load_pretrained, media_inputs
from posttrain.qat import QATConfig, restore_qat
from posttrain.trainers.common import renderer_for
from posttrain.trainers.mopd_teachers import Teacher, TeacherPool

FAMILIES = ["general/visual"]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(media=True)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, tokenizer) -> dict[str, Path]:
    """A multimodal student ("sft") and teacher (general, high), QAT k3 as the stages train them."""
    from posttrain.model.vision_model import save_multimodal

    root = tmp_path_factory.mktemp("mopd-vision-models")
    out = {}
    for name, seed in (("sft", 0), ("rl-general-high", 1)):
        model = tiny_vl_k3(seed, qat=QATConfig(scheme="k3"), init_scale=4.0)
        out[name] = save_multimodal(model, root / name, tokenizer=tokenizer)
    return out


def visual_samples(renderer, tmp_path: Path, count: int):
    config = EnvironmentConfig(families=FAMILIES)
    with make_environment("general", renderer, config, sandbox_dir=tmp_path) as env:
        prompts = env.prompts("train", count, seed=1)
        samples = [env.start(p, uid=f"s{i}", group=p.uid, effort="high") for i, p in enumerate(prompts)]
    for sample, n in zip(samples, (4, 6, 9), strict=False):
        sample.append(list(range(30, 30 + n)), generated=True, logprobs=[-1.0] * n)
    return samples


def test_the_teacher_prefills_the_visual_tokens(dirs, tokenizer, tmp_path):
    teacher_dir = dirs["rl-general-high"]
    routes = {("general", "high"): Teacher("general", "high", teacher_dir, "embedded")}
    pool = TeacherPool(routes, tmp_path, max_retries=0, log=logging.getLogger("test"))
    teacher = load_pretrained(teacher_dir)
    restore_qat(teacher)
    teacher.eval()
    assert isinstance(teacher, KimiK3ForConditionalGeneration)
    samples = visual_samples(renderer_for(tokenizer, teacher), tmp_path / "env", 3)
    other = [copy.deepcopy(s) for s in samples]
    for sample, donor in zip(other, samples[1:] + samples[:1], strict=True):
        sample.images = donor.images
    pool.score(samples + other)
    pool.close()

    for sample, swapped in zip(samples, other, strict=True):
        ids = torch.tensor([sample.tokens])
        with torch.no_grad():
            with_image = teacher(ids, **media_inputs(teacher, [sample.images])).logits[0]
            without = teacher.language_model(input_ids=ids).logits[0]  # the pads as plain tokens

        def picked(logits: torch.Tensor, tokens: list[int] = sample.tokens) -> torch.Tensor:
            logp = torch.log_softmax(logits[:-1].float(), -1)
            return torch.cat([torch.zeros(1), logp.gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]])

        got = torch.tensor(sample.teacher_logprobs)
        torch.testing.assert_close(got, picked(with_image), atol=2e-5, rtol=0)
        generated = torch.tensor(sample.generated_mask, dtype=torch.bool)
        assert (got - picked(without))[generated].abs().max() > 1e-2
        assert (got - torch.tensor(swapped.teacher_logprobs))[generated].abs().max() > 1e-2


def test_a_mopd_stage_on_visual_questions_trains_a_multimodal_student(dirs, tmp_path, stage_runner):
    body = {
        "domains": ["general"],
        "efforts": ["high"],
        "train": {"steps": 2, "lr": 1e-4},
        "rollout": {"prompts_per_domain": 2},
        "eval": {"prompts_per_domain": 2, "samples_per_prompt": 1},
        "environments": {"general": {"max_tokens_per_turn": 8, "max_turns": 1, "families": FAMILIES}},
        "checkpoint_every": 1,
    }
    ctx = stage_runner.context("mopd", tmp_path, body, inputs=dict(dirs))
    final = stage_runner.run(ctx)
    assert final["steps"] == 2.0 and final["teacher_retries"] == 0.0
    assert all(math.isfinite(final[k]) for k in ("kl_before", "kl_after", "train_loss"))
    student = load_pretrained(ctx.output_dir)
    assert isinstance(student, KimiK3ForConditionalGeneration)
    start = load_pretrained(dirs["sft"])
    moved = [
        name
        for name, p in student.named_parameters()
        if not torch.equal(p, dict(start.named_parameters())[name])
    ]
    assert any(name.startswith("language_model.") for name in moved)
    assert any(name.startswith(("vision_tower.", "mm_projector.")) for name in moved)
