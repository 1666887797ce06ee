"""TrainState.optimizer_step's gradient clipping: the optimizer sees the clipped gradient, the
logged grad_norm is the norm before clipping, and `grad_clip: null` leaves the gradient alone."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from posttrain.trainers.common import AccelerateConfig, OptimConfig, TrainState, build_optimizer


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


def _seeded_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 5), nn.LayerNorm(5), nn.Linear(5, 3))


def _adamw_run(fused: bool, device: str) -> list[torch.Tensor]:
    model = _seeded_model().to(device)
    optimizer = build_optimizer(model, OptimConfig(lr=0.05, weight_decay=0.1), fused=fused)
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        x = torch.randn(11, 7, generator=gen).to(device)
        model(x).pow(2).sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return [p.detach().cpu() for p in model.parameters()]


def test_fused_adamw_takes_the_steps_of_the_per_parameter_loop() -> None:
    """The fused AdamW that CUDA stages build (one kernel per group) keeps the param groups and
    takes the same steps, decay on the matrices only, as the CPU's per-parameter loop."""
    loop, fused = _adamw_run(False, "cpu"), _adamw_run(True, "cpu")
    start = [p.detach() for p in _seeded_model().parameters()]
    assert any(not torch.equal(a, b) for a, b in zip(loop, start, strict=True))
    for a, b in zip(loop, fused, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_train_state_on_cuda_builds_the_fused_adamw() -> None:
    ctx = SimpleNamespace(stage_id="fused-test", log=logging.getLogger("fused-test"))
    model = nn.Linear(4, 2).cuda()
    state = TrainState.create(ctx, model, OptimConfig(), AccelerateConfig(), 4)
    assert all(group["fused"] for group in state.optimizer.optimizer.param_groups)
    torch.testing.assert_close(_adamw_run(True, "cuda"), _adamw_run(False, "cpu"), rtol=1e-4, atol=1e-5)


def _update_norm_case(device: str) -> tuple[list[torch.Tensor], float, float]:
    """(snapshot, rl's update_norm, the norm of the update computed directly) for two weights moved
    by known steps on `device`."""
    from posttrain.trainers.rl import update_norm, weights_snapshot

    torch.manual_seed(0)
    params = [torch.randn(5, 3, device=device), torch.randn(7, device=device)]
    start = weights_snapshot(params)
    steps = [torch.full((5, 3), 0.5, device=device), torch.full((7,), -2.0, device=device)]
    for p, step in zip(params, steps, strict=True):
        p.add_(step)
    direct = float(torch.cat([s.flatten() for s in steps]).norm())
    return start, update_norm(params, start), direct


def test_update_norm_is_the_norm_of_the_whole_update_from_a_host_snapshot() -> None:
    start, norm, direct = _update_norm_case("cpu")
    assert all(s.device.type == "cpu" for s in start)
    assert norm == pytest.approx(direct, rel=1e-6)


@pytest.mark.gpu
def test_update_norm_keeps_its_snapshot_out_of_gpu_memory() -> None:
    """RL's update_norm metric holds the iteration's starting weights in host memory, not beside the
    trained ones on the GPU, pinned so that its copies do not block (pageable ones cost 3 s an
    iteration at 1B parameters), and still measures the update made there."""
    start, norm, direct = _update_norm_case("cuda")
    assert all(s.device.type == "cpu" and s.is_pinned() for s in start)
    assert norm == pytest.approx(direct, rel=1e-5)


@pytest.mark.parametrize(("warmup", "steps"), [(10, 3), (3, 3), (2, 3)])
def test_a_warmup_longer_than_the_run_is_kept_and_said_once_at_the_start(
    warmup: int, steps: int, caplog: pytest.LogCaptureFixture
) -> None:
    """The documented smoke run `sft.train.steps=3` keeps the file's warm-up (10): the LR rises
    linearly the whole run (never reaching train.lr, no cosine, no division by zero) and the stage's
    log says so, with the last step's share of train.lr; a warm-up that ends inside the run is silent."""
    model = nn.Linear(2, 2)
    ctx = SimpleNamespace(stage_id="warmup-test", log=logging.getLogger("warmup-test"))
    optim = OptimConfig(lr=0.1, warmup_steps=warmup)
    with caplog.at_level(logging.INFO, logger="warmup-test"):
        state = TrainState.create(ctx, model, optim, AccelerateConfig(), steps)
    lrs = []
    for step in range(steps):
        model(torch.ones(1, 2)).sum().backward()
        lrs.append(state.optimizer_step(step)["lr"])
    assert lrs == pytest.approx([0.1 * (s + 1) / (warmup + 1) if s < warmup else 0.1 for s in range(steps)])
    said = [r.getMessage() for r in caplog.records if "warm-up" in r.getMessage()]
    if warmup >= steps:
        assert said == [
            f"train.warmup_steps {warmup} >= the stage's {steps} optimizer steps: the run ends inside the "
            f"warm-up, its last step at {steps / (warmup + 1):.3g} x train.lr (0.1); the cosine decay "
            "never starts"
        ]
    else:
        assert said == [] and lrs[-1] == pytest.approx(0.1)  # the last step is the cosine's first, at lr
