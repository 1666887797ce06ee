"""A stage must not publish weights that diverged (orchestration/publish_guard.py): a real SFT run at
lr=1e9 ends failed with nothing published, the same stage at the shipped lr publishes, the AdamW
movement bound holds against torch's own AdamW, and a tensor moved further than the stage's steps
explain (an injected fault) is named."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from orchestration.pipeline import load_pipeline
from orchestration.publish_guard import (
    DivergedModelError,
    adamw_movement_bound,
    check_publishable,
    optimizer_steps,
)
from posttrain.stages import STAGE_KINDS

REPO = Path(__file__).resolve().parents[2]
BASE = REPO / "data_recipes" / "base"

SFT_STAGE = f"""
stage: sft
kind: sft
model: {BASE}
seed: 0
resources: {{cpus: 1}}
qat: {{scheme: k3}}
data:
  recipes: {{agent_sft: 1.0}}
  strict: false
train: {{steps: 1, micro_batch_tokens: 512, lr: 2.0e-3, warmup_steps: 0}}
checkpoint_every: 1
eval: {{tool_prompts: 0}}
"""


def test_a_diverged_stage_ends_failed_and_publishes_nothing(write, posttrain, tmp_path: Path) -> None:
    stage_file, run = write("sft.yaml", SFT_STAGE), tmp_path / "run"
    # One step at lr=1e9 moves every weight by ~1e9: the loss of that step was finite, so only the
    # check at publish time can catch it.
    code, out, err = posttrain("run", stage_file, "--run-dir", run, "sft.train.lr=1e9")
    assert code == 1, out + err
    manifest = json.loads((run / "sft" / "manifest.json").read_text())
    assert manifest["status"] == "failed"
    assert "refusing to publish" in manifest["error"] and "non-finite logits" in manifest["error"]
    assert "in tensor model." in manifest["error"]
    assert "train.lr (now 1e+09)" in manifest["error"] and "--restart sft" in manifest["error"]
    assert not (run / "sft" / "model").exists() and not (run / "sft" / ".model-tmp").exists()
    code, out, err = posttrain("plan", stage_file, "--run-dir", run, "sft.train.lr=1e9")
    assert "failed" in out and "refusing to publish" in out

    code, out, err = posttrain("run", stage_file, "--run-dir", run)  # the shipped lr: publishes
    assert code == 0, out + err
    assert json.loads((run / "sft" / "manifest.json").read_text())["status"] == "done"
    weights = run / "sft" / "model" / "model.safetensors"
    assert weights.stat().st_mode & 0o777 == 0o644  # save_pretrained had left it 0600


@pytest.mark.parametrize("betas", [(0.9, 0.95), (0.9, 0.999), (0.5, 0.6)])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_movement_bound_holds_for_torch_adamw(betas: tuple[float, float], weight_decay: float) -> None:
    """Gradients chosen to push AdamW hardest: constant sign, a sign flip after a long run, huge
    then tiny magnitudes, zeros after a step (momentum alone). The bound must hold for all and be
    within 1.3x of the largest movement seen (a bound that is too loose would catch nothing)."""
    steps, lr = 40, 1e-2
    generator = torch.Generator().manual_seed(0)
    histories = {
        "constant": [torch.ones(64)] * steps,
        "flip": [torch.ones(64)] * 30 + [-torch.ones(64)] * 10,
        "huge-then-tiny": [torch.full((64,), 1e6)] * 5 + [torch.full((64,), 1e-6)] * 35,
        "tiny-then-huge": [torch.full((64,), 1e-6)] * 35 + [torch.full((64,), 1e6)] * 5,
        "one-then-zero": [torch.ones(64)] + [torch.zeros(64)] * 39,
        "random": [torch.randn(64, generator=generator) * 10 ** torch.randint(-6, 6, (1,)).item()] * steps,
    }
    largest = 0.0
    for name, grads in histories.items():
        weight = torch.nn.Parameter(torch.full((64,), 2.0))
        start = weight.detach().clone()
        optimizer = torch.optim.AdamW([weight], lr=lr, betas=betas, weight_decay=weight_decay, foreach=False)
        for grad in grads:
            weight.grad = grad.clone()
            optimizer.step()
        moved = float((weight.detach() - start).abs().max())
        bound = adamw_movement_bound(lr, betas, weight_decay, steps, 2.0)
        assert moved <= bound, (name, moved, bound)
        largest = max(largest, moved)
    assert bound < 1.3 * largest, (bound, largest)


@pytest.fixture(scope="module")
def copied_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("trained") / "model"
    shutil.copytree(BASE, path)
    return path


def rl_like(lr: float, steps: int, updates: int) -> SimpleNamespace:
    train = SimpleNamespace(
        lr=lr, betas=(0.9, 0.95), weight_decay=0.0, steps=steps, updates_per_iteration=updates
    )
    return SimpleNamespace(train=train, init="sft", lora=None, accelerate=None)


def test_a_tensor_moved_further_than_its_steps_explain_is_named(copied_base: Path) -> None:
    config = rl_like(5e-4, steps=8, updates=2)
    assert check_publishable("rl-general-low", config, copied_base, {"sft": BASE}, None) == []
    weights = load_file(str(copied_base / "model.safetensors"))
    name = next(n for n in sorted(weights) if n.endswith("mlp.gate_proj.weight") or "q_proj" in n)
    weights[name] = weights[name] + 0.05  # injected fault: 0.05 > 16 steps x 5e-4 x ~1.2
    save_file(weights, str(copied_base / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(DivergedModelError) as caught:
        check_publishable("rl-general-low", config, copied_base, {"sft": BASE}, None)
    message = str(caught.value)
    assert "stage rl-general-low" in message and "moved 0.05" in message and "16 AdamW steps" in message
    assert "--restart rl-general-low" in message
    assert any(part in message for part in name.split(".")[-3:])


def test_non_finite_weights_are_named_for_any_kind(tmp_path: Path) -> None:
    weights = {"a": torch.zeros(3), "b": torch.tensor([1.0, math.inf, math.nan])}
    save_file(weights, str(tmp_path / "weights.safetensors"))
    with pytest.raises(DivergedModelError, match=r"tensor b in weights.safetensors holds 2 non-finite"):
        check_publishable("toy", None, tmp_path, {}, None)


def test_shipped_stages_bound_their_real_optimizer_steps() -> None:
    """The bound reads the steps each shipped kind takes (rl: iterations x PPO epochs) and stays far
    above what the shipped learning rates can do in one step, so legit stages never trip it."""
    pipeline = load_pipeline(REPO / "stages" / "mopd.yaml")
    expected = {"sft": 1380, "rl-general-low": 16, "rl-coding-max": 16, "mopd": 32}
    for sid, steps in expected.items():
        stage = pipeline.stages[sid]
        config = STAGE_KINDS.get(stage.kind).config.model_validate(stage.body)
        assert optimizer_steps(config) == steps, sid
        bound = adamw_movement_bound(
            config.train.lr, config.train.betas, config.train.weight_decay, steps, 1.0
        )
        assert bound >= steps * config.train.lr, sid  # every step may move a weight by a full lr
