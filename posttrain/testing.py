"""Run a registered stage kind in this process, on a context built the way orchestration.runner
builds one, for tests of stage kinds: the engine's own and a plug-in author's alike.

No run directory manifest, no subprocess, no executor: the kind's `run` gets a real StageContext
(posttrain.stages.build_context, as the runner builds it: validated body, seeded RNGs, metrics,
checkpoints, a temp output dir), so a test can stop it at a
step as a kill would and run it again to check that it resumes. `mopd_context` and
`run_mopd_stage` are the `mopd` kind's shorthand (with posttrain.engines.testing.save_tiny_k3's
students and teachers).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from posttrain.engines.testing import TINY_K3_PRESET
from posttrain.files import remove_tree
from posttrain.metrics import MetricsLogger
from posttrain.stages import STAGE_KINDS, StageContext, build_context

ProgressHook = Callable[[int, int | None, dict], None]


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
        progress: ProgressHook | None = None,
    ) -> StageContext:
        """Stage `stage_id` (default: the kind's name) of `kind` in `run_dir`: the body validated by
        the kind's config, RNGs seeded 0, metrics without TensorBoard, checkpoints, a temp output
        dir, QAT k3, the tiny K3 preset unless `model` is given. `progress(step, total, shown)`
        receives every ctx.progress call, as the runner's progress file does; with `crash_at`, the
        hook then raises FakeCrash right after that step."""
        stage_id = stage_id or kind
        stage_dir = run_dir / stage_id
        stage_dir.mkdir(parents=True, exist_ok=True)
        output = stage_dir / ".model-tmp"
        # Empty, as the runner starts every attempt: a resumed kind whose earlier attempt was
        # killed after writing its model (save_released wants a new or empty dir) must not fail.
        remove_tree(output)
        output.mkdir()
        metrics = MetricsLogger(stage_dir, tensorboard=False)

        def hook(step: int, total: int | None, shown: dict) -> None:
            if progress is not None:
                progress(step, total, shown)
            if step == crash_at:
                raise FakeCrash(f"killed after step {step}")

        return build_context(
            stage_id=stage_id,
            kind=kind,
            body=body,
            seed=0,
            qat={"scheme": "k3"},
            inputs=inputs or {},
            model=model or TINY_K3_PRESET,
            matrix=matrix or {},
            resources={"cpus": 1.0},
            run_dir=run_dir,
            stage_dir=stage_dir,
            output_dir=output,
            metrics=metrics,
            log=logging.getLogger(f"test-{run_dir.name}-{stage_id}"),
            progress_sink=hook,
        )

    def run(self, ctx: StageContext) -> dict[str, float]:
        """The final metrics of running `ctx`'s kind on it (its metrics writer closed either way)."""
        try:
            return dict(STAGE_KINDS.get(ctx.kind).run(ctx))
        finally:
            ctx.metrics.close()


# The rl stage body of the tiny RL tests: two iterations of one group of 6, 12-token single turns,
# tau close to 1 for every effort so usages straddle tau * b0 (the median) and groups have reward
# variance to learn from.
TINY_RL_BODY: dict = {
    "train": {"steps": 2, "lr": 1e-3},
    "rollout": {"prompts": 2, "groups_per_step": 1, "group_size": 6},
    "environments": {d: {"max_tokens_per_turn": 12, "max_turns": 1} for d in ("general", "agent", "coding")},
    "budget": {
        "cold_start": {"samples": 4},
        "tau": {
            "low": {"tau_start": 1.0, "tau_end": 0.9},
            "high": {"tau_start": 1.1, "tau_end": 1.0},
            "max": {"tau_start": 1.2, "tau_end": 1.1},
        },
    },
    "eval": {"prompts": 2},
}

_RUNNER = StageRunner()


def mopd_context(
    stage_dir: Path, body: dict[str, Any], inputs: dict[str, Path], *, progress: ProgressHook | None = None
) -> StageContext:
    """What orchestration.runner builds for a `mopd` stage in `stage_dir` (its name is the stage
    id): the validated body, RNGs seeded 0, metrics (no TensorBoard), checkpoints, a temp output
    dir. `progress(step, total, shown)` receives every ctx.progress call."""
    return _RUNNER.context(
        "mopd", stage_dir.parent, body, stage_id=stage_dir.name, inputs=inputs, progress=progress
    )


def run_mopd_stage(ctx: StageContext) -> dict[str, float]:
    """Run the registered `mopd` kind on `ctx` (closing its metrics writer either way)."""
    return _RUNNER.run(ctx)
