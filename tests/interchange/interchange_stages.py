"""The `sft` stage body the interchange tests run (a few steps on the `sft_recipe` fixture's
recipe): shared by the test modules of this folder."""

from __future__ import annotations


def sft_body(recipe: str, steps: int = 3) -> dict:
    """An `sft` stage body: a few optimizer steps on `recipe`, no tool-use eval."""
    return {
        "data": {"recipes": {recipe: 1.0}},
        "train": {"steps": steps, "micro_batch_tokens": 512, "lr": 5e-3, "warmup_steps": 1},
        "checkpoint_every": steps,
        "eval": {"tool_prompts": 0},
    }
