"""Exact resume: `kill -9` of `posttrain run` at random moments, several times, then the same
command again; the final weights must be bit-identical to an uninterrupted run's."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

from orchestration_support import start_cli

STAGE = 'kind: toy-train\nplugins: ["{train}"]\nseed: 5\nsteps: 100\nevery: 5\nwidth: 128\nbatch: 32\n'


def finish(process: subprocess.Popen[str]) -> None:
    out, _ = process.communicate(timeout=300)
    assert process.returncode == 0, out


def kill_when(stage: Path, run: Path, step: int | None, delay: float, *flags: str) -> str:
    """Start the run (with `flags`); SIGKILL it `delay` s after it reached `step` (or after start
    when None). Returns what happened, for the failure message."""
    started = time.time()
    process = start_cli("run", stage, "--run-dir", run, *flags, cwd=stage.parent)
    deadline = started + 240
    while step is not None and process.poll() is None and time.time() < deadline:
        if reached(run / "train", started) >= step:
            break
        time.sleep(0.01)
    time.sleep(delay)
    finished = process.poll() is not None
    if not finished:  # a run that ended on its own was reaped by poll(): its pid is gone
        os.kill(process.pid, signal.SIGKILL)
    process.wait()
    return f"kill at step>={step} +{delay:.2f}s ({'already finished' if finished else 'killed'})"


def reached(stage_dir: Path, since: float) -> int:
    """The step this attempt has reached: its progress reports (throttled) or, when a fast machine
    outruns those, the checkpoint `latest` names."""
    try:
        record = json.loads((stage_dir / "progress.json").read_text())
    except (FileNotFoundError, ValueError):
        record = {}
    progress = record.get("step", 0) if record.get("time", 0) > since else 0
    latest = stage_dir / "checkpoints" / "latest"
    try:
        fresh = latest.stat().st_mtime > since
        checkpoint = int(latest.read_text().strip().removeprefix("step-")) if fresh else 0
    except (FileNotFoundError, ValueError):
        checkpoint = 0
    return max(progress, checkpoint)


def metrics(run: Path) -> list[tuple[int, float]]:
    lines = (run / "train" / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"]) for r in map(json.loads, lines)]


def test_kill_9_at_random_moments_then_rerun_is_bit_identical(write, tmp_path: Path) -> None:
    # Each step sleeps 20 ms, so every kill lands before the stage ends: the first (at most 2 s
    # after start) before its 100 steps can have taken 2 s, the others (at most 50 ms after step 95)
    # before step 100. Bare, 100 steps took 0.33 s on a fast machine and a kill planned past step 76
    # found the stage done, leaving nothing to resume (a CI run, 2026-12-03). Sleep leaves the bits.
    stage = write("train.yaml", STAGE + "pause: 0.02\n")
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    uninterrupted = start_cli("run", stage, "--run-dir", reference, cwd=tmp_path)  # alongside the kills

    rng = random.Random()
    plan = [(None, rng.uniform(0.0, 2.0))] + [
        (s, rng.uniform(0.0, 0.05)) for s in sorted(rng.sample(range(2, 96), 2))
    ]
    events = [kill_when(stage, resumed, step, delay) for step, delay in plan]
    finish(start_cli("run", stage, "--run-dir", resumed, cwd=tmp_path))
    finish(uninterrupted)

    manifest = json.loads((resumed / "train" / "manifest.json").read_text())
    assert manifest["status"] == "done"
    assert "resumes from checkpoint step" in (resumed / "run.log").read_text(), events
    expected = (reference / "train" / "model" / "model.safetensors").read_bytes()
    assert (resumed / "train" / "model" / "model.safetensors").read_bytes() == expected, events
    assert metrics(resumed) == metrics(reference), "every step logged once, with the same loss"
    assert not (resumed / "train" / "checkpoints").exists(), "a done stage's checkpoints are removed"


def test_a_stage_that_keeps_no_checkpoints_starts_over_after_a_kill(write, tmp_path: Path) -> None:
    # Long enough (at least 3 s, whatever the machine: each step sleeps 10 ms) that the progress
    # reports, at most every 0.2 s, see it mid-run: with no checkpoint they are the only sign of the
    # step reached.
    stage = write(
        "train.yaml", STAGE.replace("steps: 100", "steps: 300") + "pause: 0.01\nkeep_checkpoints: 0\n"
    )
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    finish(start_cli("run", stage, "--run-dir", reference, cwd=tmp_path))
    event = kill_when(stage, killed, 150, 0.0)
    assert not any((killed / "train" / "checkpoints").glob("step-*")), event
    finish(start_cli("run", stage, "--run-dir", killed, cwd=tmp_path))

    log = (killed / "run.log").read_text()
    assert "resumes from checkpoint step" not in log and "attempt 2" in log, event
    expected = (reference / "train" / "model" / "model.safetensors").read_bytes()
    assert (killed / "train" / "model" / "model.safetensors").read_bytes() == expected
    assert metrics(killed) == metrics(reference), "the restart's metrics replace the killed attempt's"


def test_the_same_restart_command_after_a_kill_resumes_the_restart(write, tmp_path: Path) -> None:
    """`--restart` starts a done stage over once: killed, the same command continues that restart
    from its checkpoint (it started over from step 0 again, throwing the progress away), and a
    later `--restart`, the first having finished, starts over anew."""
    stage = write("train.yaml", STAGE + "pause: 0.02\n")
    run = tmp_path / "run"
    finish(start_cli("run", stage, "--run-dir", run, cwd=tmp_path))
    expected = (run / "train" / "model" / "model.safetensors").read_bytes()

    event = kill_when(stage, run, 40, 0.0, "--restart", "train")
    finish(start_cli("run", stage, "--run-dir", run, "--restart", "train", cwd=tmp_path))
    manifest = json.loads((run / "train" / "manifest.json").read_text())
    assert manifest["status"] == "done" and manifest["resumed_from_step"] >= 35, event
    assert (run / "train" / "model" / "model.safetensors").read_bytes() == expected

    finish(start_cli("run", stage, "--run-dir", run, "--restart", "train", cwd=tmp_path))
    manifest = json.loads((run / "train" / "manifest.json").read_text())
    assert manifest["resumed_from_step"] == 0 and manifest["attempts"] == 1
    assert not (run / "restart.json").exists()


def test_stage_runner_resumes_an_attempt_killed_after_it_wrote_its_model(tmp_path: Path) -> None:
    """StageRunner kept the output dir of an earlier attempt: a kind resumed after a kill that came
    once its model was written (the rl and mopd kinds write it with save_released, which wants an
    empty dir) failed with FileExistsError. Like the runner, every attempt starts it empty."""
    from orchestration_support import TOY_TRAINING

    from posttrain.registry import import_plugin
    from posttrain.testing import StageRunner

    import_plugin(str(TOY_TRAINING))
    body = {"steps": 4, "every": 2, "width": 8, "batch": 4}
    runner = StageRunner()
    first = runner.context("toy-train", tmp_path, body)
    runner.run(first)
    assert any(first.output_dir.iterdir())  # written, then "killed" before it was published
    resumed = runner.context("toy-train", tmp_path, body)
    assert resumed.output_dir == first.output_dir and not any(resumed.output_dir.iterdir())
    runner.run(resumed)
    assert (resumed.output_dir / "model.safetensors").is_file()
