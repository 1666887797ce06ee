"""The `rl` stage on the general/visual questions: a multimodal SFT model plays drawn-image
episodes through the embedded engine (cold start, rollouts, held-out eval) and is written back as
a multimodal model."""

from __future__ import annotations

import pytest

import data_recipes  # noqa: F401  (registers the task families)
from posttrain.data.chat import load_tokenizer
from posttrain.engines.testing import tiny_vl_k3
from posttrain.metrics import read_metrics
from posttrain.model.vision_model import KimiK3ForConditionalGeneration, load_pretrained, save_multimodal
from posttrain.testing import TINY_RL_BODY

BODY = {
    **TINY_RL_BODY,
    "environments": {"general": {"max_tokens_per_turn": 12, "max_turns": 1, "families": ["general/visual"]}},
}


def test_rl_on_visual_questions_plays_drawn_image_episodes(tmp_path, stage_runner):
    tokenizer = load_tokenizer(media=True)
    sft = save_multimodal(tiny_vl_k3(0), tmp_path / "sft", tokenizer=tokenizer)
    ctx = stage_runner.context(
        "rl",
        tmp_path / "run",
        BODY,
        stage_id="rl-general-high",
        inputs={"sft": sft},
        matrix={"domain": "general", "effort": "high"},
    )
    final = stage_runner.run(ctx)
    records = [r for r in read_metrics(ctx.stage_dir / "metrics.jsonl") if "reward_mean" in r]
    assert [r["rollout/trajectories"] for r in records] == [6.0, 6.0]
    assert final["budget/cold_start_prompts"] == 2 and 0.0 <= final["accuracy_after"] <= 1.0
    # An untrained tiny model never answers a drawn question right: every group's task reward is 0,
    # so no group has reward variance and each step is skipped (the policy step with images is
    # trained in tests/trainers/test_mopd_vision.py and checked against the engine in
    # tests/engines/test_embedded_images.py).
    assert all(r["task_reward_mean"] == 0.0 and r["skipped"] == 1.0 for r in records)
    policy = load_pretrained(ctx.output_dir)
    assert isinstance(policy, KimiK3ForConditionalGeneration)


def test_a_multimodal_policy_refuses_a_text_only_rollout_engine(tmp_path, stage_runner):
    sft = save_multimodal(tiny_vl_k3(0), tmp_path / "sft", tokenizer=load_tokenizer(media=True))
    body = {**BODY, "rollout": {**BODY["rollout"], "engine": "vllm_server"}}
    ctx = stage_runner.context(
        "rl",
        tmp_path / "run",
        body,
        stage_id="rl-general-high",
        inputs={"sft": sft},
        matrix={"domain": "general", "effort": "high"},
    )
    with pytest.raises(
        ValueError, match="rollout.engine vllm_server serves text only.*use rollout.engine: vllm or embedded"
    ):
        stage_runner.run(ctx)
