"""The Ray executor on a local Ray instance: a two-stage DAG, each stage a Ray task in its own
worker process, results in the shared run dir."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from orchestration_support import cli_env


def test_ray_executor_runs_a_two_stage_dag(write, tmp_path: Path) -> None:
    toy = 'kind: toy-sum\nplugins: ["{toy}"]\nresources: {cpus: 1}\n'
    write("a.yaml", toy, "value: 2\n")
    dag = write("b.yaml", toy, "needs: [a.yaml]\nvalue: 3\n")
    run = tmp_path / "run"
    env = cli_env()
    env.pop("RAY_ADDRESS", None)
    result = subprocess.run(
        [sys.executable, "-m", "posttrain.cli", "run", str(dag), "--run-dir", str(run), "--executor", "ray"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    a, b = (json.loads((run / s / "manifest.json").read_text()) for s in ("a", "b"))
    assert a["status"] == b["status"] == "done"
    assert a["executor"] == b["executor"] == "ray"
    assert a["pid"] != b["pid"], "each stage runs in a fresh Ray worker process"
    assert b["inputs"] == {"a": a["model_hash"]}
    assert (run / "b" / "model" / "value.txt").read_text() == "5"
    assert b["finished"] > 0 and b["started"] >= a["finished"], "b waits for a"
