"""The `sft` stage run in several processes, for tests/parallel/test_sft_parallel.py.

`launch(spec, nprocs, workdir)` starts `torchrun` (gloo on this CPU machine) on this file; every rank
registers the test's data recipe and runs the stage runs the spec lists, one after the other in the
same process group. Each run's context is built as `posttrain.testing.StageRunner` builds one
(`stage_context`, also used for the one-process reference in the test's own process), except that
the ranks after 0 log their metrics under `rank-{r}/` of the stage directory: the checkpoints and
the output dir are shared, as on a cluster's shared storage. A run may stop at a step with
`FakeCrash` (it stands in for a kill, right after that step's checkpoint), and one rank's losses may
be made NaN from a step on (`nan_loss_fault`: "nan_loss_fault": [rank, step]); every rank writes
each run's `run_stage` result to result-{i}.json (rank 0; i: the run's index in the spec) or
result-{i}-rank{r}.json next to the spec.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def register_recipe(name: str, data: str) -> None:
    from posttrain.data.mixture import DATA_RECIPES, MixtureSource, Recipe

    if name not in DATA_RECIPES:
        DATA_RECIPES.register(name)(lambda: Recipe(sources=(MixtureSource(data),), eval_fraction=0.25))


def stage_context(
    run_dir: Path, body: dict, *, rank: int = 0, crash_at: int | None = None, qat: bool = False
):
    """The StageContext of stage `sft` in run_dir for this rank (see the module docstring)."""
    from posttrain.engines.testing import TINY_K3_PRESET
    from posttrain.metrics import MetricsLogger
    from posttrain.stages import build_context
    from posttrain.testing import FakeCrash

    stage_dir = run_dir / "sft"
    output = stage_dir / ".model-tmp"
    output.mkdir(parents=True, exist_ok=True)
    metrics_dir = stage_dir if rank == 0 else stage_dir / f"rank-{rank}"
    metrics_dir.mkdir(parents=True, exist_ok=True)
    steps: list[int] = []

    def hook(step: int, total: int | None, shown: dict) -> None:
        steps.append(step)
        if step == crash_at:
            raise FakeCrash(f"killed after step {step}")

    ctx = build_context(
        stage_id="sft",
        kind="sft",
        body=body,
        seed=0,
        qat={"scheme": "k3"} if qat else None,
        inputs={},
        model=TINY_K3_PRESET,
        matrix={},
        resources={"cpus": 1.0},
        run_dir=run_dir,
        stage_dir=stage_dir,
        output_dir=output,
        metrics=MetricsLogger(metrics_dir, tensorboard=False),
        log=logging.getLogger(f"test-parallel-{run_dir.name}-rank{rank}"),
        progress_sink=hook,
    )
    ctx.steps_run = steps  # what run_stage reports: the optimizer steps this attempt ran
    return ctx


def run_stage(ctx) -> dict[str, Any]:
    """{"final": metrics or None, "crashed": message or None, "non_finite": NonFiniteLossError's
    message or None, "steps": the steps it ran}."""
    import posttrain.trainers  # noqa: F401  (registers the sft kind)
    from posttrain.stages import STAGE_KINDS
    from posttrain.testing import FakeCrash
    from posttrain.trainers.common import NonFiniteLossError

    result: dict[str, Any] = {"final": None, "crashed": None, "non_finite": None, "steps": ctx.steps_run}
    try:
        result["final"] = dict(STAGE_KINDS.get("sft").run(ctx))
    except FakeCrash as crash:
        result["crashed"] = str(crash)
    except NonFiniteLossError as error:
        result["non_finite"] = str(error)
    finally:
        ctx.metrics.close()
    return result


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(spec: dict, nprocs: int, workdir: Path, timeout: float = 300) -> list[dict[str, Any]]:
    """torchrun this file with `spec` ({"recipe", "data", "runs": [{"run_dir", "body", "crash_at",
    "qat"}]}) on nprocs ranks; returns rank 0's `run_stage` results, or fails with the ranks' output
    when torchrun does."""
    spec_file = workdir / "spec.json"
    spec_file.write_text(json.dumps(spec))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nprocs}",
        "--master-addr=127.0.0.1",
        f"--master-port={_free_port()}",
        __file__,
        str(spec_file),
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    assert done.returncode == 0, (
        f"torchrun failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-8000:]}"
    )
    return [json.loads((workdir / f"result-{i}.json").read_text()) for i in range(len(spec["runs"]))]


def nan_loss_fault(from_step: int) -> None:
    """Injected fault: this process's SFT losses are NaN from optimizer step `from_step` on (the
    other ranks' stay finite), as when one rank's shard of the data or weights goes bad."""
    import torch

    import posttrain.trainers.sft as sft

    real, calls = sft.sft_loss, {"n": 0}

    def faulty(*args: Any, **kwargs: Any) -> Any:
        out = real(*args, **kwargs)
        if not torch.is_grad_enabled():  # an evaluation's loss, not a training step's
            return out
        calls["n"] += 1  # one packed row per step in these tests (grad_accum 1)
        return out._replace(loss=out.loss * float("nan")) if calls["n"] >= from_step else out

    sft.sft_loss = faulty


def main() -> None:
    import torch

    torch.set_num_threads(1)
    spec = json.loads(Path(sys.argv[1]).read_text())
    rank = int(os.environ["RANK"])
    register_recipe(spec["recipe"], spec["data"])
    for i, run in enumerate(spec["runs"]):
        run_dir = Path(run["run_dir"])
        crash_at, qat = run.get("crash_at"), run.get("qat", False)
        fault = run.get("nan_loss_fault")
        if fault is not None and fault[0] == rank:
            nan_loss_fault(fault[1])
        result = run_stage(stage_context(run_dir, run["body"], rank=rank, crash_at=crash_at, qat=qat))
        name = f"result-{i}.json" if rank == 0 else f"result-{i}-rank{rank}.json"
        (Path(sys.argv[1]).parent / name).write_text(json.dumps(result))
    # Tear the process group down while both ranks are here: left to interpreter exit, a rank
    # whose stage raised (the NaN test) once aborted in CI ("terminate called without an active
    # exception", SIGABRT) and torchrun failed the run.
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
