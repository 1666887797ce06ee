"""A done stage's model/ is checked against the sha256 its manifest recorded: `plan`, `status` and
`run` see a damaged file (and `run` trains the stage again), and a dependant about to load a need
whose file changed in place with its mtime kept fails naming the file and the fix."""

from __future__ import annotations

import json
import os
from pathlib import Path


def two_stage_dag(write) -> Path:
    toy = 'kind: toy-sum\nplugins: ["{toy}"]\n'
    write("a.yaml", toy, "value: 2\n")
    return write("b.yaml", toy, "needs: [a.yaml]\nvalue: 3\n")


def damage(path: Path, keep_mtime: bool) -> None:
    stat = path.stat()
    path.write_text("7")  # same size, other bytes
    if keep_mtime:
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_plan_status_and_run_see_a_damaged_model(write, posttrain, tmp_path: Path) -> None:
    dag, run = two_stage_dag(write), tmp_path / "run"
    assert posttrain("run", dag, "--run-dir", run)[0] == 0
    damage(run / "a" / "model" / "value.txt", keep_mtime=False)

    code, out, err = posttrain("plan", dag, "--run-dir", run)
    assert code == 0
    row = next(line for line in out.splitlines() if line.startswith("│ a "))
    assert "stale" in row and "model/value.txt is damaged" in row and "--restart a" in row
    code, out, err = posttrain("status", run)
    row = next(line for line in out.splitlines() if line.startswith("│ a "))
    assert "damaged" in row and "model/value.txt" in row

    code, out, err = posttrain("run", dag, "--run-dir", run)  # trains a again; b reruns on it
    assert code == 0, out + err
    assert (run / "a" / "model" / "value.txt").read_text() == "2"
    assert (run / "b" / "model" / "value.txt").read_text() == "5"


def test_a_dependant_refuses_a_need_changed_in_place(write, posttrain, tmp_path: Path) -> None:
    dag, run = two_stage_dag(write), tmp_path / "run"
    assert posttrain("run", dag, "--run-dir", run)[0] == 0
    damage(run / "a" / "model" / "value.txt", keep_mtime=True)  # `plan` trusts size + mtime

    code, out, err = posttrain("run", dag, "--run-dir", run, "--only", "b", "--restart", "b")
    assert code == 1, out + err
    error = json.loads((run / "b" / "manifest.json").read_text())["error"]
    assert "input a" in error and str(run / "a" / "model") in error
    assert "model/value.txt is damaged" in error and "--restart a" in error
    assert "Traceback" not in out


def test_a_damaged_manifest_is_named_and_its_stage_starts_over(write, posttrain, tmp_path: Path) -> None:
    """A manifest.json cut short (a full disk, a hand edit) showed as `pending, not started`: its
    stage's record is lost, so `plan` and `status` name the file and `run` trains it again, saying so."""
    dag, run = two_stage_dag(write), tmp_path / "run"
    assert posttrain("run", dag, "--run-dir", run)[0] == 0
    manifest = run / "a" / "manifest.json"
    manifest.write_text(manifest.read_text()[:40])

    code, out, err = posttrain("plan", dag, "--run-dir", run)
    row = next(line for line in out.splitlines() if line.startswith("│ a "))
    assert code == 0 and "pending" in row and "manifest.json is damaged" in row, out
    code, out, err = posttrain("status", run)
    row = next(line for line in out.splitlines() if line.startswith("│ a "))
    assert code == 0 and "damaged" in row and "manifest.json is damaged" in row, out

    code, out, err = posttrain("run", dag, "--run-dir", run)
    assert code == 0, out + err
    assert "warning a: " in out and "manifest.json is damaged" in out
    assert json.loads(manifest.read_text())["status"] == "done"
    assert (run / "b" / "model" / "value.txt").read_text() == "5"  # b was skipped: a's weights are the same
