"""Shared fixtures of the teacher tests: the shipped tokenizer's renderer, tiny K3 checkpoints
(a student and one teacher per effort, different seeds so each route is recognisable), one torch
thread per test (tiny matmuls on a shared 2-core machine: more threads only add contention)."""

from __future__ import annotations

from pathlib import Path

import pytest

from posttrain.data.chat import ChatRenderer, load_tokenizer
from posttrain.data.sample import EFFORTS
from teachers.testing import save_tiny_k3


@pytest.fixture(scope="session")
def renderer() -> ChatRenderer:
    return ChatRenderer(load_tokenizer())


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory, renderer) -> dict[str, Path]:
    """{"student": dir, "low": dir, "high": dir, "max": dir}: tiny K3 checkpoints."""
    root = tmp_path_factory.mktemp("tiny-k3")
    dirs = {"student": save_tiny_k3(root / "student", renderer.tokenizer, seed=0, sharpen=4.0)}
    for seed, effort in enumerate(EFFORTS, start=1):
        dirs[effort] = save_tiny_k3(root / effort, renderer.tokenizer, seed=seed, sharpen=4.0)
    return dirs
