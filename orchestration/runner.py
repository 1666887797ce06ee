"""Run one stage in the current process: the worker behind the local and the Ray executors.

The driver writes DIR/<stage>/stage.json (the validated stage, its inputs' hashes, whether to
start over) and starts a process or a Ray task calling `run_stage`. The worker takes the stage
lock, decides between resuming and starting over (a changed config or input discards the old
checkpoints), seeds every RNG, calls the kind's `run`, and renames the finished model into place
before marking the manifest done. Every step is safe to kill: the next attempt repeats it.

`python -m orchestration.runner DIR STAGE` runs one prepared stage in the foreground (to debug a
failed stage, e.g. under pdb).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import select
import signal
import socket
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from orchestration.pipeline import Pipeline, Stage
from orchestration.publish_guard import check_publishable
from orchestration.rundir import (
    LOCK,
    PROGRESS,
    StageLock,
    changed_inputs,
    input_hashes,
    manifest_damage,
    model_stat,
    read_json,
    read_manifest,
    stage_dir,
    verify_inputs,
    write_manifest,
)
from posttrain.checkpoint import CHECKPOINTS_DIR
from posttrain.files import (
    atomic_write_text,
    fsync_dir,
    fsync_file,
    hash_tree,
    process_running,
    remove_trash,
    remove_tree,
)
from posttrain.metrics import MetricsLogger
from posttrain.registry import import_plugin, load_plugins
from posttrain.stages import STAGE_KINDS, StageContext, build_context

REQUEST = "stage.json"
STAGE_LOG = "stage.log"
RUN_LOG = "run.log"
MODEL_DIR = "model"
# Files that outlive a restart: the request being run, the log of every attempt, the lock.
KEPT_ON_RESTART = {REQUEST, STAGE_LOG, LOCK}
# After `kill -9` of the driver, its workers die a moment later (parent-death signal); a rerun
# waits this long for their locks instead of failing.
LOCK_WAIT_S = 30.0
EXIT_BUSY = 3


def write_request(pipeline: Pipeline, run_dir: Path, stage_id: str, restart: bool) -> None:
    """Driver side: record what the worker must run (called once the stage's needs are done)."""
    stage = pipeline.stages[stage_id]
    directory = stage_dir(run_dir, stage_id)
    directory.mkdir(parents=True, exist_ok=True)
    request = {
        "stage": asdict(stage),
        "inputs": input_hashes(pipeline, run_dir, stage),
        "restart": restart,
    }
    # Atomic: a driver killed mid-write must not leave the next worker a truncated request.
    atomic_write_text(directory / REQUEST, json.dumps(request, indent=1, sort_keys=True))
    (directory / PROGRESS).unlink(missing_ok=True)  # an earlier attempt's steps are not this one's


class RequestError(RuntimeError):
    """DIR/<stage>/stage.json is missing or damaged: the message names it and how to write it."""


def read_request(run_dir: Path, stage_id: str) -> tuple[dict[str, Any], Stage]:
    """The request `write_request` recorded for `stage_id` and the stage in it. A damaged one (a
    hand edit, a file from another posttrain) is named as such, not as missing."""
    path = stage_dir(run_dir, stage_id) / REQUEST
    fix = f"`posttrain run FILE --run-dir {run_dir} --only {stage_id}` writes it (and runs the stage)"
    if not path.is_file():
        raise RequestError(f"{path} is missing: the driver writes it before starting a worker; {fix}")
    request = read_json(path)
    try:
        if request is None or not isinstance(request["inputs"], dict) or "restart" not in request:
            raise TypeError("not a stage request")
        return request, Stage(**request["stage"])
    except (KeyError, TypeError):  # not JSON, a key missing, or a stage with other fields
        raise RequestError(f"{path} is damaged (not the stage request the driver writes); {fix}") from None


def run_stage(run_dir: Path | str, stage_id: str, executor: str = "local") -> int:
    """Run stage `stage_id` of `run_dir` to completion; 0 done, 1 failed, EXIT_BUSY locked."""
    run_dir = Path(run_dir).resolve()
    directory = stage_dir(run_dir, stage_id)
    request, stage = read_request(run_dir, stage_id)
    log, warnings = _stage_logger(run_dir, stage_id)
    lock = StageLock(directory)
    if not lock.acquire(wait_s=LOCK_WAIT_S):
        log.error("stage %s is being run by another process (pid %s)", stage_id, lock.holder())
        return EXIT_BUSY
    try:
        return _run_locked(run_dir, stage, request, executor, log, warnings)
    finally:
        lock.release()
        for handler in list(log.handlers):
            handler.close()
            log.removeHandler(handler)


def _run_locked(
    run_dir: Path,
    stage: Stage,
    request: dict[str, Any],
    executor: str,
    log: logging.Logger,
    warnings: list[str],
) -> int:
    directory = stage_dir(run_dir, stage.id)
    old = read_manifest(directory) or {}
    if damage := manifest_damage(directory):
        log.warning("%s", damage)
    inputs = request["inputs"]
    if (
        request["restart"]
        or old.get("config_hash") != stage.config_hash
        or changed_inputs(old.get("inputs", {}), inputs)
    ):
        _clear(directory)
        old = {}
    started = time.time()
    manifest = {
        "stage": stage.id,
        "kind": stage.kind,
        "status": "running",
        "config_hash": stage.config_hash,
        "inputs": inputs,
        "needs": stage.needs,
        "matrix": stage.matrix,
        "file": stage.file,
        "attempts": old.get("attempts", 0) + 1,
        "created": old.get("created", started),
        "started": started,
        "run_seconds": old.get("run_seconds", 0.0),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "executor": executor,
        "metrics": {},
        "warnings": [],
    }
    write_manifest(directory, manifest)
    output = directory / ".model-tmp"
    remove_trash(directory)  # what an earlier attempt, killed while deleting, left behind
    remove_tree(output)
    remove_tree(directory / MODEL_DIR)  # left by a kill between its rename and the manifest update
    output.mkdir()
    metrics = MetricsLogger(directory)
    try:
        log.info("stage %s (%s) starting, attempt %d", stage.id, stage.kind, manifest["attempts"])
        verify_inputs(run_dir, stage)
        ctx = _context(run_dir, stage, output, metrics, log, manifest)
        result = STAGE_KINDS.get(stage.kind).run(ctx)
        metrics.close()
        final = {name: float(value) for name, value in dict(result or {}).items()}
        if not any(output.iterdir()):
            raise RuntimeError(
                f"stage kind {stage.kind!r} wrote nothing to ctx.output_dir; a stage saves its model there"
            )
        for note in check_publishable(stage.id, ctx.config, output, ctx.inputs, ctx.model):
            log.info("stage %s: %s", stage.id, note)
        model = _commit(output, directory / MODEL_DIR)
        files, digest = hash_tree(model)
        manifest.update(
            status="done", metrics=final, model_hash=digest, model_files=files, model_stat=model_stat(model)
        )
        log.info(
            "stage %s done: %s", stage.id, ", ".join(f"{k}={v:.4g}" for k, v in final.items()) or "no metrics"
        )
        return 0
    except BaseException as exc:  # KeyboardInterrupt too: the manifest must say the stage stopped
        metrics.close()
        remove_tree(output)  # an unpublished model is never used; the next attempt starts it anew
        manifest.update(status="failed", error=f"{type(exc).__name__}: {exc}")
        # not also a warning: the manifest's `error` and the driver's summary already say it failed
        log.exception("stage %s failed", stage.id, extra={NOT_A_WARNING: True})
        if not isinstance(exc, Exception):
            raise
        return 1
    finally:
        finished = time.time()
        manifest.update(
            finished=finished, run_seconds=manifest["run_seconds"] + finished - started, warnings=warnings
        )
        write_manifest(directory, manifest)
        if manifest["status"] == "done":
            # A done stage is never resumed (a changed config or input starts it over), so its
            # checkpoints (at 3.5B parameters 42 GB each) only fill the disk the next stage needs.
            remove_tree(directory / CHECKPOINTS_DIR)


def _context(
    run_dir: Path,
    stage: Stage,
    output: Path,
    metrics: MetricsLogger,
    log: logging.Logger,
    manifest: dict[str, Any],
) -> StageContext:
    load_plugins()
    for spec in stage.plugins:
        import_plugin(spec)

    def restored(step: int) -> None:
        manifest["resumed_from_step"] = step
        if step:
            log.info("stage %s resumes from checkpoint step %d", stage.id, step)

    inputs = {need: stage_dir(run_dir, need) / MODEL_DIR for need in stage.needs}
    model = inputs[stage.model] if stage.model_is_input else (Path(stage.model) if stage.model else None)
    _set_threads(stage.resources.get("cpus", 1.0))
    directory = stage_dir(run_dir, stage.id)
    return build_context(
        stage_id=stage.id,
        kind=stage.kind,
        body=stage.body,
        seed=stage.seed,
        qat=stage.qat,
        inputs=inputs,
        model=model,
        matrix=stage.matrix,
        resources=stage.resources,
        run_dir=run_dir,
        stage_dir=directory,
        output_dir=output,
        metrics=metrics,
        log=log,
        progress_sink=_ProgressFile(directory / PROGRESS),
        on_restore=restored,
        keep_checkpoints=stage.keep_checkpoints,
    )


def _set_threads(cpus: float) -> None:
    """One intra-op thread per requested CPU. The count is part of what makes a resumed run
    bit-identical (reductions split differently across threads), and oversubscribing a small
    machine with concurrent stages made a stage about 10x slower than one thread (measured). How
    idle threads wait (OMP_WAIT_POLICY) is the user's: it changes speed, never a number
    (orchestration.executors._fork_server says what was measured)."""
    import torch

    torch.set_num_threads(max(1, int(cpus)))


def _clear(directory: Path) -> None:
    """Start the stage over: drop checkpoints, metrics and outputs of the previous config."""
    for path in directory.iterdir():
        if path.name in KEPT_ON_RESTART:
            continue
        if path.is_dir():
            remove_tree(path)
        else:
            path.unlink()


def _commit(output: Path, final: Path) -> Path:
    """Make the finished model durable, then visible under its final name in one rename. Files
    get the mode a plain write gives (some writers create 0600 temp files and rename them), so
    whoever may read the run dir may read the model."""
    mode = 0o666 & ~_umask()
    for path in output.rglob("*"):
        if path.is_file():
            path.chmod(mode)
            fsync_file(path)
    for path in [output, *(p for p in output.rglob("*") if p.is_dir())]:
        fsync_dir(path)
    os.rename(output, final)
    fsync_dir(final.parent)
    return final


def _umask() -> int:
    """This process's umask, read without changing it (os.umask would, for a moment, under the
    stage's other threads)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("Umask:"):
            return int(line.split()[1], 8)
    return 0o022


class _ProgressFile:
    """StageContext.progress -> DIR/<stage>/progress.json, which the driver polls (works the same
    for a local child process and a Ray task on another host sharing the run dir)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.last = 0.0

    def __call__(self, step: int, total: int | None, shown: dict[str, Any]) -> None:
        now = time.monotonic()
        if now - self.last < 0.2 and step != total:
            return
        self.last = now
        tmp = self.path.with_suffix(".tmp")
        record = {
            "step": step,
            "total": total,
            "shown": {k: _short(v) for k, v in shown.items()},
            "time": time.time(),
        }
        tmp.write_text(json.dumps(record), encoding="utf-8")
        os.replace(tmp, self.path)  # no fsync: a lost progress update costs nothing


def _short(value: Any) -> Any:
    try:
        return float(f"{float(value):.4g}")
    except (TypeError, ValueError):
        return str(value)


# A log record's attribute that keeps it out of the manifest's `warnings` (the stage's own failure).
NOT_A_WARNING = "not_a_warning"


class _WarningCollector(logging.Handler):
    def __init__(self, sink: list[str]) -> None:
        super().__init__(logging.WARNING)
        self.sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        if not getattr(record, NOT_A_WARNING, False):
            self.sink.append(record.getMessage())


def _stage_logger(run_dir: Path, stage_id: str) -> tuple[logging.Logger, list[str]]:
    log = logging.getLogger(f"posttrain.stage.{stage_id}")
    log.setLevel(logging.INFO)
    log.propagate = False
    formatter = logging.Formatter(f"%(asctime)s [{stage_id}] %(levelname)s %(message)s")
    for path in (run_dir / RUN_LOG, stage_dir(run_dir, stage_id) / STAGE_LOG):
        handler = logging.FileHandler(path, encoding="utf-8")
        handler.setFormatter(formatter)
        log.addHandler(handler)
    warnings: list[str] = []
    log.addHandler(_WarningCollector(warnings))
    return log, warnings


def exit_with_driver(driver_pid: int) -> None:
    """SIGKILL this stage process the moment the driver process dies (however it dies), so no
    orphan keeps writing into the run dir while a rerun resumes the stage. A pidfd wakes the
    watcher at once; kernels without pidfd_open are polled."""
    try:
        pidfd = os.pidfd_open(driver_pid)
    except ProcessLookupError:
        os._exit(1)
    except OSError:
        pidfd = None

    def watch() -> None:
        if pidfd is not None:
            select.select([pidfd], [], [])
        else:
            while process_running(driver_pid):
                time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="exit-with-driver", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m orchestration.runner", description=__doc__.splitlines()[0]
    )
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("stage")
    parser.add_argument("--executor", default="local")
    args = parser.parse_args(argv)
    try:
        return run_stage(args.run_dir, args.stage, args.executor)
    except RequestError as error:  # the user's mistake (a wrong DIR or STAGE), not a traceback
        print(f"{parser.prog}: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
