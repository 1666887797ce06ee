"""Paths and the subprocess CLI launcher shared by the orchestration tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PLUGINS = Path(__file__).resolve().parent / "plugins"
TOY_STAGES = PLUGINS / "toy_stages.py"
TOY_TRAINING = PLUGINS / "toy_training.py"


def cli_env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", COLUMNS="250")
    return env


def start_cli(*argv: object, cwd: Path) -> subprocess.Popen[str]:
    """`posttrain ARGV` as its own process (what a user's shell runs)."""
    return subprocess.Popen(
        [sys.executable, "-m", "posttrain.cli", *map(str, argv)],
        cwd=cwd,
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
