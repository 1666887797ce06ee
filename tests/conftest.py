"""Fixtures shared across test packages (keep this file small): one torch thread, the CLI run in
process, the shipped chat renderer, the tiny K3 behind the embedded engine, and stage runs built
the way orchestration.runner builds them. Heavy imports happen inside the fixtures, so test
packages that never use one do not pay for it."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from posttrain.data.chat import ChatRenderer
    from posttrain.engines import EmbeddedEngine
    from posttrain.stages import StageContext


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread() -> Iterator[None]:
    """One intra-op thread for the whole suite, module-scoped model fixtures included: the
    models are tiny, the machine has 2 shared cores, and extra threads only add contention
    (a decode step measured 0.9 s with 2 threads against 24-33 ms with 1)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def posttrain(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> Callable[..., tuple]:
    """posttrain("plan", path, ...) -> (exit code, stdout, stderr): the CLI run in this process."""
    from posttrain.cli import main

    monkeypatch.setenv("COLUMNS", "250")  # rich would otherwise truncate table cells at 80

    def run(*argv: object) -> tuple[int, str, str]:
        capsys.readouterr()
        code = main([str(a) for a in argv])
        out, err = capsys.readouterr()
        return code, out, err

    return run


@pytest.fixture(scope="session")
def renderer() -> ChatRenderer:
    """The K3 chat renderer over the shipped tokenizer. Shared by the whole session: no test may
    change it (or its tokenizer)."""
    from posttrain.data.chat import ChatRenderer, load_tokenizer

    return ChatRenderer(load_tokenizer())


@pytest.fixture(scope="module")
def tiny_k3_engine(renderer: ChatRenderer) -> EmbeddedEngine:
    """The tiny K3 (seed 0, QAT k3 as every stage trains it) behind an EmbeddedEngine. One per test
    module: tests change its weights and policy version, and a module's tests may rely on that."""
    from posttrain.engines import EmbeddedEngine
    from posttrain.engines.testing import tiny_k3
    from posttrain.qat import QATConfig

    return EmbeddedEngine(tiny_k3(0, qat=QATConfig(scheme="k3")), pad_token_id=renderer.pad_id)


class FakeCrash(RuntimeError):
    """Stands in for a kill: raised by a stage's progress hook right after step `crash_at` was
    checkpointed."""


class StageRunner:
    """Runs registered stage kinds for real on contexts built as orchestration.runner builds them."""

    FakeCrash = FakeCrash

    def context(
        self,
        kind: str,
        run_dir: Path,
        body: dict[str, Any],
        *,
        stage_id: str | None = None,
        model: Path | None = None,
        inputs: dict[str, Path] | None = None,
        matrix: dict[str, Any] | None = None,
        crash_at: int | None = None,
    ) -> StageContext:
        """Stage `stage_id` (default: the kind's name) of `kind` in `run_dir`: the body validated by
        the kind's config, RNGs seeded 0, metrics without TensorBoard, checkpoints, a temp output
        dir, QAT k3, the tiny K3 preset unless `model` is given. With `crash_at`, the progress hook
        raises FakeCrash right after that step."""
        import numpy as np
        import torch

        from posttrain.checkpoint import CheckpointManager
        from posttrain.engines.testing import TINY_K3_PRESET
        from posttrain.metrics import MetricsLogger
        from posttrain.qat import QATConfig
        from posttrain.stages import STAGE_KINDS, StageContext

        stage_id = stage_id or kind
        stage_dir = run_dir / stage_id
        stage_dir.mkdir(parents=True, exist_ok=True)
        output = stage_dir / ".model-tmp"
        output.mkdir(exist_ok=True)
        random.seed(0)
        np.random.seed(0)
        torch.manual_seed(0)
        metrics = MetricsLogger(stage_dir, tensorboard=False)

        def progress(step: int, total: int | None, shown: dict) -> None:
            if step == crash_at:
                raise FakeCrash(f"killed after step {step}")

        return StageContext(
            stage_id=stage_id,
            kind=kind,
            config=STAGE_KINDS.get(kind).config.model_validate(body),
            seed=0,
            inputs=dict(inputs or {}),
            model=model or TINY_K3_PRESET,
            qat=QATConfig(scheme="k3"),
            matrix=dict(matrix or {}),
            resources={"cpus": 1.0},
            run_dir=run_dir,
            stage_dir=stage_dir,
            output_dir=output,
            metrics=metrics,
            checkpoints=CheckpointManager(stage_dir / "checkpoints", metrics=metrics),
            log=logging.getLogger(f"test-{run_dir.name}-{stage_id}"),
            progress_sink=progress,
        )

    def run(self, ctx: StageContext) -> dict[str, float]:
        """The final metrics of running `ctx`'s kind on it (its metrics writer closed either way)."""
        from posttrain.stages import STAGE_KINDS

        try:
            return dict(STAGE_KINDS.get(ctx.kind).run(ctx))
        finally:
            ctx.metrics.close()


@pytest.fixture(scope="session")
def stage_runner() -> StageRunner:
    return StageRunner()
