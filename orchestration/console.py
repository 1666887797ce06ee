"""What the CLI prints: the plan table, live progress bars, the final summary and `status`.

Kept apart from posttrain/cli.py so the CLI stays a thin argument front and the rendering can be
read (and changed) in one place.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from orchestration.executors import Outcome
from orchestration.pipeline import Pipeline
from orchestration.report import headline_order, is_timing
from orchestration.rundir import (
    DAMAGED_PIPELINE,
    PIPELINE,
    StageState,
    pipeline_damaged,
    read_manifest,
    read_pipeline,
    read_progress,
    recorded_damage,
    recorded_status,
    stage_dir,
)
from posttrain.checkpoint import CHECKPOINTS_DIR, latest_checkpoint_step
from posttrain.config.errors import ConfigError

STATUS_STYLE = {
    "done": "green",
    "skipped": "green",
    "stale": "yellow",
    "pending": "cyan",
    "running": "magenta",
    "failed": "red",
    "blocked": "red",
    "damaged": "red",
}


def print_config_error(
    console: Console, error: ConfigError, title: str = "invalid stage configuration"
) -> None:
    count = len(error.issues)
    console.print(f"[bold red]posttrain: {title}[/] ({count} problem{'s' * (count > 1)}):", highlight=False)
    for issue in error.issues:
        console.print(f"  {issue}", markup=False, highlight=False, soft_wrap=True)


def _needs(needs: list[str]) -> str:
    return ", ".join(needs) if len(needs) <= 3 else f"{needs[0]} +{len(needs) - 1}"


def plan_table(pipeline: Pipeline, states: dict[str, StageState]) -> Table:
    table = Table(title=f"plan: {pipeline.root.name} ({len(pipeline.stages)} stages)", title_justify="left")
    for column in ("stage", "kind", "needs", "status", "detail"):
        table.add_column(column, no_wrap=column != "detail")
    if pipeline.unregistered:
        table.caption = "* kind not registered: its keys cannot be checked and the stage cannot run"
    for sid, stage in pipeline.stages.items():
        state = states[sid]
        kind = stage.kind if stage.registered else f"{stage.kind}*"
        style = STATUS_STYLE.get(state.status, "")
        table.add_row(sid, kind, _needs(stage.needs), f"[{style}]{state.status}[/]", escape(state.reason))
    return table


def _metrics_text(metrics: dict[str, Any], limit: int = 4) -> str:
    items = [(k, v) for k, v in headline_order(metrics) if not is_timing(k)]  # timings: in the manifest
    text = ", ".join(f"{k}={v:.4g}" for k, v in items[:limit])
    return text + (f" (+{len(items) - limit})" if len(items) > limit else "")


def summary_table(pipeline: Pipeline, run_dir: Path, outcome: Outcome) -> Table:
    table = Table(title=f"summary: {run_dir}", title_justify="left")
    for column in ("stage", "status", "time (s)", "attempts", "final metrics"):
        table.add_column(column)
    for sid in outcome.status:
        manifest = read_manifest(stage_dir(run_dir, sid)) or {}
        status = outcome.status[sid]
        seconds = manifest.get("run_seconds")
        detail = _metrics_text(manifest.get("metrics", {}))
        if status == "failed":
            detail = manifest.get("error", "") + f"  (log: {stage_dir(run_dir, sid) / 'stage.log'})"
        table.add_row(
            sid,
            f"[{STATUS_STYLE[status]}]{status}[/]",
            f"{seconds:.1f}" if seconds else "",
            str(manifest.get("attempts", "")),
            escape(detail),
        )
    return table


def summary_lines(run_dir: Path, outcome: Outcome) -> list[str]:
    """The summary as plain lines, for output that is not a terminal: nothing is cut to a width."""
    lines = [f"summary: {run_dir}"]
    for sid, status in outcome.status.items():
        manifest = read_manifest(stage_dir(run_dir, sid)) or {}
        seconds = manifest.get("run_seconds")
        time_text = f" {seconds:.1f}s" if seconds else ""
        if status == "failed":
            detail = f"{manifest.get('error', '')} (log: {stage_dir(run_dir, sid) / 'stage.log'})"
        else:
            detail = _metrics_text(manifest.get("metrics", {}))
        lines.append(f"  {sid}: {status}{time_text}" + (f", {detail}" if detail else ""))
    return lines


def status_table(run_dir: Path) -> tuple[Table, str | None]:
    """The run dir as its manifests describe it (no stage files needed), and a note naming the
    stages it holds from another stage file (None when there are none)."""
    plan = read_pipeline(run_dir) or {}
    listed = list(plan.get("stages", {}))
    # Stages of another stage file run in this dir earlier keep their results here: shown after
    # the last run's own (pipeline.json lists only those), not hidden.
    others = sorted(p.parent.name for p in run_dir.glob("*/manifest.json") if p.parent.name not in listed)
    order = listed + others
    note = (
        f"{', '.join(others)}: not stages of the last run's file ({plan.get('file', '?')})"
        if listed and others
        else None
    )
    if pipeline_damaged(run_dir):
        # Without it the stage order and the run's stage file are unknown: say why the table is
        # in name order and holds only the stages that have started.
        note = (
            f"{run_dir / PIPELINE} {DAMAGED_PIPELINE}: the stages are listed from their manifests, in "
            "name order; `posttrain run FILE --run-dir DIR` writes it again (finished stages are not "
            "run again)"
        )
    table = Table(title=f"status: {run_dir}", title_justify="left")
    for column in ("stage", "status", "progress", "attempts", "time (s)", "final metrics / error"):
        table.add_column(column)
    for sid in order:
        directory = stage_dir(run_dir, sid)
        manifest = read_manifest(directory) or {}
        status = recorded_status(directory, manifest)
        progress = read_progress(directory) or {}
        step = progress.get("step", latest_checkpoint_step(directory / CHECKPOINTS_DIR))
        shown = f"{step}/{progress.get('total') or '?'}" if step is not None else ""
        seconds = manifest.get("run_seconds")
        detail = (
            manifest.get("error", "") if status == "failed" else _metrics_text(manifest.get("metrics", {}))
        )
        if damage := recorded_damage(directory, manifest, status):
            status, detail = "damaged", damage
        table.add_row(
            sid,
            f"[{STATUS_STYLE.get(status, '')}]{status}[/]",
            shown,
            str(manifest.get("attempts", 0)),
            f"{seconds:.1f}" if seconds else "",
            escape(detail),
        )
    return table, note


class RichDisplay:
    """Progress bars: one for the whole DAG, one per running stage (steps from ctx.progress)."""

    def __init__(self, console: Console, total: int) -> None:
        self.bars = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[shown]}"),
            console=console,
        )
        self.overall = self.bars.add_task("stages", total=total, shown="")
        self.tasks: dict[str, Any] = {}
        self.started_at: dict[str, float] = {}

    def __enter__(self) -> RichDisplay:
        self.bars.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.bars.stop()

    def started(self, stage_id: str) -> None:
        self.tasks[stage_id] = self.bars.add_task(f"  {stage_id}", total=None, shown="starting")
        self.started_at[stage_id] = time.monotonic()

    def progress(self, stage_id: str, record: dict[str, Any]) -> None:
        shown = " ".join(f"{k}={v}" for k, v in record.get("shown", {}).items())
        self.bars.update(
            self.tasks[stage_id], completed=record.get("step", 0), total=record.get("total"), shown=shown
        )

    def finished(self, stage_id: str, status: str) -> None:
        style = STATUS_STYLE.get(status, "")
        if stage_id in self.tasks:
            task = self.tasks[stage_id]
            total = self.bars.tasks[task].total
            self.bars.update(
                task,
                description=f"  {stage_id} [{style}]{status}[/]",
                completed=total if status == "done" and total else self.bars.tasks[task].completed,
            )
            self.bars.stop_task(task)
        self.bars.advance(self.overall)


class LineDisplay:
    """Progress as plain lines, for output that is not a terminal (CI, nohup, `| tee`), where
    progress bars would print nothing until the end: a line when a stage starts and ends, and a
    progress line at every tenth of its steps (and at least every PROGRESS_EVERY_S seconds)."""

    PROGRESS_EVERY_S = 60.0

    def __init__(self, console: Console, total: int) -> None:
        self.console = console
        self.total = total
        self.finished_count = 0
        self.started_at: dict[str, float] = {}
        self.last: dict[str, tuple[int, float]] = {}  # stage -> (tenth of steps, time) last shown

    def __enter__(self) -> LineDisplay:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def _print(self, text: str) -> None:
        stamp = time.strftime("%H:%M:%S")
        self.console.print(f"{stamp} {text}", markup=False, highlight=False, soft_wrap=True)
        self.console.file.flush()

    def started(self, stage_id: str) -> None:
        self.started_at[stage_id] = time.monotonic()
        self.last[stage_id] = (-1, time.monotonic())
        self._print(f"{stage_id} started")

    def progress(self, stage_id: str, record: dict[str, Any]) -> None:
        step, total = int(record.get("step", 0)), record.get("total")
        tenth = int(10 * step / total) if total else step
        shown_tenth, shown_at = self.last.get(stage_id, (-1, 0.0))
        now = time.monotonic()
        if tenth == shown_tenth and now - shown_at < self.PROGRESS_EVERY_S:
            return
        self.last[stage_id] = (tenth, now)
        values = " ".join(f"{k}={v}" for k, v in record.get("shown", {}).items())
        self._print(f"{stage_id} step {step}/{total or '?'}" + (f" {values}" if values else ""))

    def finished(self, stage_id: str, status: str) -> None:
        self.finished_count += 1
        started = self.started_at.get(stage_id)
        took = f" in {time.monotonic() - started:.1f}s" if started is not None else ""
        self._print(f"{stage_id} {status}{took} ({self.finished_count}/{self.total} stages)")
