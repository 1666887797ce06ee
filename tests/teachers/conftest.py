"""Shared fixtures of the teacher tests: tiny K3 checkpoints (a student and one teacher per effort,
different seeds so each route is recognisable). The renderer and the one-torch-thread setting are
the suite's (tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from posttrain.data.sample import EFFORTS
from posttrain.engines.testing import save_tiny_k3


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory, renderer) -> dict[str, Path]:
    """{"student": dir, "low": dir, "high": dir, "max": dir}: tiny K3 checkpoints."""
    root = tmp_path_factory.mktemp("tiny-k3")
    dirs = {"student": save_tiny_k3(root / "student", renderer.tokenizer, seed=0, sharpen=4.0)}
    for seed, effort in enumerate(EFFORTS, start=1):
        dirs[effort] = save_tiny_k3(root / effort, renderer.tokenizer, seed=seed, sharpen=4.0)
    return dirs
