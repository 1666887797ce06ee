"""TrainState.optimizer_step's gradient clipping: the optimizer sees the clipped gradient, the
logged grad_norm is the norm before clipping, and `grad_clip: null` leaves the gradient alone."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from posttrain.trainers.common import AccelerateConfig, OptimConfig, TrainState


def global_norm(model: nn.Module) -> float:
    return float(torch.cat([p.grad.flatten() for p in model.parameters()]).norm())


@pytest.mark.parametrize(("scale", "clip"), [(50.0, 0.5), (1e-3, 0.5), (50.0, None)])
def test_optimizer_step_clips_the_global_norm_and_logs_the_norm_before_clipping(
    scale: float, clip: float | None
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 3), nn.Tanh(), nn.Linear(3, 2))
    ctx = SimpleNamespace(stage_id="clip-test", log=logging.getLogger("clip-test"))
    state = TrainState.create(ctx, model, OptimConfig(lr=0.1, grad_clip=clip), AccelerateConfig(), 4)
    seen: list[float] = []
    state.optimizer.optimizer.register_step_pre_hook(lambda *_: seen.append(global_norm(model)))

    state.backward(scale * model(torch.randn(7, 5)).pow(2).sum())
    before = global_norm(model)
    metrics = state.optimizer_step(1)

    assert metrics["grad_norm"] == pytest.approx(before, rel=1e-6)
    if clip is not None and scale > 1:
        assert before > 10 * clip  # the case is one where clipping binds
        assert seen == [pytest.approx(clip, rel=1e-5)]
    else:
        assert clip is None or before < clip
        assert seen == [pytest.approx(before, rel=1e-6)]
    assert all(p.grad is None for p in model.parameters())
