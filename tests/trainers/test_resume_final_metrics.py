"""A stage resumed from its final checkpoint (killed after the last step was saved, before the
model was published) reports the same final metrics as the uninterrupted run: the last step's
metrics travel in the checkpoint (RL's reward_mean, task_reward_mean, over_budget_fraction; SFT's
train_loss). A NaN loss before the first checkpoint says so."""

from __future__ import annotations

import pytest
from test_rl import TINY_BODY, make_ctx, sft_dir  # noqa: F401  (fixtures)
from test_sft import body, small_recipe  # noqa: F401  (fixtures)


def comparable(metrics: dict[str, float]) -> dict[str, float]:
    """Without timings, and without budget/* (a resumed stage reuses the b0 cache the first
    attempt filled, so it cold-starts no prompt)."""
    return {
        k: v
        for k, v in metrics.items()
        if "s" not in k.rsplit("/", 1)[-1].split("_") and not k.startswith("budget/")
    }


def test_rl_resumed_from_its_final_checkpoint_keeps_its_metrics(tmp_path, make_ctx, stage_runner):  # noqa: F811
    straight = stage_runner.run(make_ctx(tmp_path / "straight", TINY_BODY, "agent", "high"))
    crashed = make_ctx(tmp_path / "resumed", TINY_BODY, "agent", "high", crash_at=2)
    with pytest.raises(stage_runner.FakeCrash):
        stage_runner.run(crashed)
    assert crashed.checkpoints.latest_step() == 2  # the final step
    resumed = stage_runner.run(make_ctx(tmp_path / "resumed", TINY_BODY, "agent", "high"))
    for key in ("reward_mean", "task_reward_mean", "over_budget_fraction"):
        assert key in straight and resumed.get(key) == straight[key], key
    assert comparable(resumed) == comparable(straight)


def test_sft_resumed_from_its_final_checkpoint_keeps_its_metrics(tmp_path, small_recipe, stage_runner):  # noqa: F811
    cfg = body(small_recipe[0], steps=2)
    straight = stage_runner.run(stage_runner.context("sft", tmp_path / "straight", cfg))
    crashed = stage_runner.context("sft", tmp_path / "resumed", cfg, crash_at=2)
    with pytest.raises(stage_runner.FakeCrash):
        stage_runner.run(crashed)
    resumed = stage_runner.run(stage_runner.context("sft", tmp_path / "resumed", cfg))
    assert "train_loss" in straight and resumed.get("train_loss") == straight["train_loss"]


def test_a_nan_loss_before_any_checkpoint_does_not_promise_one(tmp_path, small_recipe, stage_runner):  # noqa: F811
    from posttrain.trainers.common import NonFiniteLossError

    cfg = body(small_recipe[0], steps=3, lr=1e9, warmup_steps=0)
    cfg["checkpoint_every"] = 10
    with pytest.raises(NonFiniteLossError) as caught:
        stage_runner.run(stage_runner.context("sft", tmp_path, cfg))
    assert "no checkpoint was written yet" in str(caught.value)
    assert "is intact" not in str(caught.value)
