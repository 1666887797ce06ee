"""Stage kinds: the contract between the orchestrator and the code that trains.

A stage kind (sft, rl, mopd, or a user's own) is a pydantic class for the kind-specific keys of its
YAML file plus a function `run(ctx) -> final metrics`. The orchestrator validates the file, decides
whether the stage must run, prepares its directory and calls `run` in a fresh process with a
`StageContext`: everything the stage may touch is on it, so a kind never reads CLI flags, env vars
or paths of its own invention. Register one with::

    class SFTConfig(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        steps: int = 100

    @stage_kind("sft", config=SFTConfig)
    def run_sft(ctx: StageContext) -> dict[str, float]:
        ...

and list the module (or .py file) under `plugins:` in the stage file, or ship it in a package
exposed through the `posttrain.plugins` entry-point group.
"""

from __future__ import annotations

import logging
import random
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from posttrain.checkpoint import CHECKPOINTS_DIR, KEEP_CHECKPOINTS, CheckpointManager
from posttrain.config.stage_file import models_in
from posttrain.metrics import MetricsLogger
from posttrain.registry import Registry

# What an evaluating stage kind writes in its stage dir, read back by the run's report
# (orchestration/report.py, outcomes.py) and by bench/: the evaluation with its standard errors,
# and (MOPD) the episodes behind it, before and after training.
EVAL_FILE = "eval.json"
EPISODES_FILE = "eval_episodes.json"


class NoConfig(BaseModel):
    """The body of a kind that takes no keys of its own."""

    model_config = ConfigDict(extra="forbid")


@dataclass
class StageContext:
    """What a running stage gets. All paths are absolute.

    stage_id: e.g. "sft", "rl-coding-max", "mopd".
    kind: the registered kind name.
    config: the kind's pydantic config, validated from the stage file's kind-specific keys (with
      command-line overrides applied).
    seed: the stage's seed. python/numpy/torch RNGs are already seeded with it when `run` starts.
    inputs: need stage id -> that stage's finished Hugging Face model dir (DIR/<need>/model).
    model: the stage file's `model`: a preset file (.yaml/.json, for load_model_config) or, when
      it names a need, that need's model dir; None when the file has no `model`.
    qat: posttrain.qat.config.QATConfig validated from `qat:`, or None.
    matrix: this instance's matrix values, e.g. {"domain": "coding", "effort": "max"}; {} if none.
    resources: {"cpus": float, "gpus": float} requested in the stage file.
    stage_dir: DIR/<stage_id>; scratch files of the kind may go here.
    output_dir: write the final model here (save_pretrained, tokenizer, ...). It is a temp dir;
      when `run` returns, the orchestrator fsyncs it, hashes it and renames it to
      DIR/<stage_id>/model atomically. It must not be empty.
    metrics: MetricsLogger for metrics.jsonl + TensorBoard: `ctx.metrics.log(step, loss=...)`.
    checkpoints: CheckpointManager under DIR/<stage_id>/checkpoints (keeps the stage file's
      `keep_checkpoints`, 3 unless set; 0 writes none). Its `load` also cuts metrics.jsonl back to what had
      been logged when the restored checkpoint was saved, so log a step's metrics before saving.
    log: logger writing to DIR/run.log (prefixed with the stage id) and the stage's stage.log.
    """

    stage_id: str
    kind: str
    config: Any
    seed: int
    inputs: dict[str, Path]
    model: Path | None
    qat: Any
    matrix: dict[str, Any]
    resources: dict[str, float]
    run_dir: Path
    stage_dir: Path
    output_dir: Path
    metrics: MetricsLogger
    checkpoints: CheckpointManager
    log: logging.Logger
    progress_sink: Callable[[int, int | None, dict[str, Any]], None] = field(
        repr=False, default=lambda *a: None
    )

    def progress(self, step: int, total: int | None = None, **shown: Any) -> None:
        """Report that `step` of `total` steps is done; `shown` values (e.g. loss=0.31) appear
        next to the stage's progress bar. Cheap enough to call every step."""
        self.progress_sink(step, total, shown)


def build_context(
    *,
    stage_id: str,
    kind: str,
    body: Mapping[str, Any],
    seed: int,
    qat: Mapping[str, Any] | None,
    inputs: Mapping[str, Path],
    model: Path | None,
    matrix: Mapping[str, Any],
    resources: Mapping[str, float],
    run_dir: Path,
    stage_dir: Path,
    output_dir: Path,
    metrics: MetricsLogger,
    log: logging.Logger,
    progress_sink: Callable[[int, int | None, dict[str, Any]], None],
    on_restore: Callable[[int], None] | None = None,
    keep_checkpoints: int = KEEP_CHECKPOINTS,
) -> StageContext:
    """The StageContext a stage kind runs on, built one way for orchestration.runner and for
    posttrain.testing.StageRunner: the body validated by the kind's config class, `qat` by
    posttrain.qat.QATConfig, python/numpy/torch seeded with `seed`, checkpoints under
    stage_dir/checkpoints (the last `keep_checkpoints` kept) that cut `metrics` back on restore."""
    import numpy as np
    import torch

    from posttrain.qat.config import QATConfig  # here, not at the top: posttrain.qat imports torch

    config = STAGE_KINDS.get(kind).config.model_validate(dict(body))
    qat_config = None if qat is None else QATConfig.model_validate(dict(qat))
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    return StageContext(
        stage_id=stage_id,
        kind=kind,
        config=config,
        seed=seed,
        inputs=dict(inputs),
        model=model,
        qat=qat_config,
        matrix=dict(matrix),
        resources=dict(resources),
        run_dir=run_dir,
        stage_dir=stage_dir,
        output_dir=output_dir,
        metrics=metrics,
        checkpoints=CheckpointManager(
            stage_dir / CHECKPOINTS_DIR,
            keep=keep_checkpoints,
            log=log,
            metrics=metrics,
            on_restore=on_restore,
        ),
        log=log,
        progress_sink=progress_sink,
    )


StageRun = Callable[[StageContext], Mapping[str, float]]


# The local files and directories a stage of a kind reads besides its needs' models (an SFT's
# data files), from its validated config: their content decides the result as much as the config.
DataFiles = Callable[[Any], list[Path]]


@dataclass(frozen=True)
class StageKind:
    """A registered kind: its name, the pydantic class of its YAML body, its run function, and
    which local files its stages read (None: none)."""

    name: str
    config: type[BaseModel]
    run: StageRun
    data_files: DataFiles | None = None


STAGE_KINDS: Registry[StageKind] = Registry("stage kind")


def stage_kind(
    name: str, config: type[BaseModel] | None = None, data_files: DataFiles | None = None
) -> Callable[[StageRun], StageRun]:
    """Decorator registering `run(ctx) -> {metric: float}` as stage kind `name`.

    `config` validates the stage file's keys other than the generic ones (stage, kind, needs,
    model, seed, resources, qat, plugins, matrix, description). It and every nested model must
    forbid unknown keys, so a misspelled key is an error rather than a silently ignored default.
    `data_files(config)` lists the local files and directories a stage reads besides its needs'
    models (the data a user names): the run hashes their content with the needs' model hashes, so
    editing one makes a done stage stale and an interrupted one start over instead of resuming on
    other data.
    """
    config = config or NoConfig
    _require_forbid(config, config.__name__)

    def decorator(run: StageRun) -> StageRun:
        STAGE_KINDS.register(name)(StageKind(name, config, run, data_files))
        return run

    return decorator


def _require_forbid(model: type[BaseModel], where: str, seen: set[type] | None = None) -> None:
    seen = seen if seen is not None else set()
    if model in seen:
        return
    seen.add(model)
    if model.model_config.get("extra") != "forbid":
        raise TypeError(
            f"stage kind config {where} ({model.__name__}) must set "
            "model_config = ConfigDict(extra='forbid') so misspelled keys are errors"
        )
    for name, info in model.model_fields.items():
        for nested in models_in(info.annotation):
            _require_forbid(nested, f"{where}.{name}", seen)


def keys_table(config: type[BaseModel]) -> str:
    """A kind's stage-file keys as a markdown table (key, default, meaning), read from its pydantic
    schema, nested models as dotted keys: the docs' key tables are this, not a hand-kept copy
    (tests/test_docs_keys.py). `python -m posttrain.stages KIND` prints it."""
    rows = ["| key | default | meaning |", "| --- | --- | --- |"]
    for key, default, meaning in _key_rows(config, ""):
        rows.append(f"| `{key}` | {default} | {meaning} |")
    return "\n".join(rows) + "\n"


def _key_rows(config: type[BaseModel], prefix: str) -> list[tuple[str, str, str]]:
    rows = []
    for name, info in config.model_fields.items():
        key, annotation = f"{prefix}{name}", info.annotation
        nested = models_in(annotation)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            rows += _key_rows(annotation, f"{key}.")
            continue
        value_type = typing.get_args(annotation)[-1] if typing.get_origin(annotation) is dict else None
        if isinstance(value_type, type) and issubclass(value_type, BaseModel):
            rows += _key_rows(value_type, f"{key}.<name>.")
            continue
        if info.is_required():
            default = "required"
        else:
            value = info.get_default(call_default_factory=True)
            default = "null" if value is None else f"`{value}`"
        meaning = (info.description or "").replace("|", "\\|").replace("\n", " ")
        if nested:  # an optional block: its keys
            meaning = f"{meaning} (keys: {', '.join(nested[0].model_fields)})".strip()
        rows.append((key, default, meaning))
    return rows


if __name__ == "__main__":
    import sys

    from posttrain import stages  # the registry the plug-ins fill, not this __main__ copy's

    print(stages.keys_table(stages.STAGE_KINDS.get(sys.argv[1]).config), end="")
