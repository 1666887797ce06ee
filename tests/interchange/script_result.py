"""Run one of this folder's check scripts in a fresh process and read the JSON line it ends with
(`RESULT {...}`): vLLM and the memory measurements each need a process of their own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def script_result(script: Path, *args: str, timeout: float = 600) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, env=env, timeout=timeout
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-4000:]
    return json.loads(lines[-1].removeprefix("RESULT "))
