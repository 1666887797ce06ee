"""The `sandbox` fixture: a fresh sandbox per test, its snapshots under the test's tmp_path."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from posttrain.envs.sandbox import Sandbox


@pytest.fixture
def sandbox(tmp_path: Path) -> Iterator[Sandbox]:
    with Sandbox(memory_mb=256, cpu_seconds=10, max_processes=32, snapshot_root=tmp_path / "snapshots") as sb:
        yield sb
