"""Executors: run the stages of a pipeline in dependency order, locally or on a Ray cluster.

Both share one driver loop; they differ only in how a stage is started and watched.
Local: each stage is its own process, forked from a server process that has torch and the
plug-ins imported, as many at a time as their `resources.cpus` fit in this machine's CPUs and
their `resources.gpus` its free GPUs (and at most `max_parallel`); a stage sees only the GPUs it
was given (CUDA_VISIBLE_DEVICES, none for a stage asking for 0), so one-GPU stages on a one-GPU
machine run one after another. A stage process kills itself when the driver dies, so `kill -9`
of `posttrain run` stops everything and the rerun resumes.
Ray: each stage is a Ray task on a fresh worker process with the stage file's cpus/gpus as its
resource request; the run dir must be on storage every node sees.

Whether a stage runs is decided when its needs have finished, from the manifests as they are
then: a rerun need that produced the same weights (same hash) leaves its dependants done.
"""

from __future__ import annotations

import functools
import math
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from orchestration.pipeline import Pipeline
from orchestration.rundir import (
    is_running,
    read_manifest,
    read_progress,
    restart_started,
    stage_dir,
    stage_state,
    write_manifest,
)
from orchestration.runner import EXIT_BUSY, STAGE_LOG, exit_with_driver, run_stage, write_request
from posttrain.checkpoint import CHECKPOINTS_DIR
from posttrain.config.errors import ConfigError, Issue
from posttrain.config.overrides import apply_overrides, parse_overrides
from posttrain.config.stage_file import relative_display
from posttrain.config.yaml_source import line_of, load_yaml
from posttrain.files import remove_trash, remove_tree

REPO_ROOT = Path(__file__).resolve().parent.parent
POLL_S = 0.2


class Display(Protocol):
    """What the driver reports as it goes (the CLI draws progress bars from it)."""

    def started(self, stage_id: str) -> None: ...
    def progress(self, stage_id: str, record: dict[str, Any]) -> None: ...
    def finished(self, stage_id: str, status: str) -> None: ...


class QuietDisplay:
    def started(self, stage_id: str) -> None:
        pass

    def progress(self, stage_id: str, record: dict[str, Any]) -> None:
        pass

    def finished(self, stage_id: str, status: str) -> None:
        pass


@dataclass
class Outcome:
    """Final status of every stage in scope: done | skipped (already done) | failed | blocked
    (a need failed)."""

    status: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(s in ("done", "skipped") for s in self.status.values())


def execute(
    pipeline: Pipeline,
    run_dir: Path,
    scope: list[str],
    forced: set[str],
    *,
    executor: str = "local",
    max_parallel: int | None = None,
    ray_address: str | None = None,
    display: Display | None = None,
    log: Callable[[str], None] = lambda message: None,
) -> Outcome:
    """Run the stages in `scope` (dependency order) that are not done; `forced` ones start over
    even when done. Needs outside `scope` must already be done. For the local executor a stage
    asking for more GPUs than this machine shows is a ConfigError here (it would otherwise wait
    forever for them); the CLI makes the same check first, naming the override that set it."""
    if executor == "local":
        check_local_gpus(pipeline, scope)
    display = display or QuietDisplay()
    backend: _Backend = _RayBackend(run_dir, ray_address) if executor == "ray" else _LocalBackend(run_dir)
    limit = max_parallel or len(scope)
    # Local stages share this machine: one starts only while the CPUs the running ones asked for
    # (resources.cpus) leave room for its own, so two 1-CPU RL stages share a 2-core laptop and a
    # 2-CPU stage runs alone. Ray does this accounting itself, per node.
    budget = float(os.cpu_count() or 1) if executor == "local" else float("inf")

    def cpus(sid: str) -> float:
        return float(pipeline.stages[sid].resources.get("cpus", 1.0))

    def gpus(sid: str) -> int:
        return math.ceil(float(pipeline.stages[sid].resources.get("gpus", 0.0)))

    # GPUs are whole devices here, handed to one stage at a time; Ray assigns its own
    free_gpus = visible_gpus() if executor == "local" else []
    machine_gpus = len(free_gpus)
    given: dict[str, list[str]] = {}
    outcome = Outcome()
    waiting = list(scope)
    running: dict[str, Any] = {}
    try:
        while waiting or running:
            for sid in list(waiting):
                if len(running) >= limit:
                    break
                if running and sum(map(cpus, running)) + cpus(sid) > budget:
                    continue
                if gpus(sid) > len(free_gpus):
                    continue
                needs = pipeline.stages[sid].needs
                if any(outcome.status.get(n) in ("failed", "blocked") for n in needs):
                    waiting.remove(sid)
                    outcome.status[sid] = "blocked"
                    display.finished(sid, "blocked")
                    log(f"stage {sid} blocked: a need failed")
                    continue
                if any(n in waiting or n in running for n in needs):
                    continue
                waiting.remove(sid)
                state = stage_state(pipeline, run_dir, pipeline.stages[sid], [])
                if sid not in forced and state.status == "done":
                    # A kill after the manifest said done, before the stage's checkpoints were
                    # deleted, leaves them (or their trash) behind: nothing resumes a done stage.
                    remove_tree(stage_dir(run_dir, sid) / CHECKPOINTS_DIR)
                    remove_trash(stage_dir(run_dir, sid))
                    outcome.status[sid] = "skipped"
                    display.finished(sid, "skipped")
                    continue
                write_request(pipeline, run_dir, sid, restart=sid in forced)
                if sid in forced:
                    restart_started(run_dir, sid)
                log(f"stage {sid} starting ({state.status}: {state.reason})")
                given[sid], free_gpus = free_gpus[: gpus(sid)], free_gpus[gpus(sid) :]
                devices = given[sid] if machine_gpus else None
                running[sid] = backend.launch(sid, pipeline.stages[sid].resources, devices)
                display.started(sid)
            for sid, handle in list(running.items()):
                progress = read_progress(stage_dir(run_dir, sid))
                if progress:
                    display.progress(sid, progress)
                code = backend.poll(handle)
                if code is None:
                    continue
                del running[sid]
                free_gpus += given.pop(sid, [])
                status = _settle(run_dir, sid, code)
                outcome.status[sid] = status
                display.finished(sid, status)
                log(f"stage {sid} {status} (exit code {code})")
            backend.wait(running)
    except BaseException:
        backend.stop(running)
        raise
    finally:
        backend.close()
    return outcome


def check_local_gpus(pipeline: Pipeline, scope: list[str], overrides: Sequence[str] = ()) -> None:
    """Refuse a stage in `scope` that asks for more whole GPUs than this machine shows, as the
    user error it is, before the run dir is touched. The issue points where the value was set:
    the command-line override (one of `overrides`, the KEY=VALUE texts the pipeline was loaded
    with), else the stage file's line."""
    wanted = {sid: math.ceil(float(pipeline.stages[sid].resources.get("gpus", 0.0))) for sid in scope}
    if not any(wanted.values()):
        return  # counting devices imports torch: not for a pipeline that wants none
    machine_gpus = len(visible_gpus())
    too_many = [sid for sid, count in wanted.items() if count > machine_gpus]
    if not too_many:
        return
    # Stage carries the final values only; applying the overrides again to empty mappings, with
    # `resources` the only known key, tells which override (if any) reached each stage's gpus.
    parsed, _ = parse_overrides(overrides)
    known = {sid: {("resources",), ("resources", "gpus")} for sid in pipeline.stages}
    applied, _ = apply_overrides(parsed, {sid: {} for sid in pipeline.stages}, known)
    gpus_key = ("resources", "gpus")
    issues = []
    for sid in too_many:
        stage = pipeline.stages[sid]
        source = next((text for path, text in applied[sid].items() if gpus_key[: len(path)] == path), None)
        if source is None:
            path = Path(stage.file)
            file = relative_display(path)
            _, lines, _ = load_yaml(path, file)
            line = line_of(lines, gpus_key)
        else:
            file, line = f"command line override {source!r}", None
        issues.append(
            Issue(
                file,
                f"stage {sid} asks for {stage.resources['gpus']:g} GPU(s) but this machine has "
                f"{machine_gpus} visible",
                key="resources.gpus",
                line=line,
                hint=f"lower it ({sid}.resources.gpus=N) or run where the GPUs are (--executor ray)",
            )
        )
    raise ConfigError(issues)


def _settle(run_dir: Path, stage_id: str, code: int) -> str:
    """The stage's final status; a worker that died without writing one (OOM kill, segfault)
    is recorded as failed here."""
    directory = stage_dir(run_dir, stage_id)
    manifest = read_manifest(directory) or {}
    if code == 0 and manifest.get("status") == "done":
        return "done"
    # EXIT_BUSY: another process holds the stage; its manifest is its own to write.
    if (
        code != EXIT_BUSY
        and not is_running(directory)
        and manifest.get("status") in ("running", "pending", None)
    ):
        manifest.update(
            stage=stage_id,
            status="failed",
            error=f"worker exited with code {code} without finishing; see {directory / STAGE_LOG}",
        )
        write_manifest(directory, manifest)
    return "failed"


def visible_gpus() -> list[str]:
    """This machine's GPUs as CUDA_VISIBLE_DEVICES names them: its own list when set, else every
    device torch counts."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [device.strip() for device in visible.split(",") if device.strip()]
    import torch

    return [str(index) for index in range(torch.cuda.device_count())]


BUSY_CPUS = 1.0  # a whole CPU's worth of other work


def busy_cpus(interval_s: float = 0.25, stat: Path = Path("/proc/stat")) -> float:
    """How many CPUs' worth of work runs on this machine now: the non-idle share of the CPU time
    in /proc/stat over `interval_s`, times the CPU count. Not the load average, which still
    counts a job that ended a minute ago. Where /proc/stat is missing: the 1-minute load average."""

    def ticks() -> tuple[int, int]:
        values = [int(v) for v in stat.read_text().split("\n", 1)[0].split()[1:]]
        idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
        return sum(values), idle

    try:
        total0, idle0 = ticks()
        time.sleep(interval_s)
        total1, idle1 = ticks()
    except (OSError, ValueError, IndexError):
        return os.getloadavg()[0]
    total = total1 - total0
    return 0.0 if total <= 0 else (1.0 - (idle1 - idle0) / total) * (os.cpu_count() or 1)


def busy_machine_warning(policy: str | None) -> str | None:
    """The driver's warning for a busy machine: stage threads spin-wait by default (OpenMP's
    policy), which is fastest alone and slowest beside other busy processes. None when the user
    already chose a `policy` (then nothing is sampled) or under BUSY_CPUS of work runs now."""
    if policy:
        return None
    busy = busy_cpus()
    if busy < BUSY_CPUS:
        return None
    return (
        f"other work is using {busy:.1f} of this machine's {os.cpu_count() or 1} CPU(s): if it keeps "
        "running, stage threads that spin-wait between torch's parallel regions (OpenMP's default) slow "
        "down several-fold beside it; OMP_WAIT_POLICY=PASSIVE posttrain run ... makes them sleep instead "
        "(the same results; slower on an idle machine, bench/RESULTS.md)"
    )


class _Backend(Protocol):
    def launch(self, stage_id: str, resources: dict[str, float], devices: list[str] | None) -> Any: ...
    def poll(self, handle: Any) -> int | None: ...
    def wait(self, running: dict[str, Any]) -> None: ...
    def stop(self, running: dict[str, Any]) -> None: ...
    def close(self) -> None: ...


def _worker_env() -> dict[str, str]:
    """Ray workers import the same code as the driver, installed or not."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    return env


@functools.cache
def _fork_server() -> multiprocessing.context.ForkServerContext:
    """Stage processes are forked from a clean server process that imported torch and the
    plug-in packages once (orchestration/preload.py): seconds saved per stage, and no state of
    the driver (threads, open files, a running torch) leaks into a stage.

    How a stage's idle OpenMP threads wait between torch's parallel regions is left to OpenMP
    (`OMP_WAIT_POLICY` as the user set it; unset, libgomp spins briefly, then sleeps). Both
    policies give the same bits; the speed depends on the machine (bench/omp_wait.py, numbers in
    bench/RESULTS.md): on an otherwise idle 2-core VM, 60 SFT steps of the shipped base took 8-12 s
    with the default against 35-41 s with PASSIVE, which sleeps at once and pays a wake-up per
    region; beside another spinning 2-thread process PASSIVE wins (16 s against 106 s). The driver
    warns when other work runs at start (`busy_cpus`, `busy_machine_warning`) and names the switch.
    """
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["orchestration.preload"])
    return context


def start_fork_server() -> None:
    """Start the local executor's fork server now rather than at the first stage: its imports
    (torch, the plug-ins: about 9 s on a slow 2-core VM) then run while the driver reads and
    validates the stage files, which import the stage kinds' modules themselves."""
    _fork_server()
    multiprocessing.forkserver.ensure_running()


class _LocalBackend:
    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir

    def launch(
        self, stage_id: str, resources: dict[str, float], devices: list[str] | None
    ) -> multiprocessing.process.BaseProcess:
        process = _fork_server().Process(
            target=_local_stage,
            args=(str(self.run_dir), stage_id, os.getpid(), devices),
            name=f"posttrain-stage-{stage_id}",
        )
        process.start()
        return process

    def poll(self, handle: multiprocessing.process.BaseProcess) -> int | None:
        return handle.exitcode

    def wait(self, running: dict[str, Any]) -> None:
        if running:
            time.sleep(POLL_S)

    def stop(self, running: dict[str, Any]) -> None:
        for handle in running.values():
            if handle.pid:
                os.kill(handle.pid, signal.SIGINT)
        for handle in running.values():
            handle.join(timeout=30)
            if handle.exitcode is None:
                handle.kill()

    def close(self) -> None:
        pass


def _local_stage(run_dir: str, stage_id: str, driver_pid: int, devices: list[str] | None) -> None:
    """Body of a local stage process: only its GPUs visible (None: a machine without GPUs, left
    as it is), output to the stage's log, die with the driver."""
    if devices is not None:  # before anything initialises CUDA in this process
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
    # Out of the terminal's foreground group: Ctrl-C there reaches the driver, which stops each stage
    # with one SIGINT (`stop`); a second, straight from the terminal, cut short the stage's record of
    # the first. The driver's death still ends it (exit_with_driver).
    os.setpgrp()
    exit_with_driver(driver_pid)
    with open(stage_dir(Path(run_dir), stage_id) / STAGE_LOG, "ab") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    sys.exit(run_stage(run_dir, stage_id, executor="local"))


class _RayBackend:
    def __init__(self, run_dir: Path, address: str | None) -> None:
        import ray

        self.ray = ray
        self.run_dir = run_dir
        self.started_here = not ray.is_initialized()
        if self.started_here:
            address = address or os.environ.get("RAY_ADDRESS")
            runtime_env = {"env_vars": {"PYTHONPATH": _worker_env()["PYTHONPATH"]}}
            if address:
                ray.init(address=address, runtime_env=runtime_env, log_to_driver=False)
            else:
                ray.init(include_dashboard=False, runtime_env=runtime_env, log_to_driver=False)

    def launch(self, stage_id: str, resources: dict[str, float], devices: list[str] | None) -> Any:
        # Ray picks the GPUs (`devices` is the local executor's). max_calls=1: every stage gets a
        # fresh worker process, as with the local executor, so no global state (thread counts,
        # RNGs, registries) leaks from one stage into the next.
        task = self.ray.remote(
            num_cpus=resources.get("cpus", 1.0),
            num_gpus=resources.get("gpus", 0.0),
            max_calls=1,
            max_retries=0,
        )(_ray_stage)
        return task.remote(str(self.run_dir), stage_id)

    def poll(self, handle: Any) -> int | None:
        ready, _ = self.ray.wait([handle], timeout=0)
        if not ready:
            return None
        try:
            return int(self.ray.get(handle))
        except self.ray.exceptions.RayError:
            return 1

    def wait(self, running: dict[str, Any]) -> None:
        if running:
            self.ray.wait(list(running.values()), num_returns=1, timeout=POLL_S)

    def stop(self, running: dict[str, Any]) -> None:
        for handle in running.values():
            self.ray.cancel(handle, force=True)

    def close(self) -> None:
        if self.started_here:
            self.ray.shutdown()


def _ray_stage(run_dir: str, stage_id: str) -> int:
    """Body of the Ray task: the same worker as local, with output going to the stage's log."""
    with open(stage_dir(Path(run_dir), stage_id) / STAGE_LOG, "ab") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    return run_stage(run_dir, stage_id, executor="ray")
