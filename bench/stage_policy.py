"""What the evaluation benches share: a stage's model as the stages play it, in the RL harness.

`route_share.py`, `rl_headroom.py`, `family_episodes.py` and `visual_accuracy.py` each play a stage
output's episodes outside a run. They must measure the policy the pipeline evaluates (the released
layout read back, its QAT fake-quant restored, the embedded engine) in the environment the RL stages
built (`stages/rl.yaml`'s `environments.<domain>`), so that setup lives here once rather than in a
copy per script that could drift from the stages'.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors.torch import load_file

import data_recipes  # noqa: F401  (registers the task families)
from posttrain.data.chat import load_tokenizer
from posttrain.engines import EmbeddedEngine
from posttrain.envs.environments import EnvironmentConfig, make_environment
from posttrain.model.vision_model import load_pretrained
from posttrain.qat import restore_qat
from posttrain.trainers.common import renderer_for

REPO = Path(__file__).resolve().parents[1]


@dataclass
class StagePolicy:
    """A stage output ready to play: its model (eval mode, QAT restored) and what drives it."""

    model: torch.nn.Module
    tokenizer: Any
    renderer: Any
    engine: EmbeddedEngine


def load_policy(model_dir: Path, weights: Path | None = None) -> StagePolicy:
    """MODEL_DIR's model; with `weights` (a training checkpoint's model.safetensors) those weights
    loaded into it strictly, so an SFT run's checkpoints can be played in its final model's shell."""
    model = load_pretrained(model_dir)
    if weights is not None:
        getattr(model, "language_model", model).load_state_dict(load_file(weights), strict=True)
    restore_qat(model)
    model.eval()
    tokenizer = load_tokenizer(model_dir)
    renderer = renderer_for(tokenizer, model)
    return StagePolicy(model, tokenizer, renderer, EmbeddedEngine(model, pad_token_id=renderer.pad_id))


def rl_harness(domain: str, families: list[str] | None = None) -> EnvironmentConfig:
    """`stages/rl.yaml`'s `environments.<domain>`; with `families`, only those offered."""
    environments = yaml.safe_load((REPO / "stages" / "rl.yaml").read_text())["environments"]
    config = dict(environments.get(domain, {}))
    if families is not None:
        config["families"] = families
    return EnvironmentConfig(**config)


@contextmanager
def environment(domain: str, renderer: Any, config: EnvironmentConfig) -> Iterator[Any]:
    """`domain`'s environment under `config`, its sandboxes in a temporary directory removed after."""
    with (
        tempfile.TemporaryDirectory() as root,
        make_environment(domain, renderer, config, sandbox_dir=Path(root)) as env,
    ):
        yield env
