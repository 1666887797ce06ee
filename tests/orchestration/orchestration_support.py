"""Paths, the subprocess CLI launcher and a full-disk injection shared by the orchestration tests."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

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


def fail_fsync_of(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """A full disk for the atomic write of files named `name` only (posttrain.files writes them as
    `.<name>.<pid>.<id>.tmp` and fsyncs before the rename): a writer that goes through that path
    fails and leaves the old file; one that writes in place is not stopped."""
    real = os.fsync

    def fsync(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").rsplit("/", 1)[-1].startswith(f".{name}."):
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
