"""Tiny students, teachers and stage contexts for MOPD tests, built in seconds on a CPU.

A freshly initialised tiny K3 has near-uniform next-token distributions, so student and teacher
would agree on everything and a distillation test could not fail. `save_tiny_k3(sharpen=s)`
multiplies the LM head by s: the teacher keeps the student's preferences but is far more peaked,
a gap that on-policy distillation closes in a few steps. The RL stages play the same role in the
real pipeline.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from posttrain.checkpoint import CheckpointManager
from posttrain.metrics import MetricsLogger
from posttrain.model import KimiK3ForCausalLM, load_model_config
from posttrain.qat import QATConfig, apply_qat
from posttrain.stages import STAGE_KINDS, StageContext

TINY_PRESET = Path(__file__).resolve().parents[1] / "stages" / "models" / "tiny.yaml"


def save_tiny_k3(
    directory: str | Path, tokenizer: PreTrainedTokenizerBase, *, seed: int = 0, sharpen: float = 1.0
) -> Path:
    """A tiny K3 (QAT k3 recorded, as every stage trains it) with its LM head scaled by `sharpen`,
    saved with `tokenizer` in HF format. Returns the directory."""
    directory = Path(directory)
    torch.manual_seed(seed)
    model = KimiK3ForCausalLM(load_model_config(TINY_PRESET))
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpen)
    apply_qat(model, QATConfig(scheme="k3"))
    model.save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    return directory


def mopd_context(
    stage_dir: Path,
    body: dict[str, Any],
    inputs: dict[str, Path],
    *,
    seed: int = 0,
    progress: Callable[[int, int | None, dict], None] | None = None,
) -> StageContext:
    """What orchestration.runner builds for a `mopd` stage: the validated body, seeded RNGs,
    metrics (no TensorBoard), checkpoints, a temp output dir."""
    stage_dir.mkdir(parents=True, exist_ok=True)
    output = stage_dir / ".model-tmp"
    output.mkdir(exist_ok=True)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    metrics = MetricsLogger(stage_dir, tensorboard=False)
    return StageContext(
        stage_id="mopd",
        kind="mopd",
        config=STAGE_KINDS.get("mopd").config.model_validate(body),
        seed=seed,
        inputs=dict(inputs),
        model=TINY_PRESET,
        qat=QATConfig(scheme="k3"),
        matrix={},
        resources={"cpus": 1.0},
        run_dir=stage_dir.parent,
        stage_dir=stage_dir,
        output_dir=output,
        metrics=metrics,
        checkpoints=CheckpointManager(stage_dir / "checkpoints", metrics=metrics),
        log=logging.getLogger(f"mopd-test-{stage_dir.name}"),
        progress_sink=progress or (lambda *a: None),
    )


def run_mopd_stage(ctx: StageContext) -> dict[str, float]:
    """Run the registered `mopd` kind on `ctx` (closing its metrics writer either way)."""
    try:
        return dict(STAGE_KINDS.get("mopd").run(ctx))
    finally:
        ctx.metrics.close()
