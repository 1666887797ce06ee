"""Run a check script under Triton's interpreter, so CI (no GPU) executes our Triton kernels.

TRITON_INTERPRET=1 must be set before the kernels' modules are imported (the `triton.jit`
decorators read it), so the script runs in a fresh interpreter; it gets the repository root as
argv[1] and prints its result as JSON on its last line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_interpreted(script: str) -> Any:
    """The JSON the script printed last, after asserting it exited cleanly."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-c", script, str(ROOT)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
