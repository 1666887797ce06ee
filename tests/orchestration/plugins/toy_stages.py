"""Small stage kinds for the orchestration tests, loaded through a stage file's `plugins:` list
exactly as a user's own stage kinds are.

`toy-sum` writes value.txt = its `value` plus the values of its inputs (plus the integer in its
`data` file, a file it reads as an SFT stage reads its data), so a test can tell from the output
which inputs a stage saw (and gpus.txt, which GPUs it was given); it logs a few curves
so reports have something to plot. With `rendezvous`, it waits until `parties` stages have
arrived there: stages that only finish when run at the same time, which is how a test sees
--max-parallel without timing anything.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from posttrain.stages import StageContext, stage_kind


class Train(BaseModel):
    model_config = ConfigDict(extra="forbid")
    steps: int = 3
    lr: float = 0.1


class ToySum(BaseModel):
    model_config = ConfigDict(extra="forbid")
    value: int = 1
    fail: bool = False
    fail_message: str = "toy stage asked to fail"
    train: Train = Train()
    rendezvous: str | None = None
    parties: int = 2
    data: str | None = None


def data_files(config: ToySum) -> list[Path]:
    return [Path(config.data)] if config.data else []


@stage_kind("toy-sum", config=ToySum, data_files=data_files)
def run_toy_sum(ctx: StageContext) -> dict[str, float]:
    """Add `value` to the sum of the inputs' values."""
    if ctx.config.rendezvous:
        meet(Path(ctx.config.rendezvous), ctx.stage_id, ctx.config.parties)
    total = ctx.config.value + sum(int((path / "value.txt").read_text()) for path in ctx.inputs.values())
    if ctx.config.data:
        total += int(Path(ctx.config.data).read_text())
    effort = {"low": 1, "high": 2, "max": 3}.get(ctx.matrix.get("effort"), 1)
    for step in range(1, ctx.config.train.steps + 1):
        ctx.metrics.log(
            step, loss=1.0 / step, reward=step * ctx.config.train.lr, response_length=10 * effort + step
        )
        ctx.progress(step, ctx.config.train.steps, loss=1.0 / step)
    if ctx.config.fail:
        raise RuntimeError(ctx.config.fail_message)
    (ctx.output_dir / "value.txt").write_text(str(total))
    # the GPUs the executor gave this stage
    (ctx.output_dir / "gpus.txt").write_text(os.environ.get("CUDA_VISIBLE_DEVICES", "unset"))
    return {"total": float(total), "loss": 1.0 / ctx.config.train.steps}


def meet(directory: Path, name: str, parties: int) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / name).touch()
    deadline = time.monotonic() + 120
    while len(list(directory.iterdir())) < parties:
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"only {len(list(directory.iterdir()))} of {parties} stages reached {directory}"
            )
        time.sleep(0.05)
