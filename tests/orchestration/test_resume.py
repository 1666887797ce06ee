"""Exact resume: `kill -9` of `posttrain run` at random moments, several times, then the same
command again; the final weights must be bit-identical to an uninterrupted run's."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path

from orchestration_support import start_cli

STAGE = 'kind: toy-train\nplugins: ["{train}"]\nseed: 5\nsteps: 100\nevery: 4\n'


def run_to_end(stage: Path, run: Path) -> None:
    process = start_cli("run", stage, "--run-dir", run, cwd=stage.parent)
    out, _ = process.communicate(timeout=300)
    assert process.returncode == 0, out


def kill_when(stage: Path, run: Path, step: int | None, delay: float) -> str:
    """Start the run; SIGKILL it `delay` s after it reports `step` (or after start when None).
    Returns what happened, for the failure message."""
    started = time.time()
    process = start_cli("run", stage, "--run-dir", run, cwd=stage.parent)
    progress = run / "train" / "progress.json"
    deadline = started + 240
    while step is not None and process.poll() is None and time.time() < deadline:
        try:
            record = json.loads(progress.read_text())
        except (FileNotFoundError, ValueError):
            record = {}
        if record.get("time", 0) > started and record.get("step", 0) >= step:
            break
        time.sleep(0.01)
    time.sleep(delay)
    finished = process.poll() is not None
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    return f"kill at step>={step} +{delay:.2f}s ({'already finished' if finished else 'killed'})"


def metrics(run: Path) -> list[tuple[int, float]]:
    lines = (run / "train" / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"]) for r in map(json.loads, lines)]


def test_kill_9_at_random_moments_then_rerun_is_bit_identical(write, tmp_path: Path) -> None:
    stage = write("train.yaml", STAGE)
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    run_to_end(stage, reference)

    rng = random.Random()
    plan = [(None, rng.uniform(0.0, 3.0))] + [
        (s, rng.uniform(0.0, 0.05)) for s in sorted(rng.sample(range(2, 99), 3))
    ]
    events = [kill_when(stage, resumed, step, delay) for step, delay in plan]
    run_to_end(stage, resumed)

    manifest = json.loads((resumed / "train" / "manifest.json").read_text())
    assert manifest["status"] == "done"
    assert "resumes from checkpoint step" in (resumed / "run.log").read_text(), events
    expected = (reference / "train" / "model" / "model.safetensors").read_bytes()
    assert (resumed / "train" / "model" / "model.safetensors").read_bytes() == expected, events
    assert metrics(resumed) == metrics(reference), "every step logged once, with the same loss"
