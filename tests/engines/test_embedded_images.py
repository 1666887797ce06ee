"""The embedded engine with images: an episode of the general/visual family played through the
environment driver prefills the drawn image's visual tokens; the recorded log-probs equal the
trainer's forward (policy_step.target_logprobs) over the same trajectory and image; a kept cache
carries the visual tokens across a pause and a later turn; `score` equals a direct forward."""

from __future__ import annotations

import copy

import pytest
import torch

import data_recipes  # noqa: F401  (registers the task families)
from posttrain.data.batch import TokenBatch
from posttrain.data.chat import load_tokenizer
from posttrain.data.sample import Sample
from posttrain.engines import EmbeddedEngine, SamplingConfig
from posttrain.engines.testing import tiny_vl_k3
from posttrain.envs.environments import EnvironmentConfig, make_environment
from posttrain.envs.tasks import TASK_FAMILIES
from posttrain.model.vision_model import KimiK3ForConditionalGeneration, media_inputs
from posttrain.qat import QATConfig
from posttrain.trainers.common import renderer_for
from posttrain.trainers.policy_step import target_logprobs

SAMPLING = SamplingConfig(max_tokens=10, seed=3, temperature=1.0)


@pytest.fixture(scope="module")
def model() -> KimiK3ForConditionalGeneration:
    return tiny_vl_k3(0, init_scale=4.0).eval()


@pytest.fixture(scope="module")
def renderer(model):
    return renderer_for(load_tokenizer(media=True), model)


@pytest.fixture
def environment(renderer, tmp_path):
    config = EnvironmentConfig(max_turns=2, max_tokens_per_turn=10, families=["general/visual"])
    with make_environment("general", renderer, config, sandbox_dir=tmp_path) as env:
        yield env


def visual_prompts(env, count: int) -> list[Sample]:
    prompts = env.prompts("train", count, seed=0)
    return [env.start(p, uid=f"v{i}", group=p.uid, effort="high") for i, p in enumerate(prompts)]


def media_pads(model, sample: Sample) -> int:
    return sample.tokens.count(model.config.media_placeholder_token_id)


def trainer_logprobs(model, samples: list[Sample], pad_id: int) -> torch.Tensor:
    batch = TokenBatch.of(samples, pad_id)
    with torch.no_grad():
        logp = target_logprobs(model, batch)
    return torch.cat([torch.zeros(len(samples), 1), logp], dim=1), batch


def test_the_visual_families_are_opt_in(renderer, tmp_path):
    with make_environment("general", renderer, EnvironmentConfig(), sandbox_dir=tmp_path) as env:
        assert env.family_names and not {"general/visual", "general/visual_cost"} & set(env.family_names)
    assert TASK_FAMILIES.get("general/visual").opt_in and TASK_FAMILIES.get("general/visual_cost").opt_in


@pytest.mark.parametrize("decode", ["dynamic", "static"])
def test_an_episode_with_images_matches_the_trainer_forward(model, renderer, environment, decode):
    samples = visual_prompts(environment, 4)
    assert len({s.images[0] for s in samples}) == 4  # one question text, four drawn images
    assert all(media_pads(model, s) == 16 for s in samples)
    engine = EmbeddedEngine(model, pad_token_id=renderer.pad_id, decode=decode)
    environment.play(engine, samples, SAMPLING)
    assert all(s.done and s.reward in (0.0, 1.0) and s.num_generated > 0 for s in samples)
    assert all(media_pads(model, s) == 16 for s in samples)  # the policy never writes media

    full, batch = trainer_logprobs(model, samples, renderer.pad_id)
    for row, sample in enumerate(samples):
        generated = torch.tensor(sample.generated_mask, dtype=torch.bool)
        got = full[row, batch.width - len(sample.tokens) :][generated]
        expected = torch.tensor(sample.rollout_logprobs)[generated]
        torch.testing.assert_close(got, expected, rtol=0, atol=2e-5)

    # the log-probs depend on the image: each trajectory under another prompt's image differs
    swapped = [copy.deepcopy(s) for s in samples]
    for sample, other in zip(swapped, samples[1:] + samples[:1], strict=True):
        sample.images = other.images
    other_full, _ = trainer_logprobs(model, swapped, renderer.pad_id)
    assert (other_full - full).abs().max() > 1e-2


@pytest.mark.parametrize("decode", ["dynamic", "static"])
def test_a_kept_cache_carries_the_visual_tokens_across_a_pause_and_a_turn(
    model, renderer, environment, decode
):
    straight = visual_prompts(environment, 2)
    paused = copy.deepcopy(straight)
    EmbeddedEngine(model, pad_token_id=renderer.pad_id, max_cached_samples=0).generate(straight, SAMPLING)

    engine = EmbeddedEngine(model, pad_token_id=renderer.pad_id, decode=decode, sync_every=1)
    steps = iter(range(100))
    engine.generate(paused, SAMPLING, pause_when=lambda rows: next(steps) >= 3)
    assert all(s.finish_reason == "paused" for s in paused)
    engine.generate(paused, SAMPLING)
    assert engine.cache_stats.reused == 2 and engine.cache_stats.prefilled == 2
    for a, b in zip(paused, straight, strict=True):
        assert a.tokens == b.tokens
        torch.testing.assert_close(
            torch.tensor(a.rollout_logprobs), torch.tensor(b.rollout_logprobs), atol=2e-5, rtol=0
        )

    # a next turn (a user follow-up, no new media) continues the cache; log-probs equal a full forward
    follow_up = renderer.render_tool_results([{"role": "user", "content": "Are you sure?"}])
    for sample in paused:
        sample.append(follow_up, generated=False)
    engine.generate(paused, SAMPLING)
    assert engine.cache_stats.reused == 4 and engine.cache_stats.prefilled == 2
    full, batch = trainer_logprobs(model, paused, renderer.pad_id)
    for row, sample in enumerate(paused):
        generated = torch.tensor(sample.generated_mask, dtype=torch.bool)
        got = full[row, batch.width - len(sample.tokens) :][generated]
        torch.testing.assert_close(got, torch.tensor(sample.rollout_logprobs)[generated], atol=2e-5, rtol=0)


def test_score_with_images_equals_a_direct_forward(renderer, environment):
    model = tiny_vl_k3(1, qat=QATConfig(scheme="k3"), init_scale=4.0).eval()
    samples = visual_prompts(environment, 3)
    for sample, n in zip(samples, (3, 5, 7), strict=True):
        sample.append(list(range(20, 20 + n)), generated=True, logprobs=[0.0] * n)
    scores = EmbeddedEngine(model, pad_token_id=renderer.pad_id).score(samples)
    for sample, score in zip(samples, scores, strict=True):
        with torch.no_grad():
            logits = model(torch.tensor([sample.tokens]), **media_inputs(model, [sample.images])).logits[0]
        picked = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(sample.tokens[1:])[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(score[1:]), picked, atol=2e-5, rtol=0)
