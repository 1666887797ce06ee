"""The run directory: per-stage manifests, locks, output hashes, and what is done or stale.

Layout (docs/orchestration.md):
  DIR/run.log, DIR/pipeline.json, DIR/report.md, DIR/plots/*.png
  DIR/restart.json               an unfinished --restart/--from (continue_restart)
  DIR/<stage>/manifest.json      status, config hash, inputs' hashes, timings, final metrics
  DIR/<stage>/stage.json         the validated stage the worker runs
  DIR/<stage>/stage.log          the worker's stdout/stderr (tracebacks land here)
  DIR/<stage>/progress.json      last reported step, for progress bars across processes/hosts
  DIR/<stage>/checkpoints/       step-N/ dirs and the `latest` pointer, removed when the stage is done
  DIR/<stage>/metrics.jsonl, DIR/<stage>/tensorboard/
  DIR/<stage>/model/             final model, renamed into place when the stage finishes

A stage is *done* when its manifest says so, its config hash equals the current one and the
hashes of its inputs (its needs' model/ dirs, the data files its kind reads) equal the ones it
was trained on. Everything is decided from manifests and the data files (no hashing of weights).
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestration.pipeline import Pipeline, Stage
from posttrain.checkpoint import CHECKPOINTS_DIR, latest_checkpoint_step
from posttrain.files import atomic_write_text, hash_tree, sha256_known

MANIFEST = "manifest.json"
LOCK = ".lock"
PROGRESS = "progress.json"
# DIR/pipeline.json: the stage file, overrides and stages (kinds, needs) of the last `run`.
PIPELINE = "pipeline.json"
PIPELINE_KEYS = frozenset({"file", "overrides", "stages"})
DAMAGED_PIPELINE = "is damaged (not the JSON record `posttrain run` writes)"


def stage_dir(run_dir: Path, stage_id: str) -> Path:
    return Path(run_dir) / stage_id


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):  # missing, or a path through a file (a bad --run-dir)
        return None
    return data if isinstance(data, dict) else None


def read_manifest(directory: Path) -> dict[str, Any] | None:
    return read_json(Path(directory) / MANIFEST)


def manifest_damage(directory: Path) -> str | None:
    """Why a stage's manifest.json is unusable (a disk that filled, a hand edit), or None when it
    reads or the stage has none. Its record (config hash, inputs, model hashes) is lost, so
    nothing of the stage can be vouched for: `run` starts it over."""
    path = Path(directory) / MANIFEST
    if not path.is_file() or read_json(path) is not None:
        return None
    return f"{path} is damaged (not a JSON mapping); `posttrain run` starts the stage over"


def write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    atomic_write_text(Path(directory) / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True) + "\n")


def planned_stages(pipeline: Pipeline) -> dict[str, dict[str, Any]]:
    """The stages pipeline.json records of a run: id -> its kind and needs, in the file's order."""
    return {sid: {"kind": s.kind, "needs": s.needs} for sid, s in pipeline.stages.items()}


def read_pipeline(run_dir: Path) -> dict[str, Any] | None:
    """DIR/pipeline.json as `write_pipeline` wrote it ({file, overrides, stages}), or None: there is
    none, or it is damaged (`pipeline_damaged`)."""
    record = read_json(Path(run_dir) / PIPELINE)
    return record if record is not None and PIPELINE_KEYS <= record.keys() else None


def pipeline_damaged(run_dir: Path) -> bool:
    """Whether DIR/pipeline.json is there but unusable (a disk that filled, a hand edit): what it
    records, the last run's stage file and stage order, is lost until `run` writes it again.
    Said as f"{path} {DAMAGED_PIPELINE}"."""
    return (Path(run_dir) / PIPELINE).is_file() and read_pipeline(run_dir) is None


def write_pipeline(run_dir: Path, pipeline: Pipeline, overrides: list[str]) -> None:
    """DIR/pipeline.json, rewritten by every `run`: atomically, since a kill mid-write would leave
    a truncated record, and `status` without the last run's stages and their order."""
    record = {"file": str(pipeline.root), "overrides": list(overrides), "stages": planned_stages(pipeline)}
    atomic_write_text(Path(run_dir) / PIPELINE, json.dumps(record, indent=1))


class StageLock:
    """Exclusive lock on a stage dir held by the process running the stage. The kernel drops it
    when that process dies, however it dies, so a held lock means "running right now"."""

    def __init__(self, directory: Path) -> None:
        self.path = Path(directory) / LOCK
        self._fd: int | None = None

    def acquire(self, wait_s: float) -> bool:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(fd)
                    return False
                time.sleep(0.1)
                continue
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
            self._fd = fd
            return True

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def holder(self) -> str:
        try:
            return self.path.read_text().strip()
        except FileNotFoundError:
            return "?"


def is_running(directory: Path) -> bool:
    path = Path(directory) / LOCK
    if not path.exists():
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def recorded_status(directory: Path, manifest: dict[str, Any]) -> str:
    """A stage's status as its dir records it: running while a process holds its lock, else its
    manifest's; a manifest a killed process left saying running is pending (it resumes), and a
    stage without a manifest is pending."""
    if is_running(directory):
        return "running"
    status = manifest.get("status", "pending")
    return "pending" if status == "running" else status


def recorded_damage(directory: Path, manifest: dict[str, Any], status: str) -> str | None:
    """Why a stage of recorded `status` is damaged, with the fix, or None: a done stage's model/
    no longer as its manifest recorded it, or a manifest.json that does not read."""
    damage = model_damage(directory, manifest) if status == "done" else None
    if damage:
        return f"{damage}; train it again with --restart {Path(directory).name}"
    return manifest_damage(directory)


@dataclass
class StageState:
    """What `plan` shows for one stage: status in done | stale | pending | running | failed,
    why, and the checkpoint step an unfinished stage would resume from."""

    status: str
    reason: str
    resume_step: int | None = None


# Prefix of an input that is a file the stage reads (its kind's `data_files`), not a need.
DATA_FILE = "file:"
# DIR/.data_stat.json: the size, mtime and sha256 of every data file last hashed for the run.
DATA_STAT = ".data_stat.json"


def input_hashes(pipeline: Pipeline, run_dir: Path, stage: Stage) -> dict[str, str | None]:
    """need id -> the model hash its manifest records (None when it has no finished model), and
    "file:<path>" -> the content hash of each local file or directory the stage's kind reads
    (posttrain.stages.stage_kind's `data_files`: an SFT's data)."""
    out: dict[str, str | None] = {}
    for need in stage.needs:
        manifest = read_manifest(stage_dir(run_dir, need)) or {}
        out[need] = manifest.get("model_hash") if manifest.get("status") == "done" else None
    paths = data_files(stage)
    if paths:
        known = read_json(run_dir / DATA_STAT) or {}
        before = dict(known)
        for path in paths:
            out[f"{DATA_FILE}{path}"] = content_hash(path, known)
        if known != before and run_dir.is_dir():  # `plan` of a run not started writes nothing
            atomic_write_text(run_dir / DATA_STAT, json.dumps(known, indent=1, sort_keys=True))
    return out


def data_files(stage: Stage) -> list[Path]:
    """The local files and directories `stage` reads, by its kind's `data_files` (resolved from
    the directory `posttrain run` runs in, as the stage resolves them)."""
    from posttrain.stages import STAGE_KINDS  # here: the kinds' registry loads the trainers

    kind = STAGE_KINDS.get(stage.kind)
    if kind.data_files is None:
        return []
    return sorted(Path(p).resolve() for p in kind.data_files(kind.config.model_validate(stage.body)))


def content_hash(path: Path, known: dict[str, list]) -> str:
    """sha256 of a file's bytes, or of a directory's listing of its files' sha256; files whose size
    and mtime are as `known` recorded them are not read again (posttrain.files.sha256_known)."""
    return hash_tree(path, known)[1] if path.is_dir() else sha256_known(path, known)


def changed_inputs(recorded: dict[str, str | None], current: dict[str, str | None]) -> list[str]:
    """The inputs whose hash differs from the one a stage recorded. A data file its manifest does
    not list was recorded before data files were hashed (or before the kind read it): not a change,
    so a run dir from an older posttrain keeps its finished stages."""
    return [
        name
        for name, digest in current.items()
        if recorded.get(name) != digest and not (name.startswith(DATA_FILE) and name not in recorded)
    ] + [name for name in recorded if name not in current]


def plan_states(pipeline: Pipeline, run_dir: Path) -> dict[str, StageState]:
    """The state of every stage, in dependency order."""
    states: dict[str, StageState] = {}
    for sid, stage in pipeline.stages.items():
        unfinished = [n for n in stage.needs if states[n].status != "done"]
        states[sid] = stage_state(pipeline, run_dir, stage, unfinished)
    return states


def stage_state(pipeline: Pipeline, run_dir: Path, stage: Stage, unfinished: list[str]) -> StageState:
    """The state of one stage given which of its needs are not done (yet)."""
    directory = stage_dir(run_dir, stage.id)
    manifest = read_manifest(directory)
    if is_running(directory):
        return StageState("running", f"pid {StageLock(directory).holder()}")
    if manifest is None:
        return StageState("pending", manifest_damage(directory) or "not started")
    if manifest.get("status") == "done":
        return _done_or_stale(pipeline, run_dir, stage, manifest, unfinished)
    same = manifest.get("config_hash") == stage.config_hash
    resume = latest_checkpoint_step(directory / CHECKPOINTS_DIR) if same else None
    status = "failed" if manifest.get("status") == "failed" else "pending"
    reason = manifest.get("error", "") if status == "failed" else "interrupted"
    if not same:
        reason = "config changed; starts over"
    elif resume is not None:
        reason += f"; resumes from step {resume}"
    return StageState(status, reason, resume)


def _done_or_stale(
    pipeline: Pipeline, run_dir: Path, stage: Stage, manifest: dict[str, Any], unfinished: list[str]
) -> StageState:
    if manifest.get("config_hash") != stage.config_hash:
        return StageState("stale", "config changed")
    if unfinished:
        return StageState("stale", f"needs {', '.join(unfinished)} to run first")
    changed = changed_inputs(manifest.get("inputs", {}), input_hashes(pipeline, run_dir, stage))
    if changed:
        shown = [name.removeprefix(DATA_FILE) for name in changed]
        return StageState("stale", f"input {', '.join(shown)} changed")
    if not (stage_dir(run_dir, stage.id) / "model").is_dir():
        return StageState("stale", "model/ is missing")
    damage = model_damage(stage_dir(run_dir, stage.id), manifest)
    if damage:
        return StageState("stale", f"{damage}; `run` trains it again (or pass --restart {stage.id})")
    return StageState("done", _finished_at(manifest))


def model_stat(model: Path) -> dict[str, list[int]]:
    """relative file -> [size, mtime_ns]: lets `plan` and `status` re-hash only files that changed."""
    return {
        str(p.relative_to(model)): [p.stat().st_size, p.stat().st_mtime_ns]
        for p in sorted(model.rglob("*"))
        if p.is_file()
    }


def model_damage(directory: Path, manifest: dict[str, Any], full: bool = False) -> str | None:
    """How a done stage's model/ differs from the sha256 its manifest recorded, or None when intact.
    Without `full`, a file whose size and mtime are as recorded is trusted without reading it."""
    from posttrain.checkpoint import sha256_file

    model = Path(directory) / "model"
    stats = manifest.get("model_stat", {})
    for name, digest in manifest.get("model_files", {}).items():
        path = model / name
        if not path.is_file():
            return f"model/{name} is missing"
        stat = path.stat()
        if not full and stats.get(name) == [stat.st_size, stat.st_mtime_ns]:
            continue
        if sha256_file(path) != digest:
            return f"model/{name} is damaged (its sha256 differs from the one in {MANIFEST})"
    return None


def verify_inputs(run_dir: Path, stage: Stage) -> None:
    """Before a stage loads its needs' models: every file as its need's manifest recorded it, read
    in full (a file changed in place with its mtime kept is caught here, not by `plan`)."""
    for need in stage.needs:
        directory = stage_dir(run_dir, need)
        damage = model_damage(directory, read_manifest(directory) or {}, full=True)
        if damage:
            raise DamagedModelError(
                f"stage {stage.id}: input {need}: {directory / 'model'}: {damage}; train it again with "
                f"`posttrain run FILE --restart {need}` (then {stage.id} reruns on the new weights)"
            )


class DamagedModelError(RuntimeError):
    """A need's published model no longer matches its manifest."""


# DIR/restart.json: the stages a `--restart`/`--from` asked to start over and those it has started
# over, so that the same command after an interruption continues that restart instead of beginning
# it again (which would throw away the progress of a stage it had started, or even finished).
RESTART = "restart.json"


def continue_restart(run_dir: Path, forced: set[str]) -> set[str]:
    """The stages this run must start over: `forced` (the command's `--restart`/`--from` stages),
    less those an interrupted run of the same request already started over (they resume, or are
    done). A run with another request, or none, begins a new record."""
    path = Path(run_dir) / RESTART
    record = read_json(path)
    if forced and record is not None and set(record.get("forced", [])) == forced:
        return forced - set(record.get("started", []))
    if forced:
        atomic_write_text(path, json.dumps({"forced": sorted(forced), "started": []}) + "\n")
    else:
        path.unlink(missing_ok=True)
    return forced


def restart_started(run_dir: Path, stage_id: str) -> None:
    """Record that the current restart request has started `stage_id` over."""
    path = Path(run_dir) / RESTART
    record = read_json(path) or {"forced": [stage_id], "started": []}
    record["started"] = sorted({*record.get("started", []), stage_id})
    atomic_write_text(path, json.dumps(record) + "\n")


def restart_finished(run_dir: Path) -> None:
    """Every stage of the restart ran to the end: the next `--restart` is a new one."""
    (Path(run_dir) / RESTART).unlink(missing_ok=True)


def _finished_at(manifest: dict[str, Any]) -> str:
    finished = manifest.get("finished")
    return time.strftime("finished %Y-%m-%d %H:%M", time.localtime(finished)) if finished else "finished"


def read_progress(directory: Path) -> dict[str, Any] | None:
    return read_json(Path(directory) / PROGRESS)
