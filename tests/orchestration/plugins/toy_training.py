"""A small but real training stage kind for the exact-resume test: an MLP with dropout, AdamW, a
warmup-decay LR schedule and random data drawn from the global torch RNG, so the result depends
on every piece of state a checkpoint must hold (weights, optimizer moments, scheduler position and
RNG). It checkpoints every `every` steps and resumes from the newest intact checkpoint.
"""

from __future__ import annotations

import time

import torch
from pydantic import BaseModel, ConfigDict
from safetensors.torch import save_file

from posttrain.stages import StageContext, stage_kind


class ToyTrain(BaseModel):
    model_config = ConfigDict(extra="forbid")
    steps: int = 100
    every: int = 4
    width: int = 256
    batch: int = 64
    pause: float = 0.0  # seconds slept after each step: a floor on a step's time, whatever the machine


@stage_kind("toy-train", config=ToyTrain)
def run_toy_train(ctx: StageContext) -> dict[str, float]:
    """Regress a fixed random teacher with a dropout MLP."""
    cfg = ctx.config
    model = torch.nn.Sequential(
        torch.nn.Linear(32, cfg.width),
        torch.nn.GELU(),
        torch.nn.Dropout(0.2),
        torch.nn.Linear(cfg.width, cfg.width),
        torch.nn.GELU(),
        torch.nn.Dropout(0.2),
        torch.nn.Linear(cfg.width, 1),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10) * 0.98**s)
    teacher = torch.randn(32, 1)
    checkpoint = ctx.checkpoints.load(model=model, optimizer=optimizer, scheduler=scheduler)
    start = checkpoint.step if checkpoint else 0
    seen = checkpoint.extra["samples_seen"] if checkpoint else 0
    loss = torch.tensor(0.0)
    for step in range(start, cfg.steps):
        x = torch.randn(cfg.batch, 32)
        loss = torch.nn.functional.mse_loss(model(x), torch.tanh(x @ teacher))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        if cfg.pause:
            time.sleep(cfg.pause)
        seen += cfg.batch
        ctx.metrics.log(step + 1, loss=loss.item(), lr=scheduler.get_last_lr()[0])
        ctx.progress(step + 1, cfg.steps, loss=loss.item())
        if (step + 1) % cfg.every == 0 or step + 1 == cfg.steps:
            ctx.checkpoints.save(
                step + 1, model=model, optimizer=optimizer, scheduler=scheduler, extra={"samples_seen": seen}
            )
    save_file(model.state_dict(), str(ctx.output_dir / "model.safetensors"))
    return {"loss": loss.item(), "samples_seen": float(seen)}
