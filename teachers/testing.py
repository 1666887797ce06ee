"""Tiny students, teachers and MOPD stage runs for tests, built in seconds on a CPU.

A freshly initialised tiny K3 has near-uniform next-token distributions, so student and teacher
would agree on everything and a distillation test could not fail. `save_tiny_k3(sharpen=s)`
multiplies the LM head by s: the teacher keeps the student's preferences but is far more peaked,
a gap that on-policy distillation closes in a few steps. The RL stages play the same role in the
real pipeline. Stage runs go through posttrain.testing.StageRunner, the runner every stage kind's
tests use.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from posttrain.engines.testing import tiny_k3
from posttrain.qat import QATConfig, apply_qat
from posttrain.stages import StageContext
from posttrain.testing import ProgressHook, StageRunner

RUNNER = StageRunner()


def save_tiny_k3(
    directory: str | Path, tokenizer: PreTrainedTokenizerBase, *, seed: int = 0, sharpen: float = 1.0
) -> Path:
    """A tiny K3 (QAT k3 recorded, as every stage trains it) with its LM head scaled by `sharpen`,
    saved with `tokenizer` in HF format. Returns the directory."""
    directory = Path(directory)
    model = tiny_k3(seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpen)
    apply_qat(model, QATConfig(scheme="k3"))
    model.save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    return directory


def mopd_context(
    stage_dir: Path, body: dict[str, Any], inputs: dict[str, Path], *, progress: ProgressHook | None = None
) -> StageContext:
    """What orchestration.runner builds for a `mopd` stage in `stage_dir` (its name is the stage
    id): the validated body, RNGs seeded 0, metrics (no TensorBoard), checkpoints, a temp output
    dir. `progress(step, total, shown)` receives every ctx.progress call."""
    return RUNNER.context(
        "mopd", stage_dir.parent, body, stage_id=stage_dir.name, inputs=inputs, progress=progress
    )


def run_mopd_stage(ctx: StageContext) -> dict[str, float]:
    """Run the registered `mopd` kind on `ctx` (closing its metrics writer either way)."""
    return RUNNER.run(ctx)
