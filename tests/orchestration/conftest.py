"""Fixture for the orchestration tests: stage files written into a temp dir. (The in-process CLI
fixture `posttrain` is in tests/conftest.py; the subprocess launcher in orchestration_support.)"""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
from orchestration_support import TOY_STAGES, TOY_TRAINING


@pytest.fixture
def write(tmp_path: Path) -> Callable[..., Path]:
    """write("a.yaml", *parts) -> path: each part dedented, joined; `{toy}` / `{train}` become the
    plug-in paths."""

    def write_file(name: str, *parts: str) -> Path:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        text = "".join(textwrap.dedent(part).lstrip("\n") for part in parts)
        path.write_text(text.replace("{toy}", str(TOY_STAGES)).replace("{train}", str(TOY_TRAINING)))
        return path

    return write_file
